"""Prefix (radix) cache over an SWA pool: prompt blocks finished requests leave in a
tree are reused by later requests; the tree evicts whole leaves when the full pool
runs short and tombstones a node's SWA (keeps its full KV) when the SWA pool does.

Tree frees pass a node's whole value, tombstoned pages included, and rely on the
pool skipping unmapped pages (the #38519 contract). When a finished request
duplicates a partially tombstoned node, the node adopts the request's live SWA in
the same free group that drops the node's remnant SWA: the pattern that #36081
(deferred mapping lookup) gets wrong."""

from __future__ import annotations

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


class RadixSWAServer(ServerModel):
    def __init__(self, pool: Any, requests: list[Any], *, window: int, block_tokens: int,
                 eviction_interval: int = 128, **kw: Any) -> None:
        super().__init__(pool, requests, **kw)
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
            self.running.append(Live(req, row, committed=fill, target=req.input_len + req.output_len,
                                     evicted=p, prefix_len=p, nodes=chain))
        self.batch_done()

    def slide_windows(self) -> None:
        pool = self.pool
        pool.free_group_begin()
        for lv in self.running:
            threshold = lv.committed - self.window_pages * self.ps
            if self.eviction_interval and threshold < lv.evicted + self.eviction_interval:
                continue
            new = floor_page(max(threshold, lv.evicted), self.ps)
            if new > lv.evicted:
                pool.free_swa_segment(lv.row[lv.evicted:new], start_pos=lv.evicted)
                lv.evicted = new
        pool.free_group_end()

    def decode(self) -> None:
        pool, ps = self.pool, self.ps
        while True:
            pages = sum(1 for lv in self.running if (lv.committed + 1) % ps == 1)
            self.evict_for(pages * ps, pages * ps)
            if pages * ps <= min(pool.full_available_size(), pool.swa_available_size()) or len(self.running) == 1:
                break
            victim = self.victim()
            pool.free_group_begin()
            self.release_rest(victim, victim.prefix_len)
            pool.free_group_end()
            for n in victim.nodes:
                n.lock -= 1
            self.retract(victim)
        self.decode_one_token()

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
        blocks = list(lv.req.blocks[len(lv.nodes):self._prompt_blocks(lv.req)])
        if self.sglang_scheduler:
            # sglang's tree keeps the whole finished sequence, output included (whole
            # pages only): its later blocks are the request's own, matched by nobody.
            own = lv.committed // self.B - len(lv.nodes) - len(blocks)
            blocks += [-((lv.req.rid + 1) << 24) - i for i in range(max(0, own))]
        for b in blocks:
            seg = lv.row[pos:pos + self.B]
            live = [pos + j * self.ps >= lv.evicted for j in range(pages)]
            existing = node.children.get(b)
            if existing is None:
                existing = Node(b, node, seg, live, last_used=self.stats.steps)
                node.children[b] = existing
            elif all(live) and not all(existing.swa_live) and existing.lock == 0:
                self.adopt_swa(existing, seg, pos)
            else:
                self.release_range(lv.row, pos, pos + self.B, lv.evicted)
            existing.last_used = self.stats.steps
            node = existing
            pos += self.B
        self.release_range(lv.row, pos, lv.committed, lv.evicted)

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

    def drain(self) -> None:
        """Flush the cache leaf-first so the trace ends on an empty pool."""
        while self.root.children:
            for n in [n for n in self._nodes() if not n.children]:
                self.pool.free_segment(n.full, start_pos=0)
                del n.parent.children[n.block]  # type: ignore[union-attr]
