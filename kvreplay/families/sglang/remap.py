"""Remap mode: translate recorded slot indices into the ones the build chose.

A build with another free-slot policy hands out different pages for the same call;
later frees in the trace name the recorded pages, so they must be translated or
they would free the wrong ones. Tables are per page (offsets inside a page are the
same in every paged build), kept separately for the full and the SWA pool."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvreplay.check.pool_view import to_np
from kvreplay.families.sglang.vocabulary import FULL_TOKEN_ARGS, SWA_TOKEN_ARGS


class PageTable:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.ps = page_size
        self.table = np.arange(num_pages + 1, dtype=np.int64)

    def learn(self, recorded: Any, actual: Any) -> None:
        r, a = to_np(recorded), to_np(actual)
        if len(r) != len(a) or not len(r):
            return
        ok = (r >= 0) & (r < len(self.table) * self.ps) & (a >= 0)
        self.table[r[ok] // self.ps] = a[ok] // self.ps

    def tokens(self, t: torch.Tensor) -> torch.Tensor:
        v = to_np(t)
        inr = (v >= 0) & (v < len(self.table) * self.ps)
        out = v.copy()
        out[inr] = self.table[v[inr] // self.ps] * self.ps + v[inr] % self.ps
        return torch.as_tensor(out, dtype=t.dtype, device=t.device).reshape(t.shape)

    def pages(self, t: torch.Tensor) -> torch.Tensor:
        v = to_np(t)
        inr = (v >= 0) & (v < len(self.table))
        out = v.copy()
        out[inr] = self.table[v[inr]]
        return torch.as_tensor(out, dtype=t.dtype, device=t.device).reshape(t.shape)


class Remapper:
    def __init__(self, full: PageTable, swa: PageTable | None) -> None:
        self.full = full
        self.swa = swa

    def is_identity(self) -> bool:
        """Whether every recorded page still names the build's own page of that number."""
        return all(t is None or bool((t.table == np.arange(len(t.table))).all()) for t in (self.full, self.swa))

    def args(self, args: dict[str, Any]) -> dict[str, Any]:
        out = dict(args)
        for name in FULL_TOKEN_ARGS:
            if isinstance(out.get(name), torch.Tensor):
                out[name] = self.full.tokens(out[name])
        if self.swa is not None:
            for name in SWA_TOKEN_ARGS:
                if isinstance(out.get(name), torch.Tensor):
                    out[name] = self.swa.tokens(out[name])
        if isinstance(out.get("page_ids"), torch.Tensor):
            out["page_ids"] = self.full.pages(out["page_ids"])
        if isinstance(out.get("segments"), list):
            out["segments"] = [(self.full.tokens(t), s) for t, s in out["segments"]]
        return out
