"""The tree family (the prefix cache above the pool): its builtin tree, its replayer,
and every rule of its checker made to fire by a tree that breaks it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvreplay.families.tree import variants
from kvreplay.families.tree.checker import TreeChecker
from kvreplay.families.tree.runs import from_runs, runs_length, to_runs
from kvreplay.families.tree.tree import PrefixTree
from kvreplay.workload.synth import SynthConfig, synthesize


def test_runs_round_trip_and_refuse_damage() -> None:
    slots = [5, 6, 7, 20, 21, 3]
    assert to_runs(slots) == (5, 3, 20, 2, 3, 1)
    assert from_runs(to_runs(slots)) == slots
    assert runs_length((5, 3, 20, 2)) == 5
    with pytest.raises(ValueError):
        from_runs((1, 2, 3))
    with pytest.raises(ValueError):
        from_runs((1, -2))
    with pytest.raises(ValueError):
        from_runs((0, 5, 9, 5), most=8)


class Bench:
    """A tree and a checker, fed as the replayer feeds them: each call's allocator
    calls (in slots) and the sizes after it."""

    def __init__(self, tree: PrefixTree) -> None:
        self.tree = tree
        self.checker = TreeChecker(tree, keep=50)
        self.log: list[tuple[str, list[int]]] = []
        self.n = 0
        real_alloc, real_free = tree.kv.alloc, tree.kv.free

        def alloc(need_size: int) -> Any:
            got = real_alloc(need_size)
            self.log.append(("alloc", from_runs(got) if got else []))
            return got

        def free(runs: Any) -> None:
            self.log.append(("free", from_runs(runs)))
            real_free(runs)

        tree.kv.alloc, tree.kv.free = alloc, free

    def __call__(self, method: str, **args: Any) -> Any:
        self.n += 1
        self.log.clear()
        self.checker.before(self.n, method)
        fn = getattr(self.tree.kv, method) if method in ("alloc", "free") else getattr(self.tree, method)
        result = fn(**args)
        t = self.tree
        counters = {"available": t.available_size(), "evictable": t.evictable_size(), "protected": t.protected_size()}
        name = f"kv.{method}" if method in ("alloc", "free") else method
        self.checker.after(self.n, name, args, result, list(self.log), counters)
        return result

    def admit(self, r: int, pages: tuple[int, ...], tokens: int) -> tuple[int, ...]:
        """Match, lock, allocate the rest and write it to the row: ``(handle, slots runs)``."""
        got = self("match_prefix", request=r, pages=pages, length=tokens)
        handle = self("lock", request=r, node=got[1])
        runs = self("alloc", need_size=tokens - got[0])
        self("extend", request=r, runs=runs)
        return handle, runs

    def finish(self, r: int, pages: tuple[int, ...], tokens: int) -> None:
        """sglang's release_kv_cache for a finished request."""
        prot, _node, handle, *_ = self("checkpoint", request=r, pages=pages, up_to=tokens)
        if tokens > prot:
            self("free_kv_row", request=r, start=prot, end=tokens)
        self("unlock", request=r, handle=handle)
        self("release", request=r)

    def rules(self) -> dict[str, int]:
        return {f"{a}/{b}": n for (a, b), n in self.checker.log.counts.items()}

    def first(self, rule_id: str) -> Any:
        return next(v for v in self.checker.log.kept if f"{v.invariant}/{v.rule}" == rule_id)


PAGES = (11, 12, 13, 14)


def test_a_correct_tree_keeps_every_book() -> None:
    b = Bench(PrefixTree(64, page_size=2))
    b.admit(1, (), 9)
    b.finish(1, PAGES, 9)  # 8 tokens cached, the ninth freed
    b.admit(2, PAGES[:3], 9)  # a hit of 6 tokens
    b.finish(2, (99,), 9)  # the pages it gained since
    assert b("evict", num_tokens=64) == 10
    assert b.checker.log.total == 0
    assert b.checker.finish(b.n) == {"kv": 0}
    assert b.tree.available_size() == 64


