"""Drive a running decode server with a public request stream: real traffic for a recording.

The requests come from ``requests.load_requests`` (Mooncake JSONL, Azure CSV, or the
seeded generator), so the server sees the same stream ``kvreplay synth`` models. A
request's prompt is made of token ids, one run of ``block_tokens`` ids per prompt
block, drawn from the block's id: requests whose blocks agree send the same leading
tokens, so a radix (prefix) cache meets the stream's real prefix reuse. Models with
random weights and no tokenizer serve such prompts (``--skip-tokenizer-init``).

Two wire formats: sglang's native ``/generate`` with ``input_ids``, and
OpenAI-compatible ``/v1/completions`` with a token-id prompt (vLLM, sglang). Output
lengths are held to the trace's (``ignore_eos``), so the decode phase is the stream's.

Arrivals keep the stream's timing scaled by ``time_scale`` (0: as fast as the
concurrency bound lets them go); at most ``concurrency`` requests are in flight."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from kvreplay.errors import BadInput
from kvreplay.family.record import load
from kvreplay.family.registry import engines
from kvreplay.workload.requests import Request

FIRST_TOKEN = 3  # below: ids models keep for padding, BOS and EOS
# A server's answer to one request: its token counts, a few KB. Read no more than this.
MAX_ANSWER_BYTES = 16 << 20


class BadAnswer(Exception):
    """The server answered, but not with what the API answers (a list, no counts, too much)."""


@dataclass(frozen=True)
class Protocol:
    """How ``drive`` talks to a server: the path it asks before sending anything, and
    one request sent as token ids, answered with (prompt, output, cached) token counts
    as the server counted them. OpenAI's completions API is here; an engine's record
    names its own native one (``Engine.drive``)."""

    name: str
    probe: str
    # (base, model, ids, n_out, timeout, extra body fields)
    send: Callable[[str, str, list[int], int, float, dict[str, object]], tuple[int, int, int]]
    names_model: bool = False  # the probe's answer names the model to ask for
    # The body fields that tell a disaggregated decode server its request's prompt was
    # prefilled elsewhere, given the request's number; None: the API has no such server.
    prefilled: Callable[[int], dict[str, object]] | None = None


def _openai_send(base: str, model: str, ids: list[int], n_out: int, timeout: float,
                 extra: dict[str, object]) -> tuple[int, int, int]:
    got = post_json(base + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": n_out,
                                               "ignore_eos": True, "temperature": 0, **extra}, timeout)
    if not isinstance(got.get("choices"), list):
        raise BadAnswer("no choices in the answer: not an OpenAI completions server")
    usage = got.get("usage", {})
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details") or {}
    cached = token_count(details.get("cached_tokens", 0) or 0) if isinstance(details, dict) else 0
    return (token_count(usage.get("prompt_tokens", len(ids))), token_count(usage.get("completion_tokens", n_out)),
            cached)


OPENAI = Protocol("openai", "/v1/models", _openai_send, names_model=True)


def protocols() -> dict[str, Protocol]:
    """The APIs ``--api`` takes: each engine's native one, and OpenAI's."""
    out: dict[str, Protocol] = {e.name: load(e.drive) for e in engines() if e.drive}
    out[OPENAI.name] = OPENAI
    return out


@dataclass
class DriveConfig:
    url: str
    api: str = "sglang"
    model: str = ""  # the OpenAI API's model name; asked of the server when empty
    concurrency: int = 8
    time_scale: float = 0.0
    vocab: int = 2048
    block_tokens: int = 16
    max_output: int = 0  # 0: the trace's output lengths as they are
    timeout_s: float = 600.0
    seed: int = 0
    wait_s: float = 0.0  # how long a server may take to start answering (0: it must answer now)
    # The server is a disaggregated decode server: each request says a prefill server
    # (that does not exist) has its prompt, and the server's fake transfer backend agrees.
    disagg_decode: bool = False


@dataclass
class DriveResult:
    url: str
    api: str
    requests: int = 0
    ok: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server reported as prefix-cache hits
    elapsed_s: float = 0.0
    error_kinds: dict[str, int] = field(default_factory=dict)
    finished_at: list[float] = field(default_factory=list)  # time.time() of each success, in order

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("finished_at")
        d["requests_per_s"] = round(self.ok / self.elapsed_s, 3) if self.elapsed_s else 0.0
        return d


def prompt_ids(req: Request, block_tokens: int, vocab: int) -> list[int]:
    """The request's prompt: each block's ids drawn from the block's id, cut at input_len."""
    span = max(1, vocab - FIRST_TOKEN)
    ids: list[int] = []
    for block in req.blocks or (req.rid * 7919 + 1,):
        rng = random.Random(block)
        ids.extend(FIRST_TOKEN + rng.randrange(span) for _ in range(block_tokens))
        if len(ids) >= req.input_len:
            break
    while len(ids) < req.input_len:  # more tokens than blocks cover: the rest is the request's own
        rng = random.Random((req.rid << 20) + len(ids))
        ids.append(FIRST_TOKEN + rng.randrange(span))
    return ids[: req.input_len]


