"""Builtin pools: sglang 0.5.23 behaviour, and the historical bugs of each variant."""

from __future__ import annotations

import pytest
import torch

from kvreplay.builds.resolve import resolve
from kvreplay.contract.registry import BUILTINS
from kvreplay.families.sglang.paged import PagedPool
from kvreplay.families.sglang.swa import SWAPool
from kvreplay.families.sglang.token import TokenPool


def t(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def swa(name: str = "swa", **kw) -> SWAPool:
    ctor = {"size": 20, "size_swa": 12, "page_size": 4, "need_sort": True}
    ctor.update(kw)
    return resolve(f"builtin:{name}").construct(ctor)


# -- token pool -----------------------------------------------------------------

def test_token_pool_hands_out_from_slot_one_and_appends_frees():
    p = TokenPool(8, need_sort=False)
    assert p.alloc(3).tolist() == [1, 2, 3]
    p.free(t(2))
    assert p.alloc(5).tolist() == [4, 5, 6, 7, 8]
    assert p.alloc(1).tolist() == [2]  # freed slots go to the end of the free list
    assert p.alloc(1) is None
    assert p.available_size() == 0


def test_token_pool_need_sort_stages_frees_until_short():
    p = TokenPool(4, need_sort=True)
    a = p.alloc(4)
    p.free(a[2:])
    p.free(a[:1])
    assert p.available_size() == 3
    assert p.free_pages.numel() == 0 and p.release_pages.tolist() == [3, 4, 1]
    assert p.alloc(2).tolist() == [1, 3]  # merged and sorted before handing out


# -- paged pool -----------------------------------------------------------------

def test_paged_alloc_extend_fills_last_page_then_takes_new_pages_in_request_order():
    p = PagedPool(64, 4)
    first = p.alloc_extend(t(0, 0), t(0, 0), t(6, 3), t(6, 3), t(-1, -1), 9)
    assert first.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]
    more = p.alloc_extend(t(6), t(6), t(11), t(11), first[5:6], 5)
    assert more.tolist() == [10, 11, 16, 17, 18]
    assert p.available_size() == 64 - 4 * 4


def test_paged_alloc_decode_only_new_pages_come_from_the_free_list():
    p = PagedPool(32, 4)
    row = p.alloc_extend(t(0, 0), t(0, 0), t(4, 3), t(4, 3), t(-1, -1), 7)
    out = p.alloc_decode(t(5, 4), t(5, 4), t(int(row[3]), int(row[6])))
    assert out.tolist() == [12, 11]
    assert p.available_size() == 32 - 3 * 4


def test_paged_free_prepends_pages_without_need_sort():
    p = PagedPool(32, 4)
    a = p.alloc(8)
    p.free(a[4:6])
    assert p.free_pages[:1].tolist() == [2]


def test_paged_returns_none_and_changes_nothing_when_out_of_pages():
    p = PagedPool(16, 4)
    p.alloc(12)
    before = p.free_pages.clone()
    assert p.alloc_extend(t(0), t(0), t(8), t(8), t(-1), 8) is None
    assert p.alloc_decode(t(1, 1), t(1, 1), t(-1, -1)) is None
    assert torch.equal(p.free_pages, before)


def test_free_group_defers_until_end_and_segments_must_be_page_disjoint():
    p = PagedPool(32, 4)
    row = p.alloc(12)
    p.free_group_begin()
    p.free_segments([(row[:4], 0), (row[4:7], 4)])
    p.free(row[8:])
    assert p.available_size() == 32 - 12
    p.free_group_end()
    assert p.available_size() == 32
    with pytest.raises(AssertionError):
        p.free_segments([(row[:6], 0), (row[6:8], 6)])
    with pytest.raises(AssertionError):
        p.free_group_begin()
        p.free_group_begin()


# -- SWA pool and the historical bugs --------------------------------------------

def design_walkthrough(pool: SWAPool) -> dict:
    """docs/design.md's stale-tail sequence, page_size 4, need_sort on."""
    a = pool.alloc_extend(t(0), t(0), t(6), t(6), t(-1), 6)  # request A prefills 6 tokens
    over = pool.alloc_extend(t(6), t(6), t(12), t(12), a[-1:], 6)  # MTP over-allocates to 12 slots
    row = torch.cat([a, over])
    pool.free_group_begin()  # A finishes having kept 7
    pool.free_segment(row[:7], start_pos=0)
    pool.free(row[8:12])
    pool.free_group_end()
    m = pool.full_to_swa_index_mapping
    stale = int(m[row[7]])  # row[7] was mapped but never passed to a free
    b = pool.alloc_extend_swa_tail(t(0), t(0), t(12), t(12), t(-1), 12, 4)  # B: disagg prealloc, tail 4
    b_nontail_mapped = int((m[b[:-4]] != 0).sum())
    c = pool.alloc_extend(t(0), t(0), t(8), t(8), t(-1), 8)  # C takes SWA slot 11
    live = m[torch.cat([b, c])]
    live = live[live > 0]
    shared = live.numel() - torch.unique(live).numel()
    raised = None
    try:
        pool.free(b)
        pool.free(c)
    except AssertionError as exc:
        raised = str(exc)
    return {"row7": int(row[7]), "stale": stale, "b_nontail_mapped": b_nontail_mapped, "shared": shared,
            "raised": raised, "swa_available": pool.swa_available_size()}


