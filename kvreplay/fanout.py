"""Independent units of work (a trace x a build x a segment), run where there is room:
in this process, in local worker processes (``jobs``), or on a Ray cluster (``ray``:
the cluster at that address, or "" for a local one started here).

Only the results come back; whoever called stores them, so a store sees one writer
per run however many machines replayed it. A unit and its result must pickle, and
the function must be importable by name (Ray and spawned workers import it)."""

from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

from kvreplay.errors import BadInput, KvreplayError
from kvreplay.limits import start_method
from kvreplay.scratch import kill_tree, outer_tmp

U = TypeVar("U")
R = TypeVar("R")


def run_units(fn: Callable[[U], R], units: Sequence[U], *, jobs: int = 1, ray: str | None = None,
              done: Callable[[int, int], None] | None = None) -> list[R]:
    """``[fn(u) for u in units]``, computed in parallel; results in the units' order.
    ``done(finished, total)`` is told as units finish."""
    return list(iter_units(fn, units, jobs=jobs, ray=ray, done=done))


def iter_units(fn: Callable[[U], R], units: Sequence[U], *, jobs: int = 1, ray: str | None = None,
               done: Callable[[int, int], None] | None = None, start_method: str | None = None,
               on_error: Callable[[U, BaseException], R] | None = None) -> Iterator[R]:
    """Like ``run_units``, yielding each result (in order) as soon as it and those
    before it are in, so a caller can act on the first ones while the rest run.
    ``on_error(unit, exc)`` stands in for a unit whose worker died or whose Ray task
    failed (without it, that failure is raised)."""
    if jobs < 1:
        raise BadInput(f"--jobs must be at least 1, not {jobs}")
    total = len(units)
    if ray is not None:
        yield from _on_ray(fn, units, ray, done, on_error)
        return
    if jobs == 1 or total <= 1:
        for i, u in enumerate(units):
            yield fn(u)
            if done is not None:
                done(i + 1, total)
        return
    ex = ProcessPoolExecutor(max_workers=min(jobs, total), mp_context=_context(start_method))
    try:
        futures = [ex.submit(fn, u) for u in units]
        for i, f in enumerate(futures):
            try:
                result = f.result()
            except Exception as exc:
                if on_error is None or isinstance(exc, KvreplayError):
                    raise
                result = on_error(units[i], exc)
            yield result
            if done is not None:
                done(i + 1, total)
    except BaseException:
        _stop(ex)
        raise
    ex.shutdown(wait=True)


def _stop(ex: ProcessPoolExecutor) -> None:
    """End a pool now (Ctrl-C, SIGTERM, an error, a caller that stopped reading): a
    plain shutdown waits for the running units, which may take minutes, and workers
    left behind would run on, re-parented to PID 1."""
    procs = list((getattr(ex, "_processes", None) or {}).values())  # not public; empty if it ever moves
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.pid is not None:
            kill_tree(p.pid)  # what a unit started (a build's worker, in a session of its own) goes first
        p.kill()
    for p in procs:
        p.join(5)


def _context(method: str | None = None) -> multiprocessing.context.BaseContext:
    # fork by default: a worker starts in milliseconds with kvreplay and torch already
    # imported; a spawned one spends seconds importing them again. KVREPLAY_START_METHOD
    # overrides (spawn for a CUDA device, which a forked child cannot use).
    method = start_method() or method or (
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    return multiprocessing.get_context(method)


def ray_module() -> Any:
    try:
        import ray
    except ImportError:
        raise BadInput("--ray needs Ray: pip install 'kvreplay[ray]'") from None
    return ray


def connect_ray(address: str) -> Any:
    """Ray, connected to the cluster at ``address`` ("" or "local": start one here)."""
    ray = ray_module()
    if not ray.is_initialized():
        local = address in ("", "local")
        if local:  # its session files live outside the command's scratch, which goes when it ends
            os.environ.setdefault("RAY_TMPDIR", outer_tmp())
        try:
            # The workers see the store, trace and credentials settings this process sees.
            env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "KVREPLAY_", "GOOGLE_"))}
            ray.init(address=None if local else address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **env}},
                     **({"num_cpus": os.cpu_count() or 1} if local else {}))
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise BadInput(f"cannot reach a Ray cluster at {address or 'a new local instance'}: "
                           f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return ray


def _on_ray(fn: Callable[[U], R], units: Sequence[U], address: str, done: Callable[[int, int], None] | None,
            on_error: Callable[[U, BaseException], R] | None) -> Iterator[R]:
    ray = connect_ray(address)
    remote = ray.remote(num_cpus=1, max_retries=0)(fn)
    refs = [remote.remote(u) for u in units]
    pending = set(refs)
    finished = 0
    for i, ref in enumerate(refs):
        while ref in pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            pending -= set(ready)
            finished += len(ready)
            if done is not None:
                done(finished, len(units))
        try:
            yield ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if on_error is None or isinstance(cause, KvreplayError):
                raise cause from None
            yield on_error(units[i], cause)
        except ray.exceptions.RayError as exc:  # the worker died, the node went away
            if on_error is None:
                raise BadInput(f"a Ray task failed: {str(exc).splitlines()[0]}") from None
            yield on_error(units[i], exc)


_ENDED = object()  # a threaded unit's last word


def iter_threads(work: Callable[[U, Callable[[R], None]], None], units: Sequence[U], *,
                 jobs: int) -> Iterator[R]:
    """``work(unit, put)`` for each unit, ``jobs`` at a time on threads of this process,
    yielding what the units ``put`` as they put it. For units that each drive worker
    processes of their own (a build's replays in one worker): one thread a unit waits on
    its worker, and only the caller's thread handles what comes back. A unit's own
    failure is raised once all have ended. Interrupted, it does not wait for running
    units, which may take minutes: their workers are the caller's to stop (the command
    kills them, scratch.kill_tree), and no thread starts another unit."""
    answers: queue.Queue[Any] = queue.Queue()

    def run(unit: U) -> None:
        try:
            work(unit, answers.put)
        finally:
            answers.put(_ENDED)

    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = [pool.submit(run, u) for u in units]
        running = len(futures)
        while running:
            item = answers.get()
            if item is _ENDED:
                running -= 1
                continue
            yield item
        for fut in futures:
            fut.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


__all__ = ["connect_ray", "iter_threads", "iter_units", "ray_module", "run_units"]
