"""Prefix (radix) cache over an SWA pool: prompt blocks finished requests leave in a
tree are reused by later requests; the tree evicts whole leaves when the full pool
runs short and tombstones a node's SWA (keeps its full KV) when the SWA pool does.

Tree frees pass a node's whole value, tombstoned pages included, and rely on the
pool skipping unmapped pages (the #38519 contract). When a finished request
duplicates a partially tombstoned node, the node adopts the request's live SWA in
the same free group that drops the node's remnant SWA: the pattern that #36081
(deferred mapping lookup) gets wrong.

With ``sglang_scheduler`` the tree behaves as sglang 0.5.23's unified radix cache
does (measured against a live hybrid-SWA server with ``kvreplay profile``): a
prompt is the tree's once it is prefilled, so the tree frees its out-of-window SWA
once, and the request slides only its own decoded tokens, from the end of its
cached prompt and a token behind (the overlap scheduler); a request ends holding
input + output - 1 tokens (the last one's KV is never written), an empty tail still
freed; a finished sequence that duplicates a node frees the duplicate per
overlapping node (``free_full_segment`` below the request's SWA cursor,
``free_segment`` above it); and a tombstoned node revives by taking the request's
slots and freeing its old ones full-side."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from kvreplay.workload.server import Live, ServerModel, ceil_page, floor_page


@dataclass(eq=False)
class Node:
    block: int
    parent: Node | None
    full: torch.Tensor
    swa_live: list[bool]
    children: dict[int, Node] = field(default_factory=dict)
    lock: int = 0
    last_used: int = 0
    owner: int = -1  # the request that inserted it: sglang's tree keeps one node per inserted run


class RadixSWAServer(ServerModel):
    def __init__(self, pool: Any, requests: list[Any], *, window: int, block_tokens: int,
                 eviction_interval: int = 128, draft_steps: int = 0, draft_accept: float = 0.25,
                 **kw: Any) -> None:
        super().__init__(pool, requests, **kw)
        # Speculative decoding (draft_steps > 0, top-1 drafts): sglang 0.5.23 keeps each row
        # allocated to twice a step's draft tokens past its committed length, whole pages
        # (get_alloc_reserve_per_decode), in one batched alloc_extend when any row needs it.
        self.draft_steps = draft_steps
        self.spec_reserve = 2 * (draft_steps + 1)
        self.draft_accept = draft_accept  # the chance the target accepts each draft token, in order
        self.accept_salt = self.rng.getrandbits(32) if draft_steps else 0  # the seed's say in what is accepted
        # sglang evicts a request's out-of-window SWA only once that many tokens have
        # slid out (SGLANG_SWA_EVICTION_INTERVAL, 128), not at every page.
        self.eviction_interval = eviction_interval if self.sglang_scheduler else 0
        if block_tokens % self.ps:
            raise ValueError(f"block size {block_tokens} is not a multiple of page size {self.ps}")
        self.window = window
        self.B = block_tokens
        self.root = Node(-1, None, torch.empty(0, dtype=torch.int64), [])
        self.window_pages = ceil_page(max(window, self.ps), self.ps) // self.ps

    # -- the tree ------------------------------------------------------------
    def _nodes(self) -> list[Node]:
        out, todo = [], list(self.root.children.values())
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(n.children.values())
        return out

    def match(self, blocks: tuple[int, ...], n_blocks: int) -> list[Node]:
        chain, node = [], self.root
        for b in blocks[:n_blocks]:
            node = node.children.get(b)  # type: ignore[assignment]
            if node is None:
                break
            chain.append(node)
        # A prefix is usable only if the window before its end still has SWA KV.
        while chain and not all([f for n in chain for f in n.swa_live][-self.window_pages:]):
            chain.pop()
        return chain

    def evict_for(self, full_tokens: int, swa_tokens: int) -> None:
        pool = self.pool
        while pool.full_available_size() < full_tokens:
            leaves = [n for n in self._nodes() if not n.children and n.lock == 0]
            if not leaves:
                break
            leaf = min(leaves, key=lambda n: n.last_used)
            pool.free_segment(leaf.full, start_pos=0)
            del leaf.parent.children[leaf.block]  # type: ignore[union-attr]
            self.stats.evictions += 1
        while pool.swa_available_size() < swa_tokens:
            live = [n for n in self._nodes() if n.lock == 0 and any(n.swa_live)]
            if not live:
                break
            node = min(live, key=lambda n: n.last_used)
            pool.free_swa_segment(node.full, start_pos=0)
            node.swa_live = [False] * len(node.swa_live)
            self.stats.extra["tombstones"] = self.stats.extra.get("tombstones", 0) + 1

    # -- the server ----------------------------------------------------------
    def step(self) -> None:
        self.admit()
        if self.running:
            self.slide_windows()
            self.decode()
            self.finish()

    def _prompt_blocks(self, req: Any) -> int:
        # Keep at least one prompt token to compute, as a real prefill does.
        return min(len(req.blocks), (req.input_len - 1) // self.B)

    def admit(self) -> None:
        ps = self.ps
        batch: list[tuple[Any, int, list[Node]]] = []
        need_total = 0
        while self.waiting and len(self.running) + len(batch) < self.max_running:
            req, done = self.waiting[0]
            fill = req.input_len + done
            chain = self.match(req.blocks, self._prompt_blocks(req))
            need_new = ceil_page(fill - len(chain) * self.B, ps)
            required = need_total + need_new + (len(self.running) + len(batch) + 1) * ps
            for n in chain:
                n.lock += 1  # protect the prefix from the eviction below
            self.evict_for(required, required)
            if min(self.pool.full_available_size(), self.pool.swa_available_size()) < required:
                for n in chain:
                    n.lock -= 1
                if not self.running and not batch:
                    raise RuntimeError(f"request {req.rid} ({fill} tokens) cannot fit an empty pool; enlarge the pool")
                break
            need_total += need_new
            batch.append((self.waiting.popleft()[0], fill, chain))
        if not batch:
            return
        prefix = [len(c) * self.B for _, _, c in batch]
        fills = [f for _, f, _ in batch]
        last = [int(c[-1].full[-1]) if c else -1 for _, _, c in batch]
        out = self.pool.alloc_extend(self.dev(prefix), self.cpu(prefix), self.dev(fills), self.cpu(fills),
                                     self.dev(last), sum(fills) - sum(prefix))
        if out is None:
            self.stats.none_results += 1
            for req, fill, chain in reversed(batch):
                for n in chain:
                    n.lock -= 1
                self.waiting.appendleft((req, fill - req.input_len))
            return
        pos = 0
        for (req, fill, chain), p in zip(batch, prefix, strict=True):
            own = out[pos:pos + fill - p]
            pos += fill - p
            row = torch.cat([n.full for n in chain] + [own]) if chain else own
            for n in chain:
                n.last_used = self.stats.steps
            self.stats.prefix_hit_tokens += p
            # sglang never writes the KV of a request's last token: the step that samples it ends the request.
            target = req.input_len + req.output_len - (1 if self.sglang_scheduler else 0)
            self.running.append(Live(req, row, committed=fill, target=target,
                                     evicted=p, prefix_len=p, nodes=chain,
                                     protected=floor_page(fill, ps) if self.sglang_scheduler else p))
        if self.sglang_scheduler:
            self.finish()  # the prefill's results: requests whose one token it sampled end here
        else:
            self.batch_done()

    def _block_keys(self, lv: Live, start: int, end: int) -> list[int]:
        """Tree keys of the request's blocks start..end-1, by content: a block wholly
        inside the prompt is its hash block; a later one holds output tokens, which
        follow from the whole prompt (greedy decoding), so two requests with the same
        prompt share them too, as sglang's tree (keyed by token ids) sees it."""
        req = lv.req
        whole = min(len(req.blocks), req.input_len // self.B)
        prompt = hash((req.blocks, req.input_len)) & 0xFFFFFFFF
        return [req.blocks[i] if i < whole else -((prompt << 20) + i) - 1 for i in range(start, end)]

    def slide_windows(self) -> None:
        pool = self.pool
        pool.free_group_begin()
        for lv in self.running:
            threshold = lv.committed - self.window_pages * self.ps
            if lv.evicted < lv.protected and not lv.tree_slid:
                # The cached prompt's out-of-window SWA goes once, as the prompt enters the
                # tree (sglang measures from the last prompt token, hence the 1); what is
                # still inside the window then stays the tree's, never the request's to free.
                end = min(floor_page(threshold - 1, self.ps), lv.protected)
                if end > lv.evicted:
                    pool.free_swa_segment(lv.row[lv.evicted:end], start_pos=lv.evicted)
                    lv.evicted = end
                lv.tree_slid = True
            # The request's own cursor starts at the end of its cached prompt. Under the
            # overlap scheduler the previous step's token is not in the request yet when
            # this step slides, so sglang measures the window from one token earlier.
            if self.sglang_scheduler:
                threshold -= 1
            if self.eviction_interval and threshold < max(lv.evicted, lv.protected) + self.eviction_interval:
                continue
            new = floor_page(max(threshold, lv.evicted), self.ps)
            if new > lv.evicted:
                pool.free_swa_segment(lv.row[lv.evicted:new], start_pos=lv.evicted)
                lv.evicted = new
        pool.free_group_end()

    def decode(self) -> None:
        pool, ps = self.pool, self.ps
        while True:
            if self.draft_steps:
                need = sum(t - lv.allocated for lv, t in self._spec_rows())
            else:
                need = ps * sum(1 for lv in self.running if (lv.committed + 1) % ps == 1)
            self.evict_for(need, need)
            if need <= min(pool.full_available_size(), pool.swa_available_size()) or len(self.running) == 1:
                break
            victim = self.victim()
            pool.free_group_begin()
            self.release_rest(victim, victim.prefix_len)
            pool.free_group_end()
            for n in victim.nodes:
                n.lock -= 1
            self.retract(victim)
        if self.draft_steps:
            self.decode_speculative()
        else:
            self.decode_one_token()

    def _spec_rows(self) -> list[tuple[Live, int]]:
        return [(lv, max(lv.allocated, ceil_page(lv.committed + self.spec_reserve, self.ps))) for lv in self.running]

    def decode_speculative(self) -> None:
        """A draft-and-verify step: every running row is listed in the step's alloc_extend
        (a row with room grows by nothing); the target accepts 1 to draft_steps + 1 tokens
        and the rows keep the slots past them for the next step."""
        rows = self._spec_rows()
        prefix = [lv.allocated for lv, _ in rows]
        seq = [t for _, t in rows]
        if sum(seq) > sum(prefix):
            out = self.pool.alloc_extend(self.dev(prefix), self.cpu(prefix), self.dev(seq), self.cpu(seq),
                                         self.dev([int(lv.row[-1]) for lv, _ in rows]), sum(seq) - sum(prefix))
            if out is None:
                self.stats.none_results += 1
                self.outgrown()
                return
            pos = 0
            for (lv, t), a in zip(rows, prefix, strict=True):
                lv.row = torch.cat((lv.row, out[pos:pos + t - a]))
                pos += t - a
        for lv, _ in rows:
            # Greedy decoding: what the target accepts follows from the sequence so far, so
            # two requests with one prompt accept alike (a draw seeded by prompt and length).
            draw = random.Random(hash((lv.req.blocks, lv.req.input_len, lv.committed, self.accept_salt)))
            accepted = 1  # the target's own token
            while accepted <= self.draft_steps and draw.random() < self.draft_accept:
                accepted += 1
            lv.committed = min(lv.committed + accepted, lv.target)

    def finish(self) -> None:
        def release(lv: Live) -> None:
            for n in lv.nodes:
                n.lock -= 1
            self.insert(lv)

        self.finish_done(release)

    def insert(self, lv: Live) -> None:
        """Cache the request's full prompt blocks; free what the tree does not keep."""
        node = lv.nodes[-1] if lv.nodes else self.root
        pos = lv.prefix_len
        pages = self.B // self.ps
        if self.sglang_scheduler:
            # sglang's tree keeps the whole finished sequence, output included (whole
            # pages only): its later blocks are the request's own, matched by nobody.
            blocks = self._block_keys(lv, len(lv.nodes), lv.committed // self.B)
        else:
            blocks = list(lv.req.blocks[len(lv.nodes):self._prompt_blocks(lv.req)])
        duplicates: list[tuple[int, Node]] = []  # (position, node): blocks the tree already holds
        revive: list[tuple[int, Node]] = []  # tombstoned blocks this request revives
        for b in blocks:
            seg = lv.row[pos:pos + self.B]
            live = [pos + j * self.ps >= lv.evicted for j in range(pages)]
            existing = node.children.get(b)
            if existing is None:
                existing = Node(b, node, seg, live, last_used=self.stats.steps, owner=lv.req.rid)
                node.children[b] = existing
            elif all(live) and not all(existing.swa_live) and existing.lock == 0:
                if self.sglang_scheduler:
                    revive.append((pos, existing))
                else:
                    self.adopt_swa(existing, seg, pos)
            elif not self.sglang_scheduler:
                self.release_range(lv.row, pos, pos + self.B, lv.evicted)
            else:
                duplicates.append((pos, existing))
            existing.last_used = self.stats.steps
            node = existing
            pos += self.B
        for run in self._node_runs(revive):
            self.recover_swa([(n, lv.row[p:p + self.B]) for p, n in run])
        for run in self._node_runs(duplicates):
            self.free_duplicate(lv, run[0][0], run[-1][0] + self.B)
        if self.sglang_scheduler and pos >= lv.committed:
            # sglang frees the part past the tree's whole pages even when it is empty.
            self.pool.free_segments([(lv.row[pos:pos], pos)])
        self.release_range(lv.row, pos, lv.committed, lv.evicted)
        self.release_overallocated(lv)

    def release_overallocated(self, lv: Live) -> None:
        """Speculative rows hold whole pages past what they committed: sglang gives those
        back in a call of their own, from the first page the sequence does not touch."""
        start = ceil_page(lv.committed, self.ps)
        if self.draft_steps and start < lv.allocated:
            self.pool.free_segments([(lv.row[start:], start)])

    def _node_runs(self, blocks: list[tuple[int, Node]]) -> list[list[tuple[int, Node]]]:
        """Consecutive blocks that one request inserted: one node of sglang's tree,
        which it frees (or revives) in one call."""
        runs: list[list[tuple[int, Node]]] = []
        for pos, n in blocks:
            if runs and runs[-1][-1][0] + self.B == pos and runs[-1][-1][1].owner == n.owner:
                runs[-1].append((pos, n))
            else:
                runs.append([(pos, n)])
        return runs

    def free_duplicate(self, lv: Live, start: int, end: int) -> None:
        """sglang's tree frees a finished sequence's overlap with a node in one call per
        side: full-side only below the request's SWA cursor, both sides above it."""
        mid = min(max(start, lv.evicted), end)
        if mid > start:
            self.pool.free_full_segment(lv.row[start:mid], start_pos=0)
        if end > mid:
            self.pool.free_segment(lv.row[mid:end], start_pos=0)

    def recover_swa(self, run: list[tuple[Node, torch.Tensor]]) -> None:
        """sglang's revival of a tombstoned node: the node takes the request's slots
        where its SWA is gone and its old ones there go back full-side, in one call for
        the node (a run of blocks one request inserted); over the span still live the
        request's slots are the duplicates."""
        pool, old, dup = self.pool, [], []
        for node, seg in run:
            dead = next((j for j, alive in enumerate(node.swa_live) if alive), len(node.swa_live)) * self.ps
            old.append(node.full[:dead])
            if dead < self.B:
                dup.append(seg[dead:])
            node.full = torch.cat((seg[:dead], node.full[dead:]))
            node.swa_live = [True] * len(node.swa_live)
            self.stats.extra["revivals"] = self.stats.extra.get("revivals", 0) + 1
        pool.free_full_segment(torch.cat(old), start_pos=0)
        for d in dup:
            pool.free_segment(d, start_pos=0)

    def adopt_swa(self, node: Node, seg: torch.Tensor, pos: int) -> None:
        """Revive a tombstoned node with the duplicate's live SWA KV."""
        pool = self.pool
        pool.free_swa(node.full)
        pool.set_full_to_swa_mapping(node.full, pool.translate_loc_from_full_to_swa(seg))
        pool.clear_full_to_swa_mapping(seg)
        pool.free_full_segments([(seg, pos)])
        node.swa_live = [True] * len(node.swa_live)
        self.stats.extra["revivals"] = self.stats.extra.get("revivals", 0) + 1

    def release_range(self, row: torch.Tensor, start: int, end: int, evicted: int) -> None:
        """Free row[start:end]: below ``evicted`` the SWA side is already gone."""
        if end <= start:
            return
        mid = min(max(start, evicted), end)
        if mid > start:
            self.pool.free_full_segments([(row[start:mid], start)])
        if end > mid:
            self.pool.free_segments([(row[mid:end], mid)])

    def release_rest(self, lv: Live, start: int) -> None:
        self.release_range(lv.row, start, lv.committed, lv.evicted)
        self.release_overallocated(lv)

    def drain(self) -> None:
        """Flush the cache leaf-first so the trace ends on an empty pool."""
        while self.root.children:
            for n in [n for n in self._nodes() if not n.children]:
                self.pool.free_segment(n.full, start_pos=0)
                del n.parent.children[n.block]  # type: ignore[union-attr]
