"""The checks only an SWA pool needs: its full-to-SWA mapping (rules ``swa-mapping/*``)
and the SWA sub-pool's ownership, fed by the same call stream as the generic checks
(checker.py), which call in here only for pools of the SWA family.

It keeps which full slot owns each SWA slot, the pages released in a free group and the
full slots a call re-pointed, so that a page released with its SWA peer still mapped is
reported at the free that released it, when the group ends."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvreplay.check import kernels
from kvreplay.check.family_checks import FamilyChecks, Flag
from kvreplay.check.pool_view import PoolView, to_np
from kvreplay.check.shadow import Shadow, squeezed, unsqueezed
from kvreplay.families.sglang.vocabulary import FULL_ONLY_FREES, SWA_ONLY_FREES


def mapping_checks(view: PoolView, shadows: dict[str, Shadow], flag: Flag) -> SWAMappingChecker:
    """The SWA family's checks beyond the shared ones (its record names this)."""
    return SWAMappingChecker(view, shadows["full"], shadows["swa"], flag)


class SWAMappingChecker(FamilyChecks):
    def __init__(self, view: PoolView, full: Shadow, swa: Shadow, flag: Flag) -> None:
        super().__init__(view, {"full": full, "swa": swa}, flag)
        self.view, self.full, self.swa, self.ps = view, full, swa, full.ps
        self._flag = flag
        self.owner = np.zeros(len(swa.live_tok), dtype=np.int64)  # the full slot each SWA slot was mapped from
        self.pending_released: list[tuple[int, str, Any]] = []
        self.pending_touched: list[tuple[int, str, np.ndarray]] = []

    def reset(self) -> None:
        self.owner[:] = 0
        self.pending_released.clear()
        self.pending_touched.clear()

    def adopt(self) -> None:
        """From a snapshot: tokens are known live where the mapping gives them a peer."""
        if self.view.mapping is None:
            return
        full, swa = self.full, self.swa
        m = to_np(self.view.mapping)[: len(full.live_tok)]
        toks = np.flatnonzero(m > 0)
        toks = toks[full.owned[toks // full.ps]]
        peers = m[toks]
        ok = swa.in_range(peers)
        toks, peers = toks[ok], peers[ok]
        full.live_tok[toks] = True
        swa.live_tok[peers] = True
        self.owner[peers] = toks

    def state(self) -> str:
        return squeezed(self.owner)

    def restore(self, text: str) -> None:
        self.owner[:] = unsqueezed(text, len(self.owner))

    @property
    def pending(self) -> bool:
        return bool(self.pending_released or self.pending_touched)

    # -- per call --------------------------------------------------------------
    def peers_before_free(self, method: str, pages: Any) -> Any:
        """The SWA peers of the pages a free names, read before the free clears them."""
        if method in FULL_ONLY_FREES:
            return None
        ps = self.ps
        if isinstance(pages, list):
            m = self.view.mapping_np()
            native = kernels.native
            if native is not None and m is not None:
                try:
                    return native.page_peers(m, pages, ps, False)
                except kernels.NOT_FOR_NATIVE:
                    pass
            item, n = self.view.peer_item(), len(self.view.mapping)
            return [q for p in pages for o in range(ps) if 0 <= (t := p * ps + o) < n and (q := item(t)) > 0]
        peers = self.view.peers(kernels.expand(pages, ps))
        return peers[peers > 0] if len(peers) and peers.min() <= 0 else peers

    def mapped(self, call: int, method: str, args: dict[str, Any]) -> None:
        """set_full_to_swa_mapping: the SWA slots' new owners; checked when the group ends."""
        full = to_np(args["full_indices"])
        swa = to_np(args["swa_indices"])
        ok = self.swa.in_range(swa)
        self.owner[swa[ok]] = full[ok]
        self.pending_touched.append((call, method, full))

    def after_alloc(self, call: int, method: str, args: dict[str, Any], tokens: np.ndarray) -> None:
        """An allocation's full slots must each map to a fresh SWA slot of their own
        (the non-tail slots of a tail preallocation to none)."""
        mapped = tokens
        if method == "alloc_extend_swa_tail":
            tail = int(args.get("swa_tail_len", 0))
            nontail = tokens[: len(tokens) - tail]
            mapped = tokens[len(tokens) - tail:] if tail else tokens[:0]
            self._check_nontail(call, method, nontail)
        m = self.view.mapping_np()
        native = kernels.native
        if native is not None and m is not None:
            swa = self.swa
            try:
                no_peer, shared, bad, again, fresh = native.swa_alloc(
                    m, self.owner, self.full.live_tok, swa.live_tok, swa.owned, mapped, swa.ps)
            except kernels.NOT_FOR_NATIVE:
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
        bad, again = self.swa.handout(peers)
        self._flag_swa_handout(call, method, bad, again)
        if len(bad):
            inr = self.swa.in_range(peers)
            mapped, peers = mapped[inr], peers[inr]
        self.owner[peers] = mapped

    def after_free(self, call: int, method: str, pages: Any, swa_peers: Any) -> None:
        self.pending_released.append((call, method, pages))
        if swa_peers is None or not len(swa_peers):
            return
        ps = self.ps
        native = kernels.native
        if native is not None and isinstance(swa_peers, list):
            swa_pages = native.distinct_pages(swa_peers, ps)
        else:
            swa_pages = (sorted({q // ps for q in swa_peers}) if isinstance(swa_peers, list)
                         else kernels.distinct(swa_peers // ps))
        not_held = self.swa.release(swa_pages)
        if len(not_held):
            self._flag(call, method, "ownership", "free-not-live", "swa", not_held,
                       f"{method} released SWA page(s) that are not live (double free)")

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
        native = kernels.native
        if native is not None and m is not None:
            try:
                if not native.any_mapped(m, nontail):
                    return
            except kernels.NOT_FOR_NATIVE:
                pass
        peers = self.view.peers(nontail)
        stale = peers != 0
        if not stale.any():
            return
        self._flag(call, method, "swa-mapping", "tail-prealloc-nontail-mapped", "full", nontail[stale],
                   f"{method}: {int(stale.sum())} non-tail full slot(s) keep an old SWA peer "
                   f"(first {int(nontail[stale][0])} -> SWA {int(peers[stale][0])})")
        self._check_shared(call, method, nontail[stale], peers[stale])
        swa = self.swa
        p = peers[stale]
        dangling = ~swa.in_range(p) | ~swa.live_tok[np.clip(p, 0, len(swa.live_tok) - 1)]
        if dangling.any():
            self._flag(call, method, "swa-mapping", "peer-not-live", "swa", p[dangling],
                       f"{method}: non-tail full slot(s) map to SWA slot(s) that are free")

    def _check_shared(self, call: int, method: str, full: np.ndarray, peers: np.ndarray) -> None:
        """Another live full slot still maps to one of these SWA slots."""
        if not len(peers):
            return
        swa = self.swa
        if peers.min() < swa.ps or peers.max() >= len(swa.live_tok):
            inr = swa.in_range(peers)
            full, peers = full[inr], peers[inr]
        prev = self.owner[peers]
        cand = prev != full
        cand &= self.full.live_tok[prev]  # owner 0 is padding, never live
        if cand.any():
            still = self.view.peers(prev[cand]) == peers[cand]
            if still.any():
                s = peers[cand][still]
                self._flag(call, method, "swa-mapping", "shared-swa-slot", "swa", s,
                           f"{method}: live full slots {int(prev[cand][still][0])} and {int(full[cand][still][0])} "
                           f"both map to SWA slot {int(s[0])}")

    # -- when a free group ends (or a call outside one) ---------------------------
    def settle(self, call: int) -> None:
        self._check_released_unmapped(call)
        self._check_touched(call)

    def _check_released_unmapped(self, call: int) -> None:
        pending, self.pending_released = self.pending_released, []
        if not pending:
            return
        # One lookup for the whole group; per-call attribution only when something is wrong.
        if not self._any_released_mapped(pending):
            return
        for src_call, src_method, pages in pending:
            toks = kernels.expand(np.asarray(pages, dtype=np.int64), self.ps)
            peers = self.view.peers(toks)
            keep = peers != 0
            if src_method in SWA_ONLY_FREES:
                # The full slots stay live: a later call in the group may give them a new peer.
                repointed = [f for s, _, f in self.pending_touched if s > src_call]
                if repointed:
                    keep &= ~np.isin(toks, np.concatenate(repointed))
            if keep.any():
                what = "released page" if src_method not in SWA_ONLY_FREES else "page whose SWA peer was freed"
                self._flag(src_call, src_method, "swa-mapping", "released-page-keeps-peer", "full", toks[keep],
                           f"{src_method}: {int(keep.sum())} slot(s) of a {what} keep an SWA mapping "
                           f"(first {int(toks[keep][0])} -> SWA {int(peers[keep][0])})", detected=call)

    def _any_released_mapped(self, pending: list[tuple[int, str, Any]]) -> bool:
        m = self.view.mapping_np()
        native = kernels.native
        if native is not None and m is not None:
            try:
                return any(native.page_peers(m, pages, self.ps, True) for _, _, pages in pending)
            except kernels.NOT_FOR_NATIVE:
                pass
        allpages = np.concatenate([np.asarray(p, dtype=np.int64) for _, _, p in pending])
        return bool(len(allpages)) and bool(self.view.peers(kernels.expand(allpages, self.ps)).any())

    def _check_touched(self, call: int) -> None:
        swa = self.swa
        for src_call, src_method, full in self.pending_touched:
            peers = self.view.peers(full)
            live = self.full.live_tok[full] & (peers > 0)
            p = peers[live]
            bad = ~swa.in_range(p) | ~swa.live_tok[np.clip(p, 0, len(swa.live_tok) - 1)]
            if bad.any():
                self._flag(src_call, src_method, "swa-mapping", "peer-not-live", "swa", p[bad],
                           f"{src_method}: live full slot(s) map to SWA slot(s) that are not live", detected=call)
        self.pending_touched.clear()

    # -- O(pool) ------------------------------------------------------------------
    def full_check(self, call: int, method: str, free_by_sub: dict[str, np.ndarray], final: bool) -> None:
        m = to_np(self.view.mapping)
        full, swa = self.full, self.swa
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
