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
concurrency bound lets them go); at most ``concurrency`` requests are in flight.

The server is input like any other: every body read from it is bounded in bytes and
in time (the probe's, each answer's, all answers' in flight together), a redirect is
never followed, and a server that stops answering stops the run (``stall_s``), which
also has an overall deadline (``deadline_s``)."""

from __future__ import annotations

import http.client
import json
import math
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvreplay.contract.record import load
from kvreplay.contract.registry import engines
from kvreplay.errors import BadInput
from kvreplay.workload.requests import Request

FIRST_TOKEN = 3  # below: ids models keep for padding, BOS and EOS
# A server's answer to one request: its token counts, a few KB. Read no more than this.
MAX_ANSWER_BYTES = 16 << 20
# JSON parsed grows: 16 MB of "{}," is 5 M dicts, 450 MB. An answer may hold at most
# this many values (a generate answer's output ids are one each) and containers.
MAX_ANSWER_VALUES = 1 << 20
MAX_ANSWER_CONTAINERS = 1 << 16
# Answers being read or parsed at once, in all (a thousand requests in flight cannot
# each hold 16 MB): past it, the request that would exceed it fails.
MAX_ANSWERS_IN_FLIGHT_BYTES = 128 << 20
# The probe's answer: /health is empty, /v1/models a short list of models.
MAX_PROBE_BYTES = 1 << 20
MAX_HEALTH_BYTES = 64 << 10
PROBE_TIMEOUT_S = 10.0
MAX_CONCURRENCY = 1024


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
    # No answer at all (success or error) for this long while requests are in flight:
    # drive stops. None: the larger of 60 s and the request timeout.
    stall_s: float | None = None
    # The most the sending may take, from the first request on (the --wait is before).
    deadline_s: float = 86400.0
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
    stopped: str = ""  # why drive stopped before every request was answered ("": it did not)
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


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is the server's answer (an HTTP error), never followed: drive talks
    to the server it was given, and only over HTTP."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


class _Budget:
    """Bytes of answers held at once by all the requests in flight."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held, self._lock = limit, 0, threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            if self.held + n > self.limit:
                raise BadAnswer(f"answers in flight over {_size(self.limit)} in all")
            self.held += n

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


_IN_FLIGHT = _Budget(MAX_ANSWERS_IN_FLIGHT_BYTES)


def read_bounded(resp: Any, limit: int, deadline: float, budget: _Budget | None = None) -> bytes:
    """A response's body: at most ``limit`` bytes (BadAnswer past it, having read at
    most a chunk more), all of it by ``deadline`` (time.monotonic(); TimeoutError
    past it). Each byte read is taken from ``budget``: the caller gives back the
    body's length when done with it (on an exception nothing stays taken)."""
    chunks: list[bytes] = []
    got = 0
    try:
        while chunk := resp.read1(65536):
            if got + len(chunk) > limit:
                raise BadAnswer(f"an answer over {_size(limit)}")
            if budget is not None:
                budget.take(len(chunk))
            got += len(chunk)
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise TimeoutError("no whole answer in time")
    except BaseException:
        if budget is not None:
            budget.give(got)
        raise
    return b"".join(chunks)


def parse_answer(raw: bytes) -> dict[str, object]:
    """The JSON object a server answered, refused (BadAnswer) before it is parsed when
    parsing it would take far more memory than its bytes."""
    if raw.count(b",") + raw.count(b":") >= MAX_ANSWER_VALUES:
        raise BadAnswer(f"an answer of over {MAX_ANSWER_VALUES:,} values")
    if raw.count(b"{") + raw.count(b"[") > MAX_ANSWER_CONTAINERS:
        raise BadAnswer(f"an answer of over {MAX_ANSWER_CONTAINERS:,} objects and lists")
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadAnswer("an answer that is not JSON") from None
    if not isinstance(answer, dict):
        raise BadAnswer(f"a JSON {type(answer).__name__}, not an object")
    return answer


def post_json(url: str, body: dict[str, object], timeout: float) -> dict[str, object]:
    """POST ``body``; the JSON object answered, all of it within ``timeout`` seconds in
    total (a server that answers a byte at a time does not get a fresh timeout per
    byte), at most MAX_ANSWER_BYTES of it, and all answers being read at once at most
    MAX_ANSWERS_IN_FLIGHT_BYTES."""
    deadline = time.monotonic() + timeout
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    # The socket waits as long as the request may take: a server that computes for
    # minutes before its first byte (a CPU server, the Triton interpreter) is not a
    # failure; the deadline below bounds one that answers slowly.
    with _OPENER.open(req, timeout=timeout) as resp:  # the user's own server
        try:
            raw = read_bounded(resp, MAX_ANSWER_BYTES, deadline, _IN_FLIGHT)
        except TimeoutError:
            raise TimeoutError(f"no whole answer within {timeout:g} s") from None
    try:  # still held while it is parsed: the parse is what grows
        return parse_answer(raw)
    finally:
        _IN_FLIGHT.give(len(raw))


def _get(url: str, limit: int) -> bytes:
    """GET ``url``: its body, at most ``limit`` bytes, whole within PROBE_TIMEOUT_S."""
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    with _OPENER.open(url, timeout=PROBE_TIMEOUT_S) as resp:
        return read_bounded(resp, limit, deadline)


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
    # Only a model list is read for what it says; any other probe's body is its status.
    limit = MAX_PROBE_BYTES if api.names_model else MAX_HEALTH_BYTES
    t0 = time.monotonic()
    while True:
        try:
            body = _get(cfg.url.rstrip("/") + probe, limit)
            break
        except BadAnswer as exc:
            raise BadInput(f"server {cfg.url} answered {probe} with {exc}: is it a {cfg.api} server?") from None
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
        except http.client.HTTPException as exc:  # not HTTP (a status line of garbage, endless headers)
            raise BadInput(f"server {cfg.url} answered {probe} with no HTTP answer "
                           f"({type(exc).__name__}): is it a {cfg.api} server?") from None
        if waiting is not None:
            waiting(time.monotonic() - t0)
        time.sleep(1.0)
    if api.names_model and not cfg.model:
        try:
            return str(json.loads(body)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
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


def _answered(exc: BaseException | None) -> bool:
    """Whether the server said anything (a success, an HTTP error, a wrong answer), as
    opposed to nothing (no connection, a timeout, a dropped connection)."""
    return exc is None or isinstance(exc, urllib.error.HTTPError) or not isinstance(exc, OSError)


def _limits(cfg: DriveConfig) -> tuple[float, float]:
    """(stall, deadline) in seconds, checked."""
    stall = max(60.0, cfg.timeout_s) if cfg.stall_s is None else cfg.stall_s
    if not 0 < stall <= 86400:
        raise BadInput(f"--stall must be a number of seconds in (0, 86400], got {cfg.stall_s}")
    if not 0 < cfg.deadline_s <= 30 * 86400:
        raise BadInput(f"--deadline must be a number of seconds in (0, 2592000] (30 days), got {cfg.deadline_s}")
    return stall, cfg.deadline_s


def drive(cfg: DriveConfig, requests: Sequence[Request],
          progress: Callable[[DriveResult, int], None] | None = None,
          waiting: Callable[[float], None] | None = None) -> DriveResult:
    """Send ``requests`` to the server at their (scaled) arrival times; returns the tally.
    ``progress(result, total)`` is called after each request finishes; ``waiting`` while
    the server is awaited (``check_server``).

    Drive stops early, counting every request in flight or not yet sent as failed and
    saying why in ``result.stopped``, when the server has answered nothing for
    ``cfg.stall_s`` seconds of requests in flight (the time between arrivals with none
    in flight does not count), or when ``cfg.deadline_s`` has passed since the first
    request."""
    if not 1 <= cfg.concurrency <= MAX_CONCURRENCY:
        raise BadInput(f"--concurrency must be 1..{MAX_CONCURRENCY}, got {cfg.concurrency}")
    if not 0 <= cfg.time_scale <= 1e6:
        raise BadInput(f"--time-scale must be a number >= 0 (0: no pauses), got {cfg.time_scale}")
    stall, deadline_s = _limits(cfg)
    model = check_server(cfg, waiting)
    return _Sending(cfg, model, requests, progress, stall, deadline_s).run()


class _Sending:
    """One drive, under way: the tally and the clocks, all under one lock (``changed``).
    The main thread waits on it for a free slot, an arrival time or a limit, and each
    request that ends wakes it."""

    def __init__(self, cfg: DriveConfig, model: str, requests: Sequence[Request],
                 progress: Callable[[DriveResult, int], None] | None, stall: float, deadline_s: float) -> None:
        self.cfg, self.model, self.requests, self.progress = cfg, model, requests, progress
        self.stall, self.deadline_s = stall, deadline_s
        self.res = DriveResult(cfg.url, cfg.api, requests=len(requests))
        self.errors: Counter[str] = Counter()
        self.changed = threading.Condition()
        self.t0 = time.monotonic()
        self.deadline = self.t0 + deadline_s
        self.in_flight = self.sent = 0
        # the stall clock: since the last answer, less the time nothing was in flight
        self.quiet_from = self.idle_since = self.t0

    def run(self) -> DriveResult:
        # Daemon threads, not an executor's: on Ctrl-C or SIGTERM the interpreter must not wait
        # for requests in flight (up to --timeout each) before it exits, nor when drive stops.
        first_ms = self.requests[0].arrival_ms if self.requests else 0.0
        with self.changed:
            for req in self.requests:
                if self.cfg.time_scale > 0:
                    due = self.t0 + (req.arrival_ms - first_ms) / 1000.0 * self.cfg.time_scale
                    if not self.wait_until(lambda now, due=due: now >= due, due):
                        break
                if not self.wait_until(lambda now: self.in_flight < self.cfg.concurrency):
                    break
                now = time.monotonic()
                if self.in_flight == 0:  # the stall clock stands while nothing is in flight
                    self.quiet_from += now - self.idle_since
                self.in_flight += 1
                self.sent += 1
                threading.Thread(target=self.one, args=(req,), name="kvreplay-drive", daemon=True).start()
            else:
                self.wait_until(lambda now: self.in_flight == 0)
            self.res.elapsed_s = round(time.monotonic() - self.t0, 3)
            self.res.error_kinds = dict(self.errors)
        return self.res

    def one(self, req: Request) -> None:
        """Send ``req`` and count how it went (a request's own thread)."""
        failure: BaseException | None = None
        try:
            p, o, c = _send(self.cfg, self.model, req)
        except Exception as exc:  # noqa: BLE001 - every failure is counted, none stops the stream
            failure = exc
        with self.changed:
            now = time.monotonic()
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle_since = now
            if _answered(failure):
                self.quiet_from = now
            self.changed.notify_all()
            if self.res.stopped:  # already counted as failed when drive stopped
                return
            if failure is not None:
                self.res.errors += 1
                self.errors[_error_kind(failure)] += 1
            else:
                self.res.ok += 1
                self.res.prompt_tokens += p
                self.res.output_tokens += o
                self.res.cached_tokens += c
                self.res.finished_at.append(time.time())
            if self.progress is not None:
                self.progress(self.res, len(self.requests))

    def limit_passed(self, now: float) -> tuple[str, str]:
        """(error kind, why) drive must stop now; ("", ""): it need not. Holds ``changed``."""
        if now >= self.deadline:
            return (f"deadline passed ({self.deadline_s:g} s)",
                    f"the deadline passed (--deadline {self.deadline_s:g})")
        if self.in_flight and now - self.quiet_from >= self.stall:
            return (f"stalled: no answer in {self.stall:g} s",
                    f"the server answered nothing in {self.stall:g} s (--stall {self.stall:g})")
        return "", ""

    def stop(self, kind: str, why: str) -> None:
        """Count what is in flight or unsent as failed. Holds ``changed``."""
        unsent = len(self.requests) - self.sent
        failed = self.in_flight + unsent
        self.res.errors += failed
        self.errors[kind] += failed
        self.res.stopped = (f"{why}; {self.in_flight} request(s) in flight and {unsent} "
                            f"not sent count as failed")
        if self.progress is not None:
            self.progress(self.res, len(self.requests))

    def wait_until(self, ready: Callable[[float], bool], due: float = math.inf) -> bool:
        """Wait (holding ``changed``) until ``ready(now)``, which may come true by itself
        at ``due``; False: a limit passed first."""
        while True:
            now = time.monotonic()
            kind, why = self.limit_passed(now)
            if kind:
                self.stop(kind, why)
                return False
            if ready(now):
                return True
            # Limits are looked at four times a second; an arrival is kept to the moment.
            self.changed.wait(timeout=max(0.0, min(0.25, due - now)))
