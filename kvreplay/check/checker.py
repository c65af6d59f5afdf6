"""The invariant checker (docs/design.md, "Invariants"; the rules are in rules.py).

A shadow ownership model is fed by the call stream: which pages the caller holds,
which tokens it was handed, which full token owns each SWA slot. Per call it costs
time in proportion to the call's indices, never the pool. The O(pool) checks (free
lists, the whole SWA mapping) run every ``full_check_every`` calls and at the end.

A violation names the call that created the bad state: a page released with its
SWA mapping still set is reported at the free that released it, even when the free
group it was in only ended later (``detected_call``)."""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np
import torch

from kvreplay.check.pool_view import PoolView, SubPoolView, to_np
from kvreplay.check.rules import RULES, Violation, ViolationLog
from kvreplay.pool_api import ALLOCS, FREES, FULL_ONLY_FREES, SWA_ONLY_FREES

try:  # C loops for the per-call shadow updates; the numpy code below is the fallback
    from kvreplay.check import _shadow as native  # type: ignore[attr-defined]
except ImportError:
    native = None
_NOT_FOR_NATIVE = (TypeError, ValueError, BufferError)  # e.g. an int32 or strided array: use numpy

MAX_INDICES = 8
SMALL = 16  # below this many elements, Python lists are faster than numpy calls
_EMPTY = np.empty(0, dtype=np.int64)


class Shadow:
    """What the caller holds in one sub-pool, as the call stream says."""

    def __init__(self, sub: SubPoolView) -> None:
        self.sub = sub
        self.ps = sub.page_size
        self.num_pages = sub.num_pages
        self.reset()

    def reset(self) -> None:
        self.owned = np.zeros(self.num_pages + 1, dtype=bool)
        self.live_tok = np.zeros((self.num_pages + 1) * self.ps, dtype=bool)
        self.live_by_page = self.live_tok.reshape(self.num_pages + 1, self.ps)  # a view: one write clears a page
        self.owned_count = 0

    def in_range(self, tokens: np.ndarray) -> np.ndarray:
        return (tokens >= self.ps) & (tokens < (self.num_pages + 1) * self.ps)

    def handout(self, tokens: np.ndarray) -> tuple[Any, Any]:
        """Mark tokens handed out; returns (out-of-range or padding, already live)."""
        if native is not None:
            try:
                bad, again, fresh = native.handout(self.live_tok, self.owned, tokens, self.ps)
            except _NOT_FOR_NATIVE:
                pass
            else:
                self.owned_count += fresh
                return bad, again
        bad = _EMPTY
        if len(tokens) and (tokens.min() < self.ps or tokens.max() >= len(self.live_tok)):
            ok = self.in_range(tokens)
            bad, tokens = tokens[~ok], tokens[ok]
        live = self.live_tok
        hit = live[tokens]
        again = tokens[hit] if hit.any() else _EMPTY
        live[tokens] = True
        pages = tokens // self.ps
        fresh = pages[~self.owned[pages]]
        if len(fresh):
            self.owned[fresh] = True
            # A set counts a few dozen distinct pages faster than sorting in numpy.
            self.owned_count += len(set(fresh.tolist())) if len(fresh) <= SMALL * 16 else len(np.unique(fresh))
        return bad, again

    def release(self, pages: np.ndarray | list[int]) -> Any:
        """Mark distinct pages released; returns the ones the caller did not hold."""
        if native is not None:
            try:
                bad, released = native.release(self.owned, self.live_tok, pages, self.ps)
            except _NOT_FOR_NATIVE:
                pass
            else:
                self.owned_count -= released
                return bad
        if len(pages) <= SMALL:
            # A few pages: plain Python beats numpy's per-call overhead several times over.
            owned, live, n = self.owned, self.live_by_page, self.num_pages
            bad = []
            for p in pages.tolist() if isinstance(pages, np.ndarray) else pages:
                if 1 <= p <= n and owned[p]:
                    owned[p] = False
                    live[p] = False
                    self.owned_count -= 1
                else:
                    bad.append(p)
            return np.array(bad, dtype=np.int64) if bad else _EMPTY
        pages = np.asarray(pages, dtype=np.int64)
        valid = (pages >= 1) & (pages <= self.num_pages)
        if not valid.all():
            bad = pages[~valid]
            return np.concatenate([bad, self.release(pages[valid])])
        held_mask = self.owned[pages]
        held = pages if held_mask.all() else pages[held_mask]
        self.owned[held] = False
        self.owned_count -= len(held)
        self.live_by_page[held] = False
        return pages[~held_mask] if len(held) != len(pages) else _EMPTY


