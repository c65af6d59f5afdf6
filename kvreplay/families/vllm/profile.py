"""What a vLLM KV-cache manager call adds to a trace's profile (``kvreplay profile``):
requests by id, the prompts admitted past their cached prefixes, and each scheduler
step's running requests as its decode batch."""

from __future__ import annotations

from typing import Any

from kvreplay.trace.profile import Figures


def see(f: Figures, c: Any) -> None:
    m = c.method
    if m == "new_step_starts":
        f.end_step()
    elif m == "allocate_slots":
        rid, n = c.args.get("request_id"), c.args.get("num_new_tokens")
        hit = c.args.get("num_new_computed_tokens")
        if isinstance(rid, str):
            f.request_ids.add(rid)
        if c.args.get("request_status") == "RUNNING":
            f.step_allocs += 1
        elif isinstance(n, int) and isinstance(hit, int):  # an admission: the prompt past its cached prefix
            f.extend.append(n)
            f.prefix += hit
            f.seqs += hit + n
