"""vLLM v1's scheduler, modelled: drives a KV-cache manager (the vllm family's wire)
the way vLLM's scheduler does, from a request trace (Mooncake ``hash_ids`` as shared
prompt blocks).

Each step: ``new_step_starts``; the running requests first, in order, one
``allocate_slots`` each (a decode token, or the next chunk of a prompt: chunked prefill
under a token budget), and when one gets None the last running request is preempted
(``free_request``, back to the head of the queue, its progress lost) until it fits;
then, if nothing was preempted, waiting requests are admitted while the budget and
``max_running`` allow: ``get_computed_blocks`` (the prefix-cache lookup) and an
``allocate_slots`` for the prompt past the hit that must fit the whole sequence,
stopping at the first that gets None.
After the step every request whose scheduled tokens complete its sequence samples one
token; a request with all its output tokens is freed.

Block hashes chain over block contents, as vLLM's do: a block wholly inside the prompt
is keyed by its block id from the trace (so requests sharing ``hash_ids`` share
blocks); a later block holds output tokens, which follow from the whole prompt
(greedy decoding), so two requests with the same prompt share those too."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvreplay.families.vllm.block_wire import hashes_out
from kvreplay.workload.requests import Request
from kvreplay.workload.server import SteppedModel


@dataclass(eq=False)
class _Req:
    req: Request
    prompt_key: bytes
    num_tokens: int
    computed: int = 0
    outputs: int = 0
    status: str = "WAITING"
    preemptions: int = 0
    hashes: list[bytes] = field(default_factory=list)
    sent: int = 0  # hashes already on the wire

    @property
    def rid(self) -> str:
        return f"req-{self.req.rid}"


class VllmPrefixServer(SteppedModel):
    def __init__(self, manager: Any, requests: list[Request], *, block_size: int, max_running: int = 64,
                 token_budget: int = 2048, speedup: float = 1.0,  # vLLM's OpenAI server on CPU: 2048
                 lookahead: int = 0, align: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> None:
        super().__init__(requests, max_running=max_running, speedup=speedup, progress=progress)
        self.m = manager
        self.bs = block_size
        self.budget = token_budget
        # a Mamba group in align mode: prefill chunks end where a state can be cached
        self.align = align
        # an EAGLE drafter's tokens: slots every allocation reserves past the scheduled ones
        self.extra = {"num_lookahead_tokens": lookahead} if lookahead else {}

    # -- the request as the wire carries it ---------------------------------------------
    def _block_key(self, r: _Req, i: int) -> bytes:
        whole = min(len(r.req.blocks), r.req.input_len // self.bs)
        if i < whole:
            return r.req.blocks[i].to_bytes(8, "big", signed=True)
        return r.prompt_key + i.to_bytes(4, "big")

    def _extend_hashes(self, r: _Req) -> None:
        while len(r.hashes) < r.num_tokens // self.bs:
            parent = r.hashes[-1] if r.hashes else b"kvreplay-none-hash"
            r.hashes.append(hashlib.sha256(parent + self._block_key(r, len(r.hashes))).digest())

    def _wire(self, r: _Req) -> dict[str, Any]:
        self._extend_hashes(r)
        t, n = hashes_out(r.hashes[r.sent:])
        out = dict(request_id=r.rid, request_num_tokens=r.num_tokens, request_num_prompt_tokens=r.req.input_len,
                   request_num_computed_tokens=r.computed, request_num_in_flight_tokens=0,
                   request_num_preemptions=r.preemptions, request_skip_reading_prefix_cache=False,
                   request_shared_prefix_boundary=0, request_status=r.status, request_hashes=t,
                   request_hashes_from=r.sent, request_hash_len=n)
        r.sent = len(r.hashes)
        return out

    def arrive(self, req: Request) -> None:
        key = hashlib.sha256(repr((req.blocks, req.input_len)).encode()).digest()[:8]
        self.waiting.append(_Req(req, key, req.input_len))

    def _chunk(self, r: _Req, start: int, n: int) -> int:
        """The tokens of a chunk from ``start``: ``n``, or in align mode fewer, so that a
        prefill chunk ends on a block boundary (a state is written at a chunk's end and
        cached only there) and stops at the prompt's last cacheable boundary, one token
        short of its end, before the chunk that finishes it."""
        prefill_end = max(r.req.input_len, r.num_tokens - 1)
        if not self.align or start >= prefill_end:
            return n
        end = start + n
        if end < prefill_end and (end // self.bs * self.bs > start or self.bs <= self.budget):
            end = end // self.bs * self.bs  # to nothing, when the budget left is short of a block
        last_cache = max((r.num_tokens - 1) // self.bs * self.bs, 0)
        stops = ((start // self.bs + 1) * self.bs if start % self.bs else 0, last_cache)
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def step(self) -> None:
        self.m.new_step_starts()
        budget = self.budget
        scheduled: list[tuple[_Req, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = self._chunk(r, r.computed, min(r.num_tokens - r.computed, budget))
            if n == 0:  # its chunk would end short of a cacheable boundary: next step
                i += 1
                continue
            while True:
                got = self.m.allocate_slots(num_new_tokens=n, has_scheduled_reqs=bool(scheduled), **self.extra,
                                            **self._wire(r))
                if got is not None:
                    scheduled.append((r, n))
                    budget -= n
                    i += 1
                    break
                self.stats.none_results += 1
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_running:
            r = self.waiting[0]
            hit = self.m.get_computed_blocks(**self._wire(r))
            hit_tokens, blocks = hit[0], tuple(hit[2:])
            n = self._chunk(r, hit_tokens, min(r.num_tokens - hit_tokens, budget))
            if n == 0:
                break
            # admission reserves room for the whole sequence, not only this chunk
            got = self.m.allocate_slots(num_new_tokens=n, num_new_computed_tokens=hit_tokens,
                                        new_computed_blocks=blocks, full_sequence_must_fit=True,
                                        has_scheduled_reqs=bool(scheduled), **self.extra, **self._wire(r))
            if got is None:
                self.stats.none_results += 1
                break
            self.waiting.popleft()
            self.stats.prefix_hit_tokens += hit_tokens
            r.computed = hit_tokens
            r.status = "RUNNING"
            self.running.append(r)
            scheduled.append((r, n))
            budget -= n
        for r, n in scheduled:
            r.computed += n
            if r.computed >= r.num_tokens:  # the step computed the whole sequence: it samples a token
                r.outputs += 1
                if r.outputs >= r.req.output_len:
                    self.running.remove(r)
                    self.m.free_request(request_id=r.rid)
                    self.stats.requests_done += 1
                else:
                    r.num_tokens += 1

    def _preempt(self, r: _Req) -> None:
        self.m.free_request(request_id=r.rid)
        r.computed, r.status, r.sent = 0, "PREEMPTED", 0
        r.preemptions += 1
        self.stats.retractions += 1
        self.waiting.appendleft(r)