def post_json(url: str, body: dict[str, object], timeout: float) -> dict[str, object]:
    """POST ``body``; the JSON object answered, all of it within ``timeout`` seconds in
    total (a server that answers a byte at a time does not get a fresh timeout per
    byte), and at most MAX_ANSWER_BYTES of it."""
    deadline = time.monotonic() + timeout
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    # The socket waits as long as the request may take: a server that computes for
    # minutes before its first byte (a CPU server, the Triton interpreter) is not a
    # failure; the deadline below bounds one that answers slowly.
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the user's own server
        chunks, got = [], 0
        while chunk := resp.read1(65536):
            got += len(chunk)
            if got > MAX_ANSWER_BYTES:
                raise BadAnswer(f"an answer over {MAX_ANSWER_BYTES >> 20} MB")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no whole answer within {timeout:g} s")
            chunks.append(chunk)
    try:
        answer = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise BadAnswer("an answer that is not JSON") from None
    if not isinstance(answer, dict):
        raise BadAnswer(f"a JSON {type(answer).__name__}, not an object")
    return answer


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310
        return resp.read()


def check_server(cfg: DriveConfig, waiting: Callable[[float], None] | None = None) -> str:
    """Reach the server before sending anything; returns the model name to use. A
    server that refuses connections is asked again each second for ``cfg.wait_s``
    seconds (one that is starting up), and ``waiting(seconds so far)`` hears of it."""
    parts = urllib.parse.urlsplit(cfg.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BadInput(f"server URL {cfg.url!r}: want http://HOST:PORT")
    apis = protocols()
    if cfg.api not in apis:
        raise BadInput(f"--api {cfg.api[:40]!r}: one of {', '.join(apis)}")
    api = apis[cfg.api]
    if cfg.disagg_decode and api.prefilled is None:
        having = " or ".join(n for n, a in apis.items() if a.prefilled) or "of an engine that has one"
        raise BadInput(f"--disagg-decode: the {cfg.api} API has no disaggregated decode server; use --api {having}")
    if not 0 <= cfg.wait_s <= 86400:
        raise BadInput(f"--wait must be 0..86400 seconds, got {cfg.wait_s}")
    if not 0 < cfg.timeout_s <= 86400:
        raise BadInput(f"--timeout must be a number of seconds in (0, 86400], got {cfg.timeout_s}")
    probe = api.probe
    t0 = time.monotonic()
    while True:
        try:
            body = _get(cfg.url.rstrip("/") + probe, 10)
            break
        except urllib.error.HTTPError as exc:
            # A server that is up but not ready (503 while it loads) is waited for too.
            if exc.code == 503 and time.monotonic() - t0 < cfg.wait_s:
                pass
            else:
                raise BadInput(f"server {cfg.url} answered {probe} with HTTP {exc.code}: "
                               f"is it a {cfg.api} server?") from None
        except (urllib.error.URLError, OSError) as exc:
            waited = time.monotonic() - t0
            if waited >= cfg.wait_s:
                reason = getattr(exc, "reason", exc)
                after = f" after waiting {waited:.0f} s" if cfg.wait_s else " (--wait S waits for a server to start)"
                raise BadInput(f"server {cfg.url} unreachable{after}: {reason}") from None
        if waiting is not None:
            waiting(time.monotonic() - t0)
        time.sleep(1.0)
    if api.names_model and not cfg.model:
        try:
            return str(json.loads(body)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise BadInput(f"server {cfg.url}: /v1/models lists no model; give --model") from None
    return cfg.model


def _send(cfg: DriveConfig, model: str, req: Request) -> tuple[int, int, int]:
    """Send one request; (prompt, output, cached) tokens as the server counted them."""
    ids = prompt_ids(req, cfg.block_tokens, cfg.vocab)
    n_out = min(req.output_len, cfg.max_output) if cfg.max_output else req.output_len
    api = protocols()[cfg.api]
    extra = api.prefilled(req.rid) if cfg.disagg_decode and api.prefilled else {}
    return api.send(cfg.url.rstrip("/"), model, ids, n_out, cfg.timeout_s, extra)


def token_count(v: object) -> int:
    """A token count the server reported: a whole number no request can pass."""
    if type(v) is not int or not 0 <= v <= 1 << 40:
        raise BadAnswer(f"a token count of {str(v)[:20]}")
    return v


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, BadAnswer):
        return f"bad answer: {exc}"[:80]
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    if isinstance(exc, urllib.error.URLError):
        return f"unreachable: {exc.reason}"[:80]
    return type(exc).__name__


def drive(cfg: DriveConfig, requests: Sequence[Request],
          progress: Callable[[DriveResult, int], None] | None = None,
          waiting: Callable[[float], None] | None = None) -> DriveResult:
    """Send ``requests`` to the server at their (scaled) arrival times; returns the tally.
    ``progress(result, total)`` is called after each request finishes; ``waiting`` while
    the server is awaited (``check_server``)."""
    if cfg.concurrency < 1:
        raise BadInput(f"--concurrency must be at least 1, got {cfg.concurrency}")
    if not 0 <= cfg.time_scale <= 1e6:
        raise BadInput(f"--time-scale must be a number >= 0 (0: no pauses), got {cfg.time_scale}")
    model = check_server(cfg, waiting)
    res = DriveResult(cfg.url, cfg.api, requests=len(requests))
    lock = threading.Lock()
    errors: Counter[str] = Counter()
    slots = threading.BoundedSemaphore(cfg.concurrency)
    t0 = time.monotonic()
    first_ms = requests[0].arrival_ms if requests else 0.0

    def one(req: Request) -> None:
        try:
            p, o, c = _send(cfg, model, req)
        except Exception as exc:  # noqa: BLE001 - every failure is counted, none stops the stream
            with lock:
                res.errors += 1
                errors[_error_kind(exc)] += 1
        else:
            with lock:
                res.ok += 1
                res.prompt_tokens += p
                res.output_tokens += o
                res.cached_tokens += c
                res.finished_at.append(time.time())
        finally:
            slots.release()
            if progress is not None:
                with lock:
                    progress(res, len(requests))

    # Daemon threads, not an executor's: on Ctrl-C or SIGTERM the interpreter must not wait
    # for requests in flight (up to --timeout each) before it exits.
    threads = []
    for req in requests:
        if cfg.time_scale > 0:
            due = t0 + (req.arrival_ms - first_ms) / 1000.0 * cfg.time_scale
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        slots.acquire()
        t = threading.Thread(target=one, args=(req,), name="kvreplay-drive", daemon=True)
        t.start()
        threads.append(t)
        threads = [t for t in threads if t.is_alive()]
    for t in threads:
        t.join()
    res.elapsed_s = round(time.monotonic() - t0, 3)
    res.error_kinds = dict(errors)
    return res