def test_row_leak_and_books_lost_name_the_row_free_that_kept_the_slots() -> None:
    b = Bench(variants.ForgetsRow(64, page_size=2))
    b.admit(7, (), 9)
    b.finish(7, PAGES, 9)
    leak = b.first("tree-owner/row-leak")
    assert leak.method == "free_kv_row" and len(leak.indices) == 1
    assert b.first("tree-books/lost").call == leak.call
    b.checker.finish(b.n)
    idle = b.first("quiescence/tree-idle")
    assert "1 slot(s) lost" in idle.message and f"first broke at call {leak.call} (free_kv_row" in idle.message


def test_a_request_gone_with_slots_and_its_lock_leaks_both() -> None:
    b = Bench(PrefixTree(64, page_size=2))
    b.admit(1, (), 5)
    b("release", request=1)
    assert b.rules() == {"tree-owner/row-leak": 1, "tree-lock/held-at-release": 1, "tree-books/lost": 1}
    assert b.first("tree-owner/row-leak").method == "release"


def test_handout_of_a_held_slot_and_a_row_taking_it() -> None:
    b = Bench(PrefixTree(64, page_size=2))
    _, runs = b.admit(1, (), 4)
    b.tree.kv.released.extend(from_runs(runs))  # an allocator that lost track: the slots are free twice
    b.tree.kv.free_slots = []
    b.tree.kv.head = 0
    again = b("alloc", need_size=4)
    assert from_runs(again) == from_runs(runs)
    assert b.first("tree-owner/handout-while-owned").call == b.n


def test_a_row_taking_a_slot_another_request_holds() -> None:
    b = Bench(PrefixTree(64, page_size=2))
    _, runs = b.admit(1, (), 4)
    b("extend", request=2, runs=runs)
    assert b.first("tree-owner/shared").indices == from_runs(runs)


def test_double_free() -> None:
    b = Bench(PrefixTree(64, page_size=2))
    runs = b("alloc", need_size=3)
    b("free", runs=runs)
    b("free", runs=runs)
    assert b.first("tree-owner/double-free").call == 3


def test_a_window_slot_freed_twice_or_handed_out_while_held_is_named_on_the_window_side() -> None:
    """A sliding-window tree's window side (the replayer logs it as ``swa.alloc`` and
    ``swa.free``): its allocator's own books, apart from the full side's."""
    checker = TreeChecker(PrefixTree(64), keep=50)
    sizes = {"available": None, "evictable": None, "protected": None}
    checker.after(1, "kv.alloc", {"need_size": 3}, (1, 3), [("swa.alloc", [7, 8, 9])], sizes)
    checker.after(2, "slide", {"request": 1, "pre_len": 3}, None, [("swa.free", [7, 8])], sizes)
    assert checker.log.kept == []
    checker.after(3, "evict", {"num_tokens": 1}, 0, [("swa.free", [8, 9])], sizes)
    checker.after(4, "kv.alloc", {"need_size": 1}, (4, 1), [("swa.alloc", [10])], sizes)
    checker.after(5, "kv.alloc", {"need_size": 2}, (5, 2), [("swa.alloc", [9, 10])], sizes)
    (twice,) = [v for v in checker.log.kept if v.rule == "double-free"]
    assert (twice.call, twice.method, twice.indices, twice.sub_pool) == (3, "evict", [8], "swa"), twice
    (held,) = [v for v in checker.log.kept if v.rule == "handout-while-owned"]
    assert (held.call, held.indices, held.sub_pool) == (5, [10], "swa"), held


