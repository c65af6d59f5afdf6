"""What the caller holds in one sub-pool, as the call stream says (the checker's
shadow ownership model), and the compact text a checkpoint keeps it in."""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np

from kvreplay.check import kernels
from kvreplay.check.pool_view import SubPoolView


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
        if kernels.native is not None:
            try:
                bad, again, fresh = kernels.native.handout(self.live_tok, self.owned, tokens, self.ps)
            except kernels.NOT_FOR_NATIVE:
                pass
            else:
                self.owned_count += fresh
                return bad, again
        bad = kernels.EMPTY
        if len(tokens) and (tokens.min() < self.ps or tokens.max() >= len(self.live_tok)):
            ok = self.in_range(tokens)
            bad, tokens = tokens[~ok], tokens[ok]
        live = self.live_tok
        hit = live[tokens]
        again = tokens[hit] if hit.any() else kernels.EMPTY
        live[tokens] = True
        pages = tokens // self.ps
        fresh = pages[~self.owned[pages]]
        if len(fresh):
            self.owned[fresh] = True
            # A set counts a few dozen distinct pages faster than sorting in numpy.
            self.owned_count += len(set(fresh.tolist())) if len(fresh) <= kernels.SMALL * 16 else len(np.unique(fresh))
        return bad, again

    def release(self, pages: np.ndarray | list[int]) -> Any:
        """Mark distinct pages released; returns the ones the caller did not hold."""
        if kernels.native is not None:
            try:
                bad, released = kernels.native.release(self.owned, self.live_tok, pages, self.ps)
            except kernels.NOT_FOR_NATIVE:
                pass
            else:
                self.owned_count -= released
                return bad
        if len(pages) <= kernels.SMALL:
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
            return np.array(bad, dtype=np.int64) if bad else kernels.EMPTY
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
        return pages[~held_mask] if len(held) != len(pages) else kernels.EMPTY


def packed(bits: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.packbits(bits).tobytes(), 1)).decode()


def unpacked(text: str, n: int) -> np.ndarray:
    raw = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8)
    bits = np.unpackbits(raw)[:n].astype(bool)
    if len(bits) != n:
        raise ValueError("a checkpoint's checker state has the wrong size for this pool")
    return bits


def squeezed(a: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(a.astype(np.int64).tobytes(), 1)).decode()


def unsqueezed(text: str, n: int) -> np.ndarray:
    a = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.int64)
    if len(a) != n:
        raise ValueError("a checkpoint's checker state has the wrong size for this pool")
    return a