_OFFSETS: dict[int, np.ndarray] = {}


def _expand(pages: np.ndarray, ps: int) -> np.ndarray:
    off = _OFFSETS.get(ps)
    if off is None:
        off = _OFFSETS[ps] = np.arange(ps, dtype=np.int64)
    return (pages[:, None] * ps + off).reshape(-1)


def _distinct(pages: np.ndarray) -> np.ndarray | list[int]:
    """Sorted distinct pages: a Python list when few (cheaper to work on), else numpy."""
    if native is not None:
        try:
            return native.distinct_pages(pages, 1)
        except _NOT_FOR_NATIVE:
            pass
    if len(pages) <= SMALL * 4:
        return sorted(set(pages.tolist()))
    return np.unique(pages)


def _pages_of(tokens: Any, ps: int) -> np.ndarray | list[int]:
    """Sorted distinct pages of an index tensor (a Python list when few)."""
    if native is not None:
        try:
            return native.distinct_pages(to_np(tokens), ps)
        except _NOT_FOR_NATIVE:
            pass
    if type(tokens) is torch.Tensor and tokens.device.type == "cpu" and tokens.numel() <= SMALL * 4:
        return sorted({x // ps for x in tokens.reshape(-1).tolist()})
    return _distinct(to_np(tokens) // ps)


def _index_args(method: str, args: dict[str, Any], ps: int) -> np.ndarray | list[int]:
    """The distinct full-pool pages a free call names."""
    if "segments" in args:
        segs = args["segments"]
        if len(segs) == 1:
            return _pages_of(segs[0][0], ps)
        parts = [to_np(t) for t, _ in segs]
        return _distinct(np.concatenate(parts) // ps) if parts else []
    if method == "free_page_ids":
        return _pages_of(args.get("page_ids", args.get("free_index")), 1)
    return _pages_of(args["free_index"], ps)


class InvariantChecker:
    def __init__(self, view: PoolView, *, full_check_every: int = 1000, keep: int = 20) -> None:
        self.view = view
        self.swa = view.family == "swa"
        self.shadows = {name: Shadow(sub) for name, sub in view.subs.items()}
        self.main = self.shadows["full"] if self.swa else self.shadows["pool"]
        self.ps = self.main.ps
        # A pool's size never changes: read once, not after every call.
        self._bounds = [(name, sh, sh.sub.size, sh.sub.capacity) for name, sh in self.shadows.items()]
        self.full_check_every = full_check_every
        self.log = ViolationLog(keep=keep)
        self.in_group = False
        self.calls = 0
        self._since_full = 0
        self.settles = 0  # calls settled outside free groups, ever: full checks fall every full_check_every
        self._avail: dict[str, int] | None = None  # sub-pool counters the last call left, outside groups
        self._pending_released: list[tuple[int, str, np.ndarray]] = []
        self._pending_touched: list[tuple[int, str, np.ndarray]] = []
        if self.swa:
            self.swa_owner = np.zeros(len(self.shadows["swa"].live_tok), dtype=np.int64)

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
        if self.swa and self.view.mapping is not None:
            full, swa = self.shadows["full"], self.shadows["swa"]
            m = to_np(self.view.mapping)[: len(full.live_tok)]
            toks = np.flatnonzero(m > 0)
            toks = toks[full.owned[toks // full.ps]]
            peers = m[toks]
            ok = swa.in_range(peers)
            toks, peers = toks[ok], peers[ok]
            full.live_tok[toks] = True
            swa.live_tok[peers] = True
            self.swa_owner[peers] = toks
        pool = self.view.pool
        self.in_group = getattr(pool, "is_not_in_free_group", True) is False or \
            isinstance(getattr(pool, "free_group", None), list)

    # -- checkpoints ---------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What the checker knows beyond the pool's own state (which slots the caller
        holds, token by token), as JSON for a checkpoint: a replay that starts from the
        checkpoint with it checks every later call as a replay from the start would.
        Only between calls and outside a free group (nothing pending)."""
        if self.in_group or self._pending_released or self._pending_touched:
            raise ValueError("a checker state is taken outside free groups only")
        out: dict[str, Any] = {"format": 1, "calls": self.calls, "settles": self.settles, "shadows": {}}
        for name, sh in self.shadows.items():
            out["shadows"][name] = {"owned": _packed(sh.owned), "live": _packed(sh.live_tok)}
        if self.swa:
            out["swa_owner"] = _squeezed(self.swa_owner)
        return out

    def restore(self, state: dict[str, Any]) -> None:
        """Take up a ``state()``; the pool must already hold the checkpoint's state."""
        if state.get("format") != 1 or set(state.get("shadows", {})) != set(self.shadows):
            raise ValueError("the checkpoint's checker state is not one for this pool")
        for name, sh in self.shadows.items():
            enc = state["shadows"][name]
            sh.owned[:] = _unpacked(enc["owned"], len(sh.owned))
            sh.live_tok[:] = _unpacked(enc["live"], len(sh.live_tok))
            sh.owned_count = int(sh.owned.sum())
        if self.swa:
            self.swa_owner[:] = _unsqueezed(state["swa_owner"], len(self.swa_owner))
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
            if not (self.swa and method not in FULL_ONLY_FREES):
                return pages, None
            if isinstance(pages, list):
                m = self.view.mapping_np()
                if native is not None and m is not None:
                    try:
                        return pages, native.page_peers(m, pages, self.ps, False)
                    except _NOT_FOR_NATIVE:
                        pass
                item, ps, n = self.view.peer_item(), self.ps, len(self.view.mapping)
                peers = [q for p in pages for o in range(ps) if 0 <= (t := p * ps + o) < n and (q := item(t)) > 0]
                return pages, peers
            peers = self.view.peers(_expand(pages, self.ps))
            return pages, peers[peers > 0] if len(peers) and peers.min() <= 0 else peers
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
            if self.swa:
                self.swa_owner[:] = 0
            self._pending_released.clear()
            self._pending_touched.clear()
        elif method in ALLOCS:
            self._after_alloc(call, method, args, result, raised, pre, avail)
        elif method in FREES and pre is not None:
            self._after_free(call, method, *pre)
        elif method == "set_full_to_swa_mapping" and self.swa:
            full = to_np(args["full_indices"])
            swa = to_np(args["swa_indices"])
            ok = self.shadows["swa"].in_range(swa)
            self.swa_owner[swa[ok]] = full[ok]
            self._pending_touched.append((call, method, full))
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
        sub = "full" if self.swa else "pool"
        bad, again = self.main.handout(tokens)
        if len(bad):
            self._flag(call, method, "ownership", "handout-out-of-range", sub, bad,
                       f"{method} handed out slot(s) outside 1..num_pages or on padding page 0")
        if len(again):
            self._flag(call, method, "ownership", "handout-while-live", sub, again,
                       f"{method} handed out slot(s) the caller still holds")
        if not self.swa:
            return
        mapped = tokens
        if method == "alloc_extend_swa_tail":
            tail = int(args.get("swa_tail_len", 0))
            nontail = tokens[: len(tokens) - tail]
            mapped = tokens[len(tokens) - tail:] if tail else tokens[:0]
            self._check_nontail(call, method, nontail)
        m = self.view.mapping_np()
        if native is not None and m is not None:
            swa = self.shadows["swa"]
            try:
                no_peer, shared, bad, again, fresh = native.swa_alloc(
                    m, self.swa_owner, self.main.live_tok, swa.live_tok, swa.owned, mapped, swa.ps)
            except _NOT_FOR_NATIVE:
                pass
            else:
                swa.owned_count += fresh
                self._flag_no_peer(call, method, no_peer)
                if shared:
                    slots = [q for q, _, _ in shared]
                    self._flag(call, method, "swa-mapping", "shared-swa-slot", "swa", slots,
                               f"{method}: live full slots {shared[0][1]} and {shared[0][2]} "
                               f"both map to SWA slot {slots[0]}")
                self._flag_swa_handout(call, method, bad, again)
                return
        peers = self.view.peers(mapped)
        if len(peers) and peers.min() <= 0:
            self._flag_no_peer(call, method, mapped[peers <= 0])
            mapped, peers = mapped[peers > 0], peers[peers > 0]
        self._check_shared(call, method, mapped, peers)
        bad, again = self.shadows["swa"].handout(peers)
        self._flag_swa_handout(call, method, bad, again)
        if len(bad):
            inr = self.shadows["swa"].in_range(peers)
            mapped, peers = mapped[inr], peers[inr]
        self.swa_owner[peers] = mapped

    def _flag_no_peer(self, call: int, method: str, no_peer: Any) -> None:
        if len(no_peer):
            self._flag(call, method, "swa-mapping", "allocated-without-peer", "full", no_peer,
                       f"{method} left allocated full slot(s) with no SWA peer")

    def _flag_swa_handout(self, call: int, method: str, bad: Any, again: Any) -> None:
        if len(bad):
            self._flag(call, method, "ownership", "handout-out-of-range", "swa", bad,
                       f"{method} mapped full slots to SWA slot(s) outside the SWA pool or on page 0")
        if len(again):
            self._flag(call, method, "ownership", "handout-while-live", "swa", again,
                       f"{method} gave out SWA slot(s) that are still live")

    def _check_nontail(self, call: int, method: str, nontail: np.ndarray) -> None:
        m = self.view.mapping_np()
        if native is not None and m is not None:
            try:
                if not native.any_mapped(m, nontail):
                    return
            except _NOT_FOR_NATIVE:
                pass
        peers = self.view.peers(nontail)
        stale = peers != 0
        if not stale.any():
            return
        self._flag(call, method, "swa-mapping", "tail-prealloc-nontail-mapped", "full", nontail[stale],
                   f"{method}: {int(stale.sum())} non-tail full slot(s) keep an old SWA peer "
                   f"(first {int(nontail[stale][0])} -> SWA {int(peers[stale][0])})")
        self._check_shared(call, method, nontail[stale], peers[stale])
        swa = self.shadows["swa"]
        p = peers[stale]
        dangling = ~swa.in_range(p) | ~swa.live_tok[np.clip(p, 0, len(swa.live_tok) - 1)]
        if dangling.any():
            self._flag(call, method, "swa-mapping", "peer-not-live", "swa", p[dangling],
                       f"{method}: non-tail full slot(s) map to SWA slot(s) that are free")

    def _check_shared(self, call: int, method: str, full: np.ndarray, peers: np.ndarray) -> None:
        """Another live full slot still maps to one of these SWA slots."""
        if not len(peers):
            return
        swa = self.shadows["swa"]
        if peers.min() < swa.ps or peers.max() >= len(swa.live_tok):
            inr = swa.in_range(peers)
            full, peers = full[inr], peers[inr]
        prev = self.swa_owner[peers]
        cand = prev != full
        cand &= self.main.live_tok[prev]  # owner 0 is padding, never live
        if cand.any():
            still = self.view.peers(prev[cand]) == peers[cand]
            if still.any():
                s = peers[cand][still]
                self._flag(call, method, "swa-mapping", "shared-swa-slot", "swa", s,
                           f"{method}: live full slots {int(prev[cand][still][0])} and {int(full[cand][still][0])} "
                           f"both map to SWA slot {int(s[0])}")

    def _after_free(self, call: int, method: str, pages: np.ndarray, swa_peers: np.ndarray | None) -> None:
        sub = "full" if self.swa else "pool"
        if method not in SWA_ONLY_FREES:
            not_held = self.main.release(pages)
            if len(not_held):
                self._flag(call, method, "ownership", "free-not-live", sub, not_held,
                           f"{method} freed page(s) the caller does not hold (double or wild free)")
        if self.swa:
            self._pending_released.append((call, method, pages))
            if swa_peers is not None and len(swa_peers):
                ps = self.ps
                if native is not None and isinstance(swa_peers, list):
                    swa_pages = native.distinct_pages(swa_peers, ps)
                else:
                    swa_pages = (sorted({q // ps for q in swa_peers}) if isinstance(swa_peers, list)
                                 else _distinct(swa_peers // ps))
                not_held = self.shadows["swa"].release(swa_pages)
                if len(not_held):
                    self._flag(call, method, "ownership", "free-not-live", "swa", not_held,
                               f"{method} released SWA page(s) that are not live (double free)")

    # -- at the end of every call outside a free group ---------------------------
    def _settle(self, call: int, method: str, available: dict[str, int]) -> None:
        if self.swa and (self._pending_released or self._pending_touched):
            self._check_released_unmapped(call)
            self._check_touched(call)
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

    def _check_released_unmapped(self, call: int) -> None:
        pending, self._pending_released = self._pending_released, []
        if not pending:
            return
        # One lookup for the whole group; per-call attribution only when something is wrong.
        if not self._any_released_mapped(pending):
            return
        for src_call, src_method, pages in pending:
            toks = _expand(np.asarray(pages, dtype=np.int64), self.ps)
            peers = self.view.peers(toks)
            keep = peers != 0
            if src_method in SWA_ONLY_FREES:
                # The full slots stay live: a later call in the group may give them a new peer.
                repointed = [f for s, _, f in self._pending_touched if s > src_call]
                if repointed:
                    keep &= ~np.isin(toks, np.concatenate(repointed))
            if keep.any():
                what = "released page" if src_method not in SWA_ONLY_FREES else "page whose SWA peer was freed"
                self._flag(src_call, src_method, "swa-mapping", "released-page-keeps-peer", "full", toks[keep],
                           f"{src_method}: {int(keep.sum())} slot(s) of a {what} keep an SWA mapping "
                           f"(first {int(toks[keep][0])} -> SWA {int(peers[keep][0])})", detected=call)

    def _any_released_mapped(self, pending: list[tuple[int, str, Any]]) -> bool:
        m = self.view.mapping_np()
        if native is not None and m is not None:
            try:
                return any(native.page_peers(m, pages, self.ps, True) for _, _, pages in pending)
            except _NOT_FOR_NATIVE:
                pass
        allpages = np.concatenate([np.asarray(p, dtype=np.int64) for _, _, p in pending])
        return bool(len(allpages)) and bool(self.view.peers(_expand(allpages, self.ps)).any())

    def _check_touched(self, call: int) -> None:
        swa = self.shadows["swa"]
        for src_call, src_method, full in self._pending_touched:
            peers = self.view.peers(full)
            live = self.main.live_tok[full] & (peers > 0)
            p = peers[live]
            bad = ~swa.in_range(p) | ~swa.live_tok[np.clip(p, 0, len(swa.live_tok) - 1)]
            if bad.any():
                self._flag(src_call, src_method, "swa-mapping", "peer-not-live", "swa", p[bad],
                           f"{src_method}: live full slot(s) map to SWA slot(s) that are not live", detected=call)
        self._pending_touched.clear()

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
        if self.swa:
            self._full_mapping_check(call, method, free_by_sub, final)

    def _full_mapping_check(self, call: int, method: str, free_by_sub: dict[str, np.ndarray], final: bool) -> None:
        m = to_np(self.view.mapping)
        full, swa = self.main, self.shadows["swa"]
        if m[-1] != -1:
            self._flag(call, method, "swa-mapping", "sentinel-changed", "full", [len(m) - 1],
                       f"the trailing mapping entry is {int(m[-1])}, not -1")
        body = m[: len(full.live_tok)]
        f_idx = np.flatnonzero(body != 0)
        s = body[f_idx]
        free_page = ~full.owned[f_idx // full.ps]
        if free_page.any():
            self._flag(call, method, "swa-mapping", "released-page-keeps-peer", "full", f_idx[free_page],
                       f"{int(free_page.sum())} slot(s) of free full pages keep an SWA mapping")
        live = full.live_tok[f_idx] & (s > 0)
        ls = s[live]
        uniq, counts = np.unique(ls, return_counts=True)
        if (counts > 1).any():
            self._flag(call, method, "swa-mapping", "shared-swa-slot", "swa", uniq[counts > 1],
                       f"{int((counts > 1).sum())} SWA slot(s) are mapped from more than one live full slot")
        swa_free = np.zeros(swa.num_pages + 1, dtype=bool)
        fp = free_by_sub["swa"]
        swa_free[fp[(fp >= 0) & (fp <= swa.num_pages)]] = True
        inr = swa.in_range(ls)
        dead = ~inr
        dead[inr] = swa_free[ls[inr] // swa.ps] | ~swa.live_tok[ls[inr]]
        if dead.any():
            self._flag(call, method, "swa-mapping", "peer-not-live", "swa", ls[dead],
                       f"{int(dead.sum())} live full slot(s) map to SWA slot(s) that are free")
        mapped = np.zeros(len(swa.live_tok), dtype=bool)
        mapped[ls[inr]] = True
        orphan = np.flatnonzero(swa.live_tok & ~mapped)
        if len(orphan):
            self._flag(call, method, "quiescence" if final else "swa-mapping", "orphan-swa-slot", "swa", orphan,
                       f"{len(orphan)} live SWA slot(s) are mapped from no live full slot")

    def finish(self, call: int) -> dict[str, Any]:
        """End of trace: the O(pool) checks as quiescence, plus what is still held."""
        self.full_check(call, "end-of-trace", final=True)
        return {name: s.owned_count * s.ps for name, s in self.shadows.items()}


def _packed(bits: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.packbits(bits).tobytes(), 1)).decode()


def _unpacked(text: str, n: int) -> np.ndarray:
    raw = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8)
    bits = np.unpackbits(raw)[:n].astype(bool)
    if len(bits) != n:
        raise ValueError("a checkpoint's checker state has the wrong size for this pool")
    return bits


def _squeezed(a: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(a.astype(np.int64).tobytes(), 1)).decode()


def _unsqueezed(text: str, n: int) -> np.ndarray:
    a = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.int64)
    if len(a) != n:
        raise ValueError("a checkpoint's checker state has the wrong size for this pool")
    return a