def test_a_state_slot_has_one_owner_and_a_request_that_leaves_holding_one_has_lost_it() -> None:
    """A Mamba tree's state slots (logged ``state.alloc`` and ``state.free``): a round's
    group takes slots at once and hands them out one by one or gives them back; the
    request pool's slot and a match's copy are the request's, a finished request's
    checkpoint gives its slot to the tree. A slot freed while free, handed out while
    held, or still held by a request that gives its row back is named on the state side."""
    checker = TreeChecker(PrefixTree(64), keep=50)
    sizes = {"available": None, "evictable": None, "protected": None}
    checker.after(1, "group_states", {"need_size": 3}, None, [("state.alloc", [1, 2, 3])], sizes)
    checker.after(2, "hold_state", {"request": 1}, None, [("state.alloc", [1])], sizes)
    checker.after(3, "match_prefix", {"request": 2, "pages": (), "length": 4, "cow": 1}, (0, 0),
                  [("state.alloc", [2])], sizes)
    checker.after(4, "ungroup_states", {}, None, [("state.free", [3])], sizes)
    checker.after(5, "checkpoint", {"request": 1, "pages": (), "up_to": 0, "outputs": 1}, (0, 0, 7), [], sizes)
    checker.after(6, "unlock", {"request": 1, "handle": 7}, None, [], sizes)
    checker.after(6, "release", {"request": 1}, None, [], sizes)
    checker.after(7, "drop_state", {"request": 2}, None, [("state.free", [2])], sizes)
    checker.after(8, "release", {"request": 2}, None, [], sizes)
    assert checker.log.kept == []
    checker.after(9, "evict", {"num_tokens": 0, "state_num": 1}, 0, [("state.free", [1])], sizes)  # the node's
    checker.after(10, "evict", {"num_tokens": 0, "state_num": 1}, 0, [("state.free", [1])], sizes)
    checker.after(11, "hold_state", {"request": 3}, None, [("state.alloc", [4])], sizes)
    checker.after(12, "hold_state", {"request": 4}, None, [("state.alloc", [4])], sizes)
    checker.after(13, "hold_state", {"request": 5}, None, [("state.alloc", [6])], sizes)
    checker.after(14, "release", {"request": 5}, None, [], sizes)
    (twice,) = [v for v in checker.log.kept if v.rule == "double-free"]
    assert (twice.call, twice.method, twice.indices, twice.sub_pool) == (10, "evict", [1], "state"), twice
    (held,) = [v for v in checker.log.kept if v.rule == "handout-while-owned"]
    assert (held.call, held.indices, held.sub_pool) == (12, [4], "state") and "request 3" in held.message, held
    (leak,) = [v for v in checker.log.kept if v.rule == "row-leak"]
    assert (leak.call, leak.method, leak.indices, leak.sub_pool) == (14, "release", [6], "state"), leak


def test_a_checkpoint_that_finds_no_state_slot_free_evicts_and_is_not_flagged_for_it() -> None:
    """A Mamba tree's checkpoint copies a running request's state into a slot of its own;
    with none free the tree evicts, KV of a leaf included, inside the checkpoint. Those
    frees are an eviction's (after the failed state allocation), not a checkpoint freeing
    what the tree holds; the same free without the failed allocation is."""
    b = Bench(PrefixTree(64))
    b.admit(1, (), 8)
    b.finish(1, PAGES, 8)
    held = sorted(b.checker.owner)
    assert held and all(b.checker.owner[s] == -2 for s in held)  # the tree's
    sizes = {"available": None, "evictable": None, "protected": None}
    b.checker.after(90, "checkpoint", {"request": 5, "pages": (), "up_to": 0}, (0, 0, 0),
                    [("state.alloc", []), ("free", held[:2]), ("state.free", [4]), ("state.alloc", [4])], sizes)
    assert [v for v in b.checker.log.kept if v.rule == "freed-cached"] == []
    b.checker.after(91, "checkpoint", {"request": 5, "pages": (), "up_to": 0}, (0, 0, 0),
                    [("free", held[2:4])], sizes)
    (cached,) = [v for v in b.checker.log.kept if v.rule == "freed-cached"]
    assert cached.call == 91 and cached.indices == held[2:4]


def test_freed_cached_and_counted_twice_name_the_checkpoint() -> None:
    b = Bench(variants.FreesCachedPrefix(64, page_size=2))
    b.admit(1, (), 8)
    b.finish(1, PAGES, 8)
    b.admit(2, PAGES[:2], 6)  # 4 tokens cached, 2 new
    b("checkpoint", request=2, pages=(77,), up_to=6)
    hit = b.first("tree-owner/freed-cached")
    assert hit.method == "checkpoint" and len(hit.indices) == 4
    assert b.first("tree-books/counted-twice").call == hit.call


