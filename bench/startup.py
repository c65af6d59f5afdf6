"""What a command costs before it does anything: CPU seconds of whole ``kvreplay``
processes, against the floor every replay pays (the interpreter importing torch).

    python bench/startup.py            # 5 rounds, interleaved; medians and spread
    python bench/startup.py --imports  # and where one replay's import time goes

CPU time (user + system of the child), not wall time: on a shared machine the wall time
says how busy the machine was. Each round runs every command once, in turn, so drift
hits them alike. The last rows compare the console entry with ``main()`` called without
its start-up (pyarrow's look for pandas answered "not installed"), in the same run.
Targets: ``--help`` <= 0.5 s, the 223-call replay <= 2 s."""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE0 = str(ROOT / "traces" / "sglang-0.5.23-swa-page0.parquet")
KVREPLAY = [sys.executable, "-m", "kvreplay.cli.app"]
PLAIN_MAIN = [sys.executable, "-c", "import sys; from kvreplay.cli.app import main; main(sys.argv[1:])"]

COMMANDS = {
    "python -c 'import torch' (the floor)": [sys.executable, "-c", "import torch"],
    "kvreplay --help": [*KVREPLAY, "--help"],
    "kvreplay inspect (223 calls)": [*KVREPLAY, "inspect", PAGE0],
    "kvreplay replay --no-store (223 calls)": [*KVREPLAY, "replay", PAGE0, "--build", "builtin:swa", "--no-store"],
    "  same, main() without start-up": [*PLAIN_MAIN, "replay", PAGE0, "--build", "builtin:swa", "--no-store"],
}


# As a user's installation runs: with Python's bytecode cache (an environment that turns
# it off makes every command compile kvreplay's modules again, about 0.2 s).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def cpu_of(cmd: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd=ROOT, env=ENV)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def imports() -> None:
    """The replay's import time by top-level package (self + children, cumulative)."""
    got = subprocess.run([*KVREPLAY[:1], "-X", "importtime", *KVREPLAY[1:], "replay", PAGE0, "--build",
                          "builtin:swa", "--no-store"], capture_output=True, text=True, cwd=ROOT, env=ENV)
    top: dict[str, int] = {}
    for line in got.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m and not m.group(2).startswith(" "):
            name = m.group(2).split(".")[0]
            top[name] = top.get(name, 0) + int(m.group(1))
    print("\nimport time of one replay, by top-level package (ms, cumulative):")
    for name, us in sorted(top.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {name:<24} {us / 1000:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--imports", action="store_true")
    a = ap.parse_args()
    samples: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for cmd in COMMANDS.values():  # a round that writes the bytecode cache, not counted
        cpu_of(cmd)
    for _ in range(a.repeat):
        for label, cmd in COMMANDS.items():
            samples[label].append(cpu_of(cmd))
    floor = statistics.median(samples[next(iter(COMMANDS))])
    print(f"{'command':<42} {'CPU s (median)':>14} {'min..max':>14} {'/ floor':>8}")
    for label, xs in samples.items():
        med = statistics.median(xs)
        print(f"{label:<42} {med:14.2f} {min(xs):6.2f}..{max(xs):<6.2f} {med / floor:8.2f}")
    plain = statistics.median(samples["  same, main() without start-up"])
    entry = statistics.median(samples["kvreplay replay --no-store (223 calls)"])
    print(f"console entry / main() without start-up: {entry / plain:.2f}")
    if a.imports:
        imports()


if __name__ == "__main__":
    main()
