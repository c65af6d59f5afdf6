"""``kvreplay synth``: run a scenario of the decode-server model against a pool
build under the recorder, producing a trace that looks like a production one.

A vLLM release (``--build vllm==X``) is driven in a child process with the release's
package first on ``sys.path``, as a release replays (builds/worker_code.py): the child
runs this module as ``--build vllm`` and reports progress and its result as lines on
stdout, the trace naming the release."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvreplay.builds import resolve as builds
from kvreplay.builds.resolve import resolve_device
from kvreplay.builds.spec import BuildSpec
from kvreplay.builds.worker_code import prepare
from kvreplay.contract.record import Scenario, load
from kvreplay.contract.registry import SCENARIOS, family
from kvreplay.errors import BadInput, BuildUnloadable, BuildUnsupported, KvreplayError, PoolFailed, one_of
from kvreplay.limits import shown
from kvreplay.recorder.recording import record
from kvreplay.trace.location import output_path, publish
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.requests import load_requests
from kvreplay.workload.server import SynthStats


@dataclass
class SynthConfig:
    scenario: str
    out: Path
    requests: int = 200
    seed: int = 0
    workload: Path | None = None
    build: str | None = None
    page_size: int = 4
    full_size: int = 2048
    swa_size: int = 512
    window: int = 32
    k: int = 3
    block_tokens: int = 16
    max_running: int = 64
    length_scale: float = 1.0
    output_scale: float | None = None  # output lengths' scale (default: length_scale)
    sglang_scheduler: bool = False  # free groups and end of trace as sglang 0.5.23's scheduler (server.py)
    speedup: float = 1.0
    prefix_caching: bool = True  # vllm-prefix: the manager's enable_caching
    attention: str = "full"  # vllm-prefix: KV-cache groups (full, sliding, hybrid, mamba; windows of `window` tokens)
    max_model_len: int | None = None  # vllm-prefix: longest sequence served (default: full_size)
    batch_tokens: int = 2048  # vllm-prefix: the scheduler's token budget per step (vLLM's max_num_batched_tokens)
    speculative: bool = False  # radix-swa: draft-and-verify steps of k draft tokens (sglang 0.5.23's path)
    draft_accept: float = 0.25  # radix-swa --speculative: the chance each draft token is accepted, in order
    state_slots: int = 64  # hybrid-mamba: the state pool's slots (sglang's --max-mamba-cache-size)
    aborts: float = 0.05  # hybrid-mamba: the share of requests aborted while they decode
    no_extra_buffer: bool = False  # hybrid-mamba: no tracking pair (the pool sglang builds off GPUs)
    eagle: bool = False  # vllm-prefix: an EAGLE drafter (k draft tokens a step): hits give up a block, k slots reserved
    device: str = "cpu"
    checkpoint_every: int = 0  # calls between checkpoints (0: none); replay --jobs splits there
    # the options a scenario declares for itself (Scenario.params), by name: text from the
    # command line or values; validate() leaves each one the scenario has, typed, defaults filled
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class SynthResult(SynthStats):
    """What a synth run wrote: the trace, and the model's stats."""

    path: Path | str  # a URI when written to one
    scenario: str
    build: str
    calls: int  # top-level calls: the numbers replay reports use
    rows: int  # rows in the trace (nested sub-allocator calls too)
    wall_s: float