def test_design_walkthrough_on_the_correct_pool_is_clean():
    r = design_walkthrough(swa())
    assert r == {"row7": 11, "stale": 0, "b_nontail_mapped": 0, "shared": 0, "raised": None, "swa_available": 12}


def test_stale_tail_variant_double_frees_swa_slot_11():
    r = design_walkthrough(swa("swa@stale-tail"))
    assert r["stale"] == 11  # A's released page keeps its mapping
    assert r["b_nontail_mapped"] == 1  # B's non-tail inherits it
    assert r["shared"] == 1  # B and C both map to SWA slot 11
    assert r["raised"] and "available_size()" in r["raised"]  # sglang's capacity assertion, at the victim's free


def test_page_partial_clear_variant_keeps_a_mapping_on_a_released_page_only():
    r = design_walkthrough(swa("swa@page-partial-clear"))
    assert r["stale"] == 11
    assert r["b_nontail_mapped"] == 0 and r["shared"] == 0 and r["raised"] is None


@pytest.mark.parametrize("name", ["swa@unfiltered-page0", "swa@deferred-lookup"])
def test_other_variants_are_clean_on_the_walkthrough(name):
    r = design_walkthrough(swa(name))
    assert r["stale"] == 0 and r["shared"] == 0 and r["raised"] is None


def test_unfiltered_page0_frees_swa_page_zero_for_an_unmapped_page():
    for name, page0_freed in (("swa", False), ("swa@unfiltered-page0", True)):
        p = swa(name, need_sort=False)
        row = p.alloc_extend_swa_tail(t(0), t(0), t(8), t(8), t(-1), 8, 4)  # first page has no SWA peer
        p.free_swa_segment(row[:4], start_pos=0)
        assert (0 in p.swa_attn_allocator.free_pages.tolist()) is page0_freed


def test_deferred_lookup_frees_the_new_peer_when_a_group_repoints_the_mapping():
    for name, ok in (("swa", True), ("swa@deferred-lookup", False)):
        p = swa(name, need_sort=False, size=32, size_swa=16)
        node = p.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4)
        dup = p.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4)
        new_peer = p.translate_loc_from_full_to_swa(dup)
        p.free_group_begin()
        p.free_swa(node)  # drop the node's own SWA peer
        p.set_full_to_swa_mapping(node, new_peer)  # then adopt the duplicate's
        p.clear_full_to_swa_mapping(dup)
        p.free_full(dup)
        p.free_group_end()
        swa_free = p.swa_attn_allocator.free_pages.tolist()
        assert (int(new_peer[0]) // 4 not in swa_free) is ok


def test_swa_alloc_extend_maps_every_token_and_sentinel_stays():
    p = swa(need_sort=False)
    row = p.alloc_extend(t(0), t(0), t(5), t(5), t(-1), 5)
    m = p.full_to_swa_index_mapping
    assert (m[row] > 0).all() and int(m[-1]) == -1
    assert p.alloc_extend(t(0), t(0), t(40), t(40), t(-1), 40) is None


VLLM_CTOR = {"num_blocks": 16, "block_size": 4, "hash_block_size": 4, "max_model_len": 64, "max_in_flight_tokens": 64,
             "enable_caching": True, "watermark": 0.0, "attention": "full"}


MAMBA_CTOR = {"size": 8, "mamba_size": 16, "extra_buffer": True, "ping_pong": 2, "max_context_len": 64}


def test_every_builtin_constructs_from_recorded_ctor_args_on_cpu():
    for name, b in BUILTINS.items():
        ctor = VLLM_CTOR if b.family == "vllm" else MAMBA_CTOR if b.family == "mamba" else {
            "size": 64, "size_swa": 32, "page_size": 4 if b.family != "token" else 1, "need_sort": True,
            "dtype": "torch.int64"}
        pool = resolve(f"builtin:{name}").construct(ctor)
        assert pool.available_size() > 0


def test_swa_alloc_decode_none_changes_nothing():
    # sglang 0.5.23 takes a page from the sub-pool that has room before noticing the
    # other has none, and leaks it; the correct pool must not.
    p = swa(need_sort=False, size=40, size_swa=8)
    a = p.alloc_extend(t(0), t(0), t(8), t(8), t(-1), 8)  # SWA pool now full
    full_before = p.full_available_size()
    assert p.alloc_decode(t(9), t(9), a[-1:]) is None
    assert p.full_available_size() == full_before and p.swa_available_size() == 0