def test_eviction_of_a_locked_node() -> None:
    b = Bench(variants.EvictsLocked(64, page_size=2))
    b.admit(1, (), 8)
    b.finish(1, PAGES, 8)
    b.admit(2, PAGES, 9)  # locks the whole cached path
    b("evict", num_tokens=8)
    assert b.first("tree-owner/freed-while-locked").method == "evict"
    assert "tree-size/protected" in b.rules()


class EvictKeepsNode(PrefixTree):
    """Eviction frees a leaf's slots but leaves the node matchable."""

    def _delete_leaf(self, node: Any) -> None:
        self.evictable_size_ -= len(node.value)


def test_a_match_giving_slots_the_tree_does_not_hold() -> None:
    b = Bench(EvictKeepsNode(64, page_size=2))
    b.admit(1, (), 8)
    b.finish(1, PAGES, 8)
    freed = b.tree.path_slots(max(b.tree.by_id))  # the one cached path
    b("evict", num_tokens=8)
    b("match_prefix", request=2, pages=PAGES, length=8)
    hit = b.first("tree-owner/prefix-not-cached")
    assert hit.method == "match_prefix" and hit.indices == sorted(freed)


def test_unlock_by_no_holder_and_by_another_request() -> None:
    b = Bench(PrefixTree(64, page_size=2))
    b("unlock", request=1, handle=99)
    handle, _ = b.admit(2, (), 4)
    b("unlock", request=3, handle=handle)
    assert b.rules()["tree-lock/unheld"] == 2


def test_the_release_of_a_lock_the_build_failed_to_take_is_that_failures_echo_not_a_new_fault() -> None:
    """Where the build raised at a lock the recording took (an exception divergence,
    reported there), the recording's later release of that handle is no one's fault."""
    b = Bench(PrefixTree(64, page_size=2))
    b.n += 1
    b.checker.raised(b.n, "lock", 7)
    b("unlock", request=1, handle=7)
    b("unlock", request=1, handle=7)  # a second release of it is a fault again
    assert b.rules()["tree-lock/unheld"] == 1


class UnlocksTwice(PrefixTree):
    def _release_lock(self, handle: int) -> None:
        node = self.handles.get(handle)
        super()._release_lock(handle)
        if node is not None and node in self.by_id:
            self._unlock(self.by_id[node])


class UnlocksTwiceWhenShared(PrefixTree):
    def _release_lock(self, handle: int) -> None:
        node = self.by_id.get(self.handles.get(handle, -1))
        super()._release_lock(handle)
        if node is not None and node.lock_ref > 0:
            self._unlock(node)


def test_lock_counts_below_zero_and_below_the_holders() -> None:
    b = Bench(UnlocksTwice(64, page_size=2))
    b.admit(1, (), 8)
    b.finish(1, PAGES, 8)  # the checkpoint's unlock of the root lock is harmless; the last one goes twice
    assert b.first("tree-lock/negative").method == "unlock"
    c = Bench(UnlocksTwiceWhenShared(64, page_size=2))
    c.admit(1, (), 8)
    c.finish(1, PAGES, 8)
    c.admit(2, PAGES, 9)
    h3, _ = c.admit(3, PAGES, 9)
    c("unlock", request=3, handle=h3)
    assert c.first("tree-lock/lost").method == "unlock"


def test_an_orphan_lock_keeps_its_path_protected() -> None:
    b = Bench(variants.KeepsOldLock(64, page_size=2))
    b.admit(1, (), 8)
    b("checkpoint", request=1, pages=PAGES[:2], up_to=4)
    b("checkpoint", request=1, pages=PAGES[2:], up_to=8)
    assert b.first("tree-lock/orphan").method == "checkpoint"


class UnlockLeavesEvictable(PrefixTree):
    def _unlocked(self, node: Any) -> None:
        self.protected_size_ -= len(node.value)


