"""kvreplay's import contract: which package may import which, and a checker for it.

Layers run from the top (the command line) down to the vocabulary everything
shares. A module may import its own package and anything in a lower layer; it may
not import a higher layer, nor a sibling in its own layer (siblings are
independent), and no group of modules may import each other in a cycle. Function-
level (lazy) imports count as much as module-level ones.

Run ``python tests/layers.py`` to see every breach (exit 1 when there is one)."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvreplay"

# Top first. Each entry is a package or module of kvreplay; entries in one layer are siblings.
LAYERS: list[list[str]] = [
    ["cli"],
    ["corpus"],
    ["jobs.bisect", "jobs.minimize", "jobs.demo", "jobs.matrix", "jobs.dashboard"],
    ["jobs.stored_replay", "jobs.reproducer", "report", "jobs.watch", "jobs"],
    # each family's own code, named by its record
    ["families.sglang", "families.vllm", "families.mamba", "families.tree", "families"],
    ["workload"],
    ["recorder", "replay"],
    ["check", "store"],
    ["builds"],
    ["trace", "fanout"],
    ["contract"],  # what a family is: the record, and the registry of records
    ["limits", "safe_files"],  # bounds on input and configuration; reading and writing files as input
    ["errors", "version", "scratch", "text", "moved"],
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package, by dotted name (``kvreplay`` itself left out:
    its public names load lazily and it imports nothing)."""
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if name != root.name:
            out[name] = path
    return out


def imports(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The kvreplay modules ``name`` imports anywhere in its body."""
    known = set(known)
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            if t == "kvreplay" or t.startswith("kvreplay."):
                while t not in known and "." in t:
                    t = t.rpartition(".")[0]
                if t != name:
                    found.add(t)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {m: imports(m, p, mods) for m, p in mods.items()}


def container(module: str) -> str | None:
    """The LAYERS entry a module belongs to."""
    rest = module.removeprefix("kvreplay.")
    for layer in LAYERS:
        for entry in layer:
            if rest == entry or rest.startswith(entry + "."):
                return entry
    return None


def level(entry: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if entry in layer)


def breaches(g: dict[str, set[str]]) -> list[str]:
    """Every import that points up or sideways, every module outside the contract,
    and every cycle."""
    out = []
    for m, targets in sorted(g.items()):
        cm = container(m)
        if cm is None:
            out.append(f"{m}: not in the layer contract (tests/layers.py)")
            continue
        for t in sorted(targets):
            ct = container(t)
            if t == "kvreplay":
                out.append(f"{m} imports the package root kvreplay (import the module that holds the name)")
            elif ct is None or ct == cm:
                continue
            elif level(ct) < level(cm):
                out.append(f"{m} imports {t}: upward ({cm} is below {ct})")
            elif level(ct) == level(cm):
                out.append(f"{m} imports {t}: sideways ({cm} and {ct} are independent siblings)")
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(g)]
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each as a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp) + [sorted(comp)[0]])

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


if __name__ == "__main__":
    problems = breaches(graph())
    for p in problems:
        print(p)
    print(f"{len(problems)} breach(es) of the import contract" if problems else "import contract holds")
    sys.exit(1 if problems else 0)
