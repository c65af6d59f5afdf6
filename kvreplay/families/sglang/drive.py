"""How ``kvreplay drive`` talks to an sglang server natively: /generate with token ids."""

from __future__ import annotations

from kvreplay.workload.drive import BadAnswer, Protocol, post_json, token_count


def _send(base: str, model: str, ids: list[int], n_out: int, timeout: float,
          extra: dict[str, object]) -> tuple[int, int, int]:
    got = post_json(base + "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": n_out, "ignore_eos": True, "temperature": 0}, **extra}, timeout)
    meta = got.get("meta_info")
    if not isinstance(meta, dict):
        raise BadAnswer("no meta_info in the answer: not sglang's /generate")
    return (token_count(meta.get("prompt_tokens", len(ids))), token_count(meta.get("completion_tokens", n_out)),
            token_count(meta.get("cached_tokens", 0)))


# sglang's own stand-in for a prefill server: a request from this host (its health check
# sends one) pairs with the fake transfer backend, which reports every prompt's KV as
# arrived at once. A decode server sent a request without a bootstrap host crashes.
FAKE_PREFILL_HOST = "2.2.2.2"


def _prefilled(number: int) -> dict[str, object]:
    # The room names the transfer; distinct per request, as a router makes them.
    return {"bootstrap_host": FAKE_PREFILL_HOST, "bootstrap_room": number}


NATIVE = Protocol("sglang", "/health", _send, prefilled=_prefilled)