def test_sizes_that_drift_from_the_nodes() -> None:
    b = Bench(variants.UnlockLeavesSize(64, page_size=2))
    b.admit(1, (), 8)
    b.finish(1, PAGES, 8)
    assert b.first("tree-size/protected").method == "unlock"
    c = Bench(UnlockLeavesEvictable(64, page_size=2))
    c.admit(1, (), 8)
    c.finish(1, PAGES, 8)
    assert c.first("tree-size/evictable").method == "unlock"


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("tree")
    out = {}
    for name in ("tree", "tree@forgets-row"):
        cfg = SynthConfig(scenario="prefix-tree", out=d / f"{name}.parquet", requests=80, full_size=768,
                          page_size=4, max_running=12, build=f"builtin:{name}")
        out[name] = synthesize(cfg)
    return out


def test_synth_drives_every_tree_path(traces: dict[str, Any]) -> None:
    from kvreplay.trace.profile import profile

    res = traces["tree"]
    assert res.evictions > 0 and res.retractions > 0 and res.prefix_hit_tokens > 0
    prof = profile(res.path)
    for m in ("match_prefix", "lock", "unlock", "extend", "checkpoint", "free_kv_row", "release", "evict"):
        assert prof.calls_by_method.get(m, 0) > 0, m
    assert 0 < (prof.prefix_hit or 0) < 1


@pytest.mark.parametrize("mode", ["strict", "remap"])
def test_the_builtin_tree_replays_its_trace_clean(traces: dict[str, Any], mode: str) -> None:
    from kvreplay.replay.dispatch import replay

    rep = replay(traces["tree"].path, "builtin:tree", mode=mode)
    assert rep.status == "clean", (rep.violation_counts, rep.divergence_counts)


@pytest.mark.parametrize("variant, rule", [
    ("forgets-row", "tree-owner/row-leak"), ("keeps-old-lock", "tree-lock/orphan"),
    ("evicts-locked", "tree-owner/freed-while-locked"), ("frees-cached-prefix", "tree-owner/freed-cached"),
    ("unlock-leaves-size", "tree-size/protected"),
])
def test_each_variant_is_caught_at_its_source_call(traces: dict[str, Any], variant: str, rule: str) -> None:
    from kvreplay.replay.dispatch import replay

    rep = replay(traces["tree"].path, f"builtin:tree@{variant}")
    first = rep.first_violation
    assert first is not None and f"{first.invariant}/{first.rule}" == rule
    assert rep.first_divergence is None or rep.first_divergence.call >= first.call


def test_a_server_that_forgets_rows_replays_clean_yet_is_named(traces: dict[str, Any], tmp_path: Any,
                                                                cli: Any) -> None:
    """The issue's case: the recording itself lost the rows, so the release that recorded
    it replays it without a divergence, and the checker names the call and the size."""
    res = cli("replay", str(traces["tree@forgets-row"].path), "--build", "builtin:tree@forgets-row", "--json",
              "--db", f"sqlite:///{tmp_path}/r.db")
    assert res.returncode == 1, res.stderr
    d = json.loads(res.stdout)
    assert d["status"] == "violation" and not d["divergences"]
    first = d["first_violation"]
    assert first["rule"] == "row-leak" and first["method"] == "free_kv_row"
    idle = next(v for v in d["violations"] if v["rule"] == "tree-idle")
    assert "lost" in idle["message"] and f"first broke at call {first['call']} (free_kv_row" in idle["message"]


def test_a_finished_requests_checkpoint_carries_its_output_count(tmp_path: Any) -> None:
    """Releases before 0.5.6 work out what a finished request caches from its output
    tokens, so the wire gives them: the row less the prompt, plus the last token (which has
    no slot), and 0 for a request that asked for none (``score_share``). A chunk's
    checkpoint carries none."""
    from kvreplay.replay.dispatch import replay
    from kvreplay.trace.reader import TraceReader

    cfg = SynthConfig(scenario="prefix-tree", out=tmp_path / "s.parquet", requests=40, full_size=65536,
                      page_size=1, max_running=8, build="builtin:tree", params={"score_share": 0.5, "chunk": 64})
    synthesize(cfg)
    outputs, chunks, rows = [], 0, {}
    for tc in TraceReader(cfg.out).top_calls():
        c = tc.call
        if c.method == "match_prefix":  # the row starts as the matched prefix
            rows[c.args["request"]] = c.result[0]
        elif c.method == "extend":
            rows[c.args["request"]] = rows.get(c.args["request"], 0) + sum(c.args["runs"][1::2])
        elif c.method == "checkpoint" and "outputs" in c.args:
            outputs.append(c.args["outputs"])
            assert c.args["outputs"] == 0 or c.args["up_to"] == rows[c.args["request"]], c.args
        elif c.method == "checkpoint":
            chunks += 1
    assert chunks > 0 and 0 in outputs and any(n > 1 for n in outputs), (chunks, outputs)
    assert replay(cfg.out, "builtin:tree").status == "clean"