def validate(cfg: SynthConfig) -> Scenario:
    if cfg.scenario not in SCENARIOS:
        one_of("scenario", cfg.scenario, SCENARIOS)
    sc = SCENARIOS[cfg.scenario]
    if sc.check:
        load(sc.check)(cfg)
    defaults = SynthConfig(scenario=cfg.scenario, out=cfg.out)
    for name in sorted(_scenario_options() - sc.options):  # another scenario's option, set
        if getattr(cfg, name) != getattr(defaults, name):
            owners = ", ".join(s.name for s in SCENARIOS.values() if name in s.options)
            flag = "--no-prefix-caching" if name == "prefix_caching" else f"--{name.replace('_', '-')}"
            raise BadInput(f"{flag} is an option of scenario {owners}, not of {sc.name}")
    cfg.params = _params(cfg.params, sc)
    for name in ("window", "max_running", "batch_tokens"):
        if getattr(cfg, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be positive")
    if cfg.k < 0 or (cfg.k == 0 and getattr(cfg, "eagle", False)):
        raise BadInput("--k must be 0 (no speculation) or more draft tokens per step (--eagle: at least 1)")
    if not 0 <= cfg.aborts <= 1:
        raise BadInput("--aborts must be a share of requests, 0 to 1")
    if not 0 <= cfg.draft_accept <= 1:
        raise BadInput("--draft-accept must be a probability, 0 to 1")
    if cfg.checkpoint_every < 0:
        raise BadInput("--checkpoint-every must be 0 (no checkpoints) or positive")
    if cfg.length_scale <= 0 or cfg.speedup <= 0 or (cfg.output_scale is not None and cfg.output_scale <= 0):
        raise BadInput("--length-scale, --output-scale and --speedup must be positive")
    if cfg.max_model_len is not None and cfg.max_model_len < cfg.block_tokens:
        raise BadInput("--max-model-len must hold at least one block of --block-tokens")
    cfg.device = resolve_device(cfg.device)
    return sc


def _params(given: dict[str, Any], sc: Scenario) -> dict[str, Any]:
    own = {p.name: p for p in sc.params}
    for name in given:
        if name not in own:
            have = ", ".join(own) or "none"
            raise BadInput(f"--set {shown(str(name))}: scenario {sc.name} has no option of that name (its own: {have})")
    try:
        return {name: p.value(given[name]) if name in given else p.default for name, p in own.items()}
    except ValueError as exc:
        raise BadInput(f"--set {exc}") from None


def _scenario_options() -> frozenset[str]:
    return frozenset().union(*(s.options for s in SCENARIOS.values()))


def make_pool(cfg: SynthConfig, sc: Scenario) -> tuple[Any, str]:
    spec = cfg.build or family(sc.family).default_build
    build = builds.resolve(spec, sc.family)
    got = build.family or builds.family_of_class(build.cls)
    if got != sc.family:
        raise BadInput(f"scenario {sc.name} needs a {sc.family} pool, but {spec} is a {got} pool")
    ctor = load(sc.ctor)(cfg)
    try:
        return build.construct(ctor, device=cfg.device), spec
    except (ValueError, TypeError, BuildUnsupported) as exc:
        hint = f" (--attention {cfg.attention} needs a manager with those KV-cache groups)" \
            if cfg.attention != "full" else ""
        raise BadInput(f"{spec} cannot be built for scenario {sc.name}: {exc}{hint}") from None


def run_model(pool: Any, cfg: SynthConfig, sc: Scenario,
              progress: Callable[[int, int], None] | None = None) -> Any:
    """Drive ``pool`` (recorded or not) through the scenario; returns its stats."""
    reqs = load_requests(cfg.workload, count=cfg.requests, seed=cfg.seed,
                         block_tokens=cfg.block_tokens, length_scale=cfg.length_scale,
                         output_scale=cfg.output_scale)
    server = load(sc.server)(pool, reqs, cfg, progress)
    try:
        return server.run()
    except RuntimeError as exc:
        raise BadInput(str(exc)) from None


def synthesize(cfg: SynthConfig, progress: Callable[[int, int], None] | None = None,
               command: str | None = None, as_build: str | None = None) -> SynthResult:
    """Run the scenario on ``cfg.build`` under the recorder; ``as_build`` names the build
    in the trace and result when it is not ``cfg.build`` (a release's child)."""
    sc = validate(cfg)
    if cfg.build and BuildSpec.parse(cfg.build).kind == "release":
        return _synthesize_on_release(cfg, sc, progress, command)
    pool, spec = make_pool(cfg, sc)
    spec = as_build or spec
    out, remote = output_path(cfg.out)  # a URI: written here, then put there
    if out.is_dir():
        raise BadInput(f"{out} is a directory; give a file name for the trace")
    if not remote and not out.parent.is_dir():  # bad input writes nothing, not even a directory
        raise BadInput(f"{out.parent} does not exist; create it first or write the trace elsewhere")
    extra = {"synth": {**_plain(cfg), "build": spec}}
    del extra["synth"]["out"]
    if command:
        extra["command"] = command
    t0 = time.perf_counter()
    # Written under a partial name and renamed when finished: a synth that is stopped
    # (a signal, an error) never leaves a file under the name asked for.
    partial = out.with_name(f".{out.name}.partial")
    # A new pool: replay builds the same, no snapshot needed.
    rec = record(pool, partial, extra=extra, snapshot=False, checkpoint_every=cfg.checkpoint_every)
    try:
        stats = run_model(pool, cfg, sc, progress)
    except AssertionError as exc:
        # The pool's own assertion: the trace up to and including the failing call is
        # exactly the reproducer a pool engineer wants, so keep it.
        rec.close()
        partial.replace(out)
        raise PoolFailed(f"{spec} failed after {TraceReader(out).count_calls()} calls: AssertionError: {exc}; "
                         f"the trace up to that call is in {out}") from None
    except BaseException:
        rec.close()
        partial.unlink(missing_ok=True)
        raise
    rec.close()
    partial.replace(out)
    reader = TraceReader(out)
    if remote:
        publish(out, remote)
    return SynthResult(path=remote or out, scenario=sc.name, build=spec, calls=reader.count_calls(),
                       rows=reader.num_rows, wall_s=time.perf_counter() - t0, **asdict(stats))


def _plain(cfg: SynthConfig) -> dict[str, Any]:
    """The config as JSON values: what a trace records of it, and what a release's child gets."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}


# What a release's child reports, one line each on stdout (vLLM may log there too).
_MARK = "kvreplay-synth "
_ERRORS: dict[str, type[KvreplayError]] = {c.__name__: c for c in (BadInput, PoolFailed, BuildUnloadable,
                                                                     BuildUnsupported)}


def _synthesize_on_release(cfg: SynthConfig, sc: Scenario, progress: Callable[[int, int], None] | None,
                           command: str | None) -> SynthResult:
    spec = BuildSpec.parse(cfg.build or "")
    if not sc.releases or spec.engine != family(sc.family).engine:
        able = [f"{s.name} (--build {family(s.family).engine}==VERSION)" for s in SCENARIOS.values() if s.releases]
        raise BadInput(f"synth drives a release's pool for {', '.join(able) or 'no scenario'} only, not {spec} "
                       f"for {sc.name}")
    code = prepare(spec)  # fetched once; BuildUnloadable where the engine's release cannot load here
    child_cfg = {**_plain(cfg), "build": spec.engine}
    request = json.dumps({"cfg": child_cfg, "command": command, "as_build": spec.text})
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "kvreplay.workload.synth"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=errors, text=True, env=code.env())
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(request)
        proc.stdin.close()
        outcome: dict[str, Any] = {}
        for line in proc.stdout:
            if not line.startswith(_MARK):
                continue
            msg = json.loads(line[len(_MARK):])
            if "progress" in msg and progress:
                progress(*msg["progress"])
            outcome.update(msg)
        proc.wait()
        errors.seek(0)
        tail = errors.read()[-2000:].strip().splitlines()
    if "error" in outcome:
        raise _ERRORS.get(outcome["error"], BuildUnloadable)(outcome["message"])
    if "result" not in outcome:
        why = tail[-1] if tail else f"exit status {proc.returncode}"
        raise BuildUnloadable(f"{spec}: the model's process ended without a trace: {why}")
    return SynthResult(**outcome["result"])


def _child() -> int:
    """A release's child: the scenario on the engine release now first on ``sys.path``."""
    request = json.loads(sys.stdin.read())
    cfg = SynthConfig(**request["cfg"])
    cfg = replace(cfg, out=Path(cfg.out) if "://" not in str(cfg.out) else cfg.out,
                  workload=Path(cfg.workload) if cfg.workload else None)

    def report(**msg: Any) -> None:
        print(_MARK + json.dumps(msg, default=str), flush=True)

    try:
        res = synthesize(cfg, progress=lambda done, total: report(progress=[done, total]),
                         command=request["command"], as_build=request["as_build"])
    except KvreplayError as exc:
        report(error=type(exc).__name__, message=str(exc))
        return 1
    report(result={**asdict(res), "path": str(res.path)})
    return 0


if __name__ == "__main__":
    sys.exit(_child())
