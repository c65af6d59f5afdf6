"""The invariant checker (docs/design.md, "Invariants"; the rules are in rules.py).

A shadow ownership model (shadow.py) is fed by the call stream: which pages the caller
holds, which tokens it was handed. Per call it costs time in proportion to the call's
indices, never the pool. The O(pool) checks (free lists) run every
``full_check_every`` calls and at the end. A family's own checks (an SWA pool's
mapping and SWA sub-pool) are a FamilyChecks its record names (``Family.checks``),
which this checker calls at the same moments.

A violation names the call that created the bad state: a page released with its
SWA mapping still set is reported at the free that released it, even when the free
group it was in only ended later (``detected_call``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvreplay.check import kernels
from kvreplay.check.growth import RULE as GROWTH_RULE
from kvreplay.check.growth import GrowthWatch
from kvreplay.check.pool_view import PoolView, to_np
from kvreplay.check.rules import RULES, Violation, ViolationLog
from kvreplay.check.shadow import Shadow, packed, unpacked
from kvreplay.contract.record import load
from kvreplay.contract.registry import family
from kvreplay.families.sglang.vocabulary import ALLOCS, FREES, SWA_ONLY_FREES

MAX_INDICES = 8


def _index_args(method: str, args: dict[str, Any], ps: int) -> np.ndarray | list[int]:
    """The distinct full-pool pages a free call names."""
    if "segments" in args:
        segs = args["segments"]
        if len(segs) == 1:
            return kernels.pages_of(segs[0][0], ps)
        parts = [to_np(t) for t, _ in segs]
        return kernels.distinct(np.concatenate(parts) // ps) if parts else []
    if method == "free_page_ids":
        return kernels.pages_of(args.get("page_ids", args.get("free_index")), 1)
    return kernels.pages_of(args["free_index"], ps)


class InvariantChecker:
    def __init__(self, view: PoolView, *, full_check_every: int = 1000, keep: int = 20) -> None:
        self.view = view
        self.shadows = {name: Shadow(sub) for name, sub in view.subs.items()}
        self.main_name = next(iter(self.shadows))  # the first sub-pool: the one the API's own indices name
        self.main = self.shadows[self.main_name]
        self.ps = self.main.ps
        # A pool's size never changes: read once, not after every call.
        self._bounds = [(name, sh, sh.sub.size, sh.sub.capacity) for name, sh in self.shadows.items()]
        self.growth = GrowthWatch(view.pool, sum(int(sh.sub.capacity) for sh in self.shadows.values()))
        self.full_check_every = full_check_every
        self.log = ViolationLog(keep=keep)
        self.in_group = False
        self.calls = 0
        self._since_full = 0
        self.settles = 0  # calls settled outside free groups, ever: full checks fall every full_check_every
        self._avail: dict[str, int] | None = None  # sub-pool counters the last call left, outside groups
        # A family's own checks report through _flag, looked up at each finding (a test may wrap it).
        checks = family(view.family).checks
        self.mapping = load(checks)(view, self.shadows, lambda *a, **k: self._flag(*a, **k)) if checks else None

    def adopt(self) -> None:
        """Start from the pool's state now, for a trace that begins with a snapshot.

        Held pages are the ones not free. Tokens are known live only where the SWA
        mapping gives them a peer (the snapshot does not say which slots of a held page
        are in use), so from a snapshot the token-level checks start with those."""
        for name, sh in self.shadows.items():
            free = self.view.subs[name].free_pages()
            owned = np.ones(sh.num_pages + 1, dtype=bool)
            owned[0] = False
            owned[free[(free >= 1) & (free <= sh.num_pages)]] = False
            pending = self.view.pending_pages(name)  # freed in the group in progress: the caller let go
            owned[pending[(pending >= 1) & (pending <= sh.num_pages)]] = False
            sh.owned[:] = owned
            sh.live_tok[:] = False
            sh.owned_count = int(owned.sum())
        if self.mapping is not None:
            self.mapping.adopt()
        pool = self.view.pool
        self.in_group = getattr(pool, "is_not_in_free_group", True) is False or \
            isinstance(getattr(pool, "free_group", None), list)

    # -- checkpoints ---------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What the checker knows beyond the pool's own state (which slots the caller
        holds, token by token), as JSON for a checkpoint: a replay that starts from the
        checkpoint with it checks every later call as a replay from the start would.
        Only between calls and outside a free group (nothing pending)."""
        if self.in_group or (self.mapping is not None and self.mapping.pending):
            raise ValueError("a checker state is taken outside free groups only")
        out: dict[str, Any] = {"format": 1, "calls": self.calls, "settles": self.settles, "shadows": {}}
        for name, sh in self.shadows.items():
            out["shadows"][name] = {"owned": packed(sh.owned), "live": packed(sh.live_tok)}
        if self.mapping is not None:
            out["swa_owner"] = self.mapping.state()
        return out

    def restore(self, state: dict[str, Any]) -> None:
        """Take up a ``state()``; the pool must already hold the checkpoint's state."""
        if state.get("format") != 1 or set(state.get("shadows", {})) != set(self.shadows):
            raise ValueError("the checkpoint's checker state is not one for this pool")
        for name, sh in self.shadows.items():
            enc = state["shadows"][name]
            sh.owned[:] = unpacked(enc["owned"], len(sh.owned))
            sh.live_tok[:] = unpacked(enc["live"], len(sh.live_tok))
            sh.owned_count = int(sh.owned.sum())
        if self.mapping is not None:
            self.mapping.restore(state["swa_owner"])
        self.calls = int(state["calls"])
        self.settles = int(state["settles"])
        self._since_full = self.settles % self.full_check_every if self.full_check_every else 0
        self.in_group = False
        self._avail = None

    # -- reporting -------------------------------------------------------------
    def _flag(self, call: int, method: str, invariant: str, rule: str, sub: str, idx: Any, msg: str,
              detected: int | None = None) -> None:
        # Every finding goes through here, so the checker can fire no rule the table
        # (check/rules.py) lacks; tests/test_rules.py trips every rule of the table.
        if f"{invariant}/{rule}" not in RULES:
            raise KeyError(f"the checker fired {invariant}/{rule}, which check/rules.py does not list")
        indices = [int(x) for x in np.asarray(idx).reshape(-1)[:MAX_INDICES]]
        self.log.add(Violation(call, method, invariant, rule, sub, indices, msg,
                               call if detected is None else detected))

    # -- per call --------------------------------------------------------------
    def before(self, method: str, args: dict[str, Any]) -> Any:
        """Cheap reads that must happen before the call mutates the pool: counters
        before an alloc; for a free, the pages it names and their SWA peers now."""
        if method in ALLOCS:
            # The counters are those the last call left (nothing changes the pool between
            # calls), from the sub-pools' reads; read now only when none were kept.
            return self.view.counters(self._avail if self._avail is not None else self.view.sub_available())
        if method in FREES:
            pages = _index_args(method, args, self.ps)
            return pages, (self.mapping.peers_before_free(method, pages) if self.mapping is not None else None)
        return None

    def after(self, call: int, method: str, args: dict[str, Any], result: Any, raised: bool, pre: Any,
              avail: dict[str, int] | None = None) -> None:
        """Feed one top-level call to the shadow model and check what it left."""
        self.calls += 1
        if method == "free_group_begin" and not raised:
            self.in_group = True
        elif method == "clear" and not raised:
            for s in self.shadows.values():
                s.reset()
            if self.mapping is not None:
                self.mapping.reset()
        elif method in ALLOCS:
            self._after_alloc(call, method, args, result, raised, pre, avail)
        elif method in FREES and pre is not None:
            self._after_free(call, method, *pre)
        elif method == "set_full_to_swa_mapping" and self.mapping is not None:
            self.mapping.mapped(call, method, args)
        if method == "free_group_end" and not raised:
            self.in_group = False
        if not self.in_group:
            if avail is None:
                avail = self.view.sub_available()
            self._settle(call, method, avail)
            self._avail = avail
        else:
            self._avail = None

    def _after_alloc(self, call: int, method: str, args: dict[str, Any], result: Any, raised: bool,
                     pre: Any, avail: dict[str, int] | None) -> None:
        if result is None:
            now = self.view.counters(avail if avail is not None else self.view.sub_available())
            if not raised and pre is not None and now != pre:
                self._flag(call, method, "none-unchanged", "none-changed-state", "pool", [],
                           f"{method} returned None but counters went from {pre} to {now}")
            return
        if not isinstance(result, torch.Tensor):
            return
        tokens = to_np(result)
        sub = self.main_name
        bad, again = self.main.handout(tokens)
        if len(bad):
            self._flag(call, method, "ownership", "handout-out-of-range", sub, bad,
                       f"{method} handed out slot(s) outside 1..num_pages or on padding page 0")
        if len(again):
            self._flag(call, method, "ownership", "handout-while-live", sub, again,
                       f"{method} handed out slot(s) the caller still holds")
        if self.mapping is not None:
            self.mapping.after_alloc(call, method, args, tokens)

    def _after_free(self, call: int, method: str, pages: np.ndarray, swa_peers: np.ndarray | None) -> None:
        sub = self.main_name
        if method not in SWA_ONLY_FREES:
            not_held = self.main.release(pages)
            if len(not_held):
                self._flag(call, method, "ownership", "free-not-live", sub, not_held,
                           f"{method} freed page(s) the caller does not hold (double or wild free)")
        if self.mapping is not None:
            self.mapping.after_free(call, method, pages, swa_peers)

    # -- at the end of every call outside a free group ---------------------------
    def _settle(self, call: int, method: str, available: dict[str, int]) -> None:
        if self.mapping is not None and self.mapping.pending:
            self.mapping.settle(call)
        for name, shadow, size, capacity in self._bounds:
            avail = available[name]
            if not 0 <= avail <= size:
                self._flag(call, method, "capacity", "available-out-of-bounds", name, [],
                           f"{name}: available_size() is {avail}, outside 0..{size}")
            if shadow.owned_count * shadow.ps + avail != capacity:
                sub = shadow.sub
                self._flag(call, method, "ownership", "live-plus-available", name, [],
                           f"{name}: caller holds {shadow.owned_count * shadow.ps} slots and the pool says "
                           f"{avail} are available; together {shadow.owned_count * shadow.ps + avail}, "
                           f"not the pool's {sub.capacity}")
        self._since_full += 1
        self.settles += 1
        if self.full_check_every and self._since_full >= self.full_check_every:
            self.full_check(call, method)

    # -- O(pool) checks -------------------------------------------------------------
    def full_check(self, call: int, method: str, *, final: bool = False) -> None:
        self._since_full = 0
        free_by_sub = {}
        for name, shadow in self.shadows.items():
            free = shadow.sub.free_pages()
            free_by_sub[name] = free
            uniq, counts = np.unique(free, return_counts=True)
            if (counts > 1).any():
                self._flag(call, method, "free-list", "duplicate-free-page", name, uniq[counts > 1],
                           f"{name}: page(s) appear more than once in free + staged pages")
            if (free == 0).any():
                self._flag(call, method, "free-list", "padding-page-free", name, [0],
                           f"{name}: padding page 0 is on the free list")
            out = (free < 0) | (free > shadow.num_pages)
            if out.any():
                self._flag(call, method, "free-list", "page-out-of-range", name, free[out],
                           f"{name}: free list holds page ids outside 1..{shadow.num_pages}")
            inr = uniq[(uniq >= 1) & (uniq <= shadow.num_pages)]
            live_free = inr[shadow.owned[inr]]
            if len(live_free):
                self._flag(call, method, "ownership", "live-page-free", name, live_free,
                           f"{name}: page(s) the caller holds are on the free list")
            is_free = np.zeros(shadow.num_pages + 1, dtype=bool)
            is_free[inr] = True
            lost = np.flatnonzero(~is_free[1:] & ~shadow.owned[1:]) + 1
            if len(lost):
                self._flag(call, method, "quiescence" if final else "ownership", "leaked-page", name, lost,
                           f"{name}: {len(lost)} page(s) are neither held by the caller nor free (leaked)")
        if self.mapping is not None:
            self.mapping.full_check(call, method, free_by_sub, final)
        for path, size in self.growth.sample():
            self._flag(call, method, *GROWTH_RULE.split("/"), self.main_name, [size], self.growth.message(path, size))

    def finish(self, call: int) -> dict[str, Any]:
        """End of trace: the O(pool) checks as quiescence, plus what is still held."""
        self.full_check(call, "end-of-trace", final=True)
        return {name: s.owned_count * s.ps for name, s in self.shadows.items()}