def test_damaged_runs_are_one_line_refusals(tmp_path: Any) -> None:
    from kvreplay import record
    from kvreplay.errors import TraceFormatError
    from kvreplay.replay.dispatch import replay

    tree = PrefixTree(64, page_size=2)
    with record(tree, tmp_path / "far.parquet"):
        tree.match_prefix(1, (), 0)
        with pytest.raises(ValueError):
            tree.extend(1, (3, 1 << 40))  # a run far past the pool: refused, never listed
    with pytest.raises(TraceFormatError, match="outside 0..64"):
        replay(tmp_path / "far.parquet", "builtin:tree")
    tree = PrefixTree(64, page_size=2)
    with record(tree, tmp_path / "many.parquet"):
        tree.match_prefix(1, (), 0)
        tree.extend(1, (1, 64, 1, 64))  # each run in the pool, together twice the pool
    rep = replay(tmp_path / "many.parquet", "builtin:tree")
    assert rep.status == "unsupported" and "outside a pool of 64" in rep.message


def test_every_rule_of_the_family_is_made_to_fire_here() -> None:
    """Each rule id of the record is asserted by name in a test above (the union below
    names them; a rule added without a test that fires it fails here)."""
    from pathlib import Path

    from kvreplay.families.tree import TREE

    ids = {line.split("|")[0].strip() for line in TREE.rules.strip().splitlines()}
    text = Path(__file__).read_text()
    tested = {i for i in ids if f'"{i}"' in text}
    assert ids - tested == set()


PROMPT_ONLY = '''
from kvreplay.families.tree.runs import to_runs
from kvreplay.families.tree.tree import PrefixTree


class CachesPromptOnly(PrefixTree):
    """0.5.6 to 0.5.8.post1's mistake: a finished request's tree takes its prompt only and
    frees the decoded slots itself."""

    def checkpoint(self, request, pages, up_to, outputs=None):
        if not outputs:
            return super().checkpoint(request, pages, up_to, outputs)
        held = self.requests[int(request)]
        prompt = max(0, int(up_to) - int(outputs) + 1) // self.page_size * self.page_size
        got = super().checkpoint(request, pages, prompt)
        decoded = [s for s in held.row[got[0]:int(up_to)] if s >= 0]
        if decoded:
            self.kv.free(to_runs(decoded))
        for i in range(got[0], min(int(up_to), len(held.row))):
            held.row[i] = -1
        return got
'''


def test_a_strict_replay_follows_the_builds_names_after_a_result_parts(tmp_path: Any, monkeypatch: Any) -> None:
    """A build that caches less names other nodes and handles from that call on. The
    divergence is reported there; the later calls reach the build's own node and lock under
    the recording's names, so the checker reports no lock fault of the recording's naming
    (before, every later unlock of a renamed handle was 'held by no one')."""
    from kvreplay.replay.dispatch import replay

    (tmp_path / "prompt_only.py").write_text(PROMPT_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = SynthConfig(scenario="prefix-tree", out=tmp_path / "s.parquet", requests=30, full_size=65536,
                      page_size=1, max_running=8, build="builtin:tree")
    synthesize(cfg)
    for mode in ("strict", "remap"):
        r = replay(cfg.out, "py:prompt_only:CachesPromptOnly", mode=mode)
        d = r.first_divergence
        assert r.status == "divergence" and r.violation_counts == {}, (mode, r.violation_counts)
        assert d.kind == "result" and d.method == "checkpoint" and "fewer cached" in d.message, d
