"""Property tests: the correct builtin pools keep their invariants under random,
legal call sequences (hypothesis shrinks any counterexample to a short one)."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvreplay.families.sglang.paged import PagedPool
from kvreplay.families.sglang.swa import SWAPool
from kvreplay.families.sglang.token import TokenPool

PS = 4


def t(v: list[int]) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


class _Rows(RuleBasedStateMachine):
    """Requests own kv rows; the machine frees them in the ways a server does."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[torch.Tensor] = []
        self.grouped = False

    def _pick(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, len(self.rows) - 1))

    def _free_lists(self, pool) -> torch.Tensor:
        return pool.get_all_free_pages()

    def _check_free_list(self, pool, num_pages: int) -> None:
        free = self._free_lists(pool)
        assert torch.unique(free).numel() == free.numel(), "duplicate page in free list"
        assert (free >= 1).all() and (free <= num_pages).all(), "page id out of range or 0 free"
        assert 0 <= pool.available_size() <= pool.size


class TokenMachine(_Rows):
    def __init__(self) -> None:
        super().__init__()
        self.pool = TokenPool(24, need_sort=True)

    @rule(n=st.integers(1, 10))
    def alloc(self, n):
        before = self.pool.available_size()
        out = self.pool.alloc(n)
        if out is None:
            assert n > before
        else:
            self.rows.append(out.clone())

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def free(self, data):
        self.pool.free(self.rows.pop(self._pick(data)))

    @invariant()
    def consistent(self):
        self._check_free_list(self.pool, 24)
        live = sum(r.numel() for r in self.rows)
        assert live + self.pool.available_size() == 24


class PagedMachine(_Rows):
    def __init__(self) -> None:
        super().__init__()
        self.pool = PagedPool(64, PS, need_sort=True)

    @rule(lens=st.lists(st.integers(1, 13), min_size=1, max_size=3))
    def prefill(self, lens):
        n = len(lens)
        out = self.pool.alloc_extend(t([0] * n), t([0] * n), t(lens), t(lens), t([-1] * n), sum(lens))
        if out is not None:
            for piece in torch.split(out, lens):
                self.rows.append(piece.clone())

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), grow=st.integers(1, 9))
    def extend(self, data, grow):
        i = self._pick(data)
        row = self.rows[i]
        n = row.numel()
        out = self.pool.alloc_extend(t([n]), t([n]), t([n + grow]), t([n + grow]), row[-1:], grow)
        if out is not None:
            self.rows[i] = torch.cat([row, out])

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def decode(self, data):
        i = self._pick(data)
        row = self.rows[i]
        out = self.pool.alloc_decode(t([row.numel() + 1]), t([row.numel() + 1]), row[-1:])
        if out is not None:
            self.rows[i] = torch.cat([row, out])

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), how=st.sampled_from(["free", "segment", "group", "mtp"]))
    def finish(self, data, how):
        row = self.rows.pop(self._pick(data))
        if how == "mtp":
            # Speculative finish: keep a prefix, drop whole pages past it; the slots
            # between the kept length and its page end are in no free call.
            keep = data.draw(st.integers(1, row.numel()))
            cut = -(-keep // PS) * PS
            self.pool.free_group_begin()
            self.pool.free_segments([(row[:keep], 0)])
            self.pool.free(row[cut:])
            self.pool.free_group_end()
        elif how == "free":
            self.pool.free(row)
        elif how == "segment":
            self.pool.free_segment(row, start_pos=0)
        else:
            self.pool.free_group_begin()
            cut = (row.numel() // 2) // PS * PS
            self.pool.free_segments([(row[:cut], 0), (row[cut:], cut)])
            self.pool.free_group_end()

    @invariant()
    def consistent(self):
        self._check_free_list(self.pool, 16)
        pages = {int(x) // PS for r in self.rows for x in r}
        assert len(pages) * PS + self.pool.available_size() == 64
        for r in self.rows:  # a row's tokens are distinct and never slot 0's page
            assert torch.unique(r).numel() == r.numel() and (r >= PS).all()


class SWAMachine(PagedMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = SWAPool(64, 32, PS, need_sort=True)
        self.evicted: list[int] = []

    @rule(n=st.integers(1, 20), tail=st.integers(1, 20))
    def prealloc_tail(self, n, tail):
        # The server's contract: the tail starts on a page boundary.
        tail = n - max(0, n - tail) // PS * PS
        out = self.pool.alloc_extend_swa_tail(t([0]), t([0]), t([n]), t([n]), t([-1]), n, tail)
        if out is not None:
            self.rows.append(out.clone())

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def slide_window(self, data):
        row = self.rows[self._pick(data)]
        m = self.pool.full_to_swa_index_mapping
        # The window never covers the row's last page, which the next extend continues.
        last = (row.numel() - 1) // PS
        mapped_pages = [p for p in range(last) if (m[row[p * PS:(p + 1) * PS]] > 0).all()]
        if mapped_pages:
            p = mapped_pages[0]
            self.pool.free_group_begin()
            self.pool.free_swa_segment(row[p * PS:(p + 1) * PS], start_pos=p * PS)
            self.pool.free_group_end()

    @invariant()
    def consistent(self):
        pool = self.pool
        self._check_free_list(pool.full_attn_allocator, 16)
        self._check_free_list(pool.swa_attn_allocator, 8)
        m = pool.full_to_swa_index_mapping
        assert int(m[-1]) == -1
        live = torch.cat(self.rows) if self.rows else t([])
        peers = m[live]
        peers = peers[peers > 0]
        assert torch.unique(peers).numel() == peers.numel(), "two live full tokens share an SWA slot"
        swa_free = set(pool.swa_attn_allocator.get_all_free_pages().tolist())
        assert not any(int(s) // PS in swa_free for s in peers), "a mapped SWA slot is free"
        assert len({int(s) // PS for s in peers}) * PS + pool.swa_available_size() == 32, "SWA leak"
        full_free = pool.full_attn_allocator.get_all_free_pages()
        for page in full_free.tolist():
            assert (m[page * PS:(page + 1) * PS] == 0).all(), "a free full page keeps a mapping"


TestToken = TokenMachine.TestCase
TestPaged = PagedMachine.TestCase
TestSWA = SWAMachine.TestCase
_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestToken.settings = TestPaged.settings = TestSWA.settings = _SETTINGS
