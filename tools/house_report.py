"""The house's rules on sizes and imports, defined once, and a report of where ``asyncrl/`` stands.

    python tools/house_report.py          # the figures (CI prints them)
    python tools/house_report.py --list   # ... and every function taking >= 5 positional parameters

The tests enforce the rules and import them from here (``tests/unit/test_house_sizes.py``,
``tests/unit/test_import_graph.py``); this report only prints and always exits 0. Pure stdlib (``ast``):
nothing under ``asyncrl/`` is imported, every file is parsed.

Sizes: no function over ``MAX_FUNC_LINES`` (60) lines, no module over ``MAX_FILE_LINES`` (500), unless the
reason stands in the code on one line, ``# long: <reason>`` (at least three words):

- a function: on the ``def`` line, the line above it (above its decorators), or the first line of its body
  (or a comment line between the signature and the body);
- a module: in its first 5 lines.

Lines are counted as the file has them (docstrings and comments included), from the ``def`` (decorators
excluded) to the function's last line; nested functions count on their own too.

Imports: every ``import`` and ``from ... import`` counts, at module top and inside function bodies alike (a
lazy import is still an arrow). No cycle between modules, no cycle between packages, and every arrow between
packages points down the floors (``FLOORS``), along a listed sideways arrow (``SIDEWAYS``, a DAG) or is one
of the few upward arrows kept on purpose (``ALLOWED_UPWARD``, at most ``MAX_UPWARD``, each with its reason
in docs/design.md). Floors:

    0 config                                   typed config, derivation, validation, placement
    1 cluster                                  processes, addresses, discovery, Megatron CPU shims
    1 models                                   the one ModelSpec, safetensors reader, RoPE, plain decoder
    2 engine cpu_engine broker agent actor     the parts, one per process kind or seam
      sync embedded                            ... and the embedded default's synthetic data and warm start
    3 trainer eval simulate                    the step loop and the leader's parts; evaluation; the sizing tool
    4 runner                                   the process wiring: torchrun entry, role bodies, broker process

Positional parameters (a figure, no rule): a function's positional-only and positional-or-keyword
parameters, not counting a first parameter named ``self`` or ``cls``; keyword-only and ``*args`` /
``**kwargs`` are not counted. The report counts the functions with ``MANY_POSITIONAL`` (5) or more.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1] / "asyncrl"

# ----------------------------------------------------------------- sizes
MAX_FUNC_LINES = 60
MAX_FILE_LINES = 500
TAG = "# long:"
MANY_POSITIONAL = 5


class Long(NamedTuple):
    """A function or module over its limit, and its reason (None: none given)."""

    kind: str
    """``function`` or ``module``."""
    where: str
    """``asyncrl/broker/core.py`` (a module) or ``asyncrl/broker/core.py:110 tick`` (a function)."""
    lines: int
    limit: int
    reason: Optional[str]


def _reason(line: str) -> Optional[str]:
    i = line.find(TAG)
    if i < 0:
        return None
    text = line[i + len(TAG) :].strip()
    return text if len(text.split()) >= 3 else None


def _func_reason(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> Optional[str]:
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    candidates = [lines[node.lineno - 1], lines[first - 2] if first >= 2 else ""]
    if node.body:
        candidates.append(lines[node.body[0].lineno - 1])
        candidates.append(lines[node.body[0].lineno - 2])  # a comment line between the signature and the body
    return next((r for r in map(_reason, candidates) if r), None)


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def long_items(root: Path = ROOT) -> list[Long]:
    """Every module over ``MAX_FILE_LINES`` and function over ``MAX_FUNC_LINES``, with its reason or None."""
    out = []
    for path in sorted(root.rglob("*.py")):
        src = path.read_text()
        lines = src.splitlines()
        rel = path.relative_to(root.parent)
        if len(lines) > MAX_FILE_LINES:
            reason = next((r for r in map(_reason, lines[:5]) if r), None)
            out.append(Long("module", f"{rel}", len(lines), MAX_FILE_LINES, reason))
        for node in _functions(ast.parse(src)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNC_LINES:
                reason = _func_reason(lines, node)
                out.append(Long("function", f"{rel}:{node.lineno} {node.name}", n, MAX_FUNC_LINES, reason))
    return out


def oversize(root: Path = ROOT) -> list[str]:
    """Every function over ``MAX_FUNC_LINES`` and module over ``MAX_FILE_LINES`` without a reason."""
    return [f"{x.where}: {x.lines} lines (> {x.limit})" for x in long_items(root) if x.reason is None]


def positional_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional-only + positional-or-keyword parameters, a first ``self`` or ``cls`` not counted."""
    params = node.args.posonlyargs + node.args.args
    if params and params[0].arg in ("self", "cls"):
        params = params[1:]
    return len(params)


def many_positional(root: Path = ROOT) -> list[tuple[str, int]]:
    """(``path:line name``, count) of every function taking ``MANY_POSITIONAL`` or more positional parameters."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        nodes = sorted(_functions(ast.parse(path.read_text())), key=lambda f: f.lineno)
        out += [(f"{rel}:{f.lineno} {f.name}", n) for f in nodes if (n := positional_count(f)) >= MANY_POSITIONAL]
    return out


# ----------------------------------------------------------------- imports
# floor of each package: a package may import any package on a lower floor
FLOORS = {
    "config": 0,
    "cluster": 1,
    "models": 1,  # ModelSpec and the safetensors reader: every part that reads a model reads it through these
    "engine": 2,
    "broker": 2,
    "cpu_engine": 2,
    "agent": 2,
    "actor": 2,
    "sync": 2,
    "embedded": 2,  # the embedded default's synthetic data and warm start (the plain decoder on demonstrations)
    "eval": 3,  # evaluation during training: the backends, the dispatcher, the eval fleet
    "trainer": 3,  # the step loop and the leader's parts on actor rank 0
    "runner": 4,  # the process wiring: the torchrun entry, the role bodies, the broker process, the preparation
    "simulate": 3,  # the sizing tool (python -m asyncrl.simulate): drives the broker core like the runner
}
# arrows allowed between packages on the same floor (must form no cycle; the test checks it)
SIDEWAYS = {
    ("agent", "broker"),  # the worker is the broker's client; prompts and trajectories are broker types
    ("actor", "broker"),  # the actor trains on the broker's groups
    ("actor", "sync"),  # the actor's weights leave in the sync's buckets
    ("agent", "engine"),  # the worker generates through the engine client and supervises its engine
    ("cpu_engine", "engine"),  # the CPU engine speaks the engine API (its pause modes, the weight-version note)
    ("sync", "engine"),  # the weight sync calls the engines
    ("embedded", "agent"),  # Search-R1 rows of the agent's task; the agent's tokenizer and retriever
    ("trainer", "eval"),  # the step loop runs the evals and owns the eval fleet
}
# upward arrows kept on purpose, (importer package, imported package): see docs/design.md
ALLOWED_UPWARD: set[tuple[str, str]] = set()
MAX_UPWARD = 3


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, importer: str, is_pkg: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the asyncrl modules it imports (a name imported from a package that is a
    submodule counts as that submodule)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, mod, is_pkg)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in files else base)
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t.startswith("asyncrl") and t != mod and t != "asyncrl":
                    graph[mod].add(t)
    return graph


def package_of(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_arrows(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> the module arrows that make it."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for mod, deps in graph.items():
        for dep in deps:
            a, b = package_of(mod), package_of(dep)
            if a and b and a != b:
                arrows.setdefault((a, b), []).append(f"{mod} -> {dep}")
    return arrows


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between packages, read from the module arrows."""
    pkg_graph: dict[str, set[str]] = {}
    for a, b in package_arrows(graph):
        pkg_graph.setdefault(a, set()).add(b)
    return find_cycles(pkg_graph)


def against_floors(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Package arrows that point neither down the floors nor along ``SIDEWAYS``: upward, or sideways unlisted
    (``ALLOWED_UPWARD`` among them; a package without a floor counts as floor -1)."""
    return {
        (a, b): via
        for (a, b), via in sorted(package_arrows(graph).items())
        if not (FLOORS.get(b, -1) < FLOORS.get(a, -1) or (a, b) in SIDEWAYS)
    }


# ----------------------------------------------------------------- the report
def package_sizes(root: Path = ROOT) -> dict[str, tuple[int, int]]:
    """Top-level package (``""``: the modules directly in ``asyncrl/``) -> (files, lines)."""
    out: dict[str, tuple[int, int]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        pkg = rel.parts[0] if len(rel.parts) > 1 else ""
        files, lines = out.get(pkg, (0, 0))
        out[pkg] = (files + 1, lines + len(path.read_text().splitlines()))
    return out


def report(root: Path = ROOT, *, list_all: bool = False) -> list[str]:
    sizes = package_sizes(root)
    files, lines = sum(f for f, _ in sizes.values()), sum(n for _, n in sizes.values())
    out = [f"house report: {root.name}/ ({files} files, {lines} lines)", "packages (files, lines):"]
    names = {p: p or "(top level)" for p in sizes}
    width = max(map(len, names.values())) + 2
    for pkg, (f, n) in sorted(sizes.items(), key=lambda kv: -kv[1][1]):
        out.append(f"  {names[pkg]:<{width}}{f:>4} {n:>7}")

    longs = long_items(root)
    for kind, limit in (("function", MAX_FUNC_LINES), ("module", MAX_FILE_LINES)):
        found = [x for x in longs if x.kind == kind]
        out.append(
            f"{kind}s over {limit} lines: {len(found)} ({sum(x.reason is None for x in found)} without a reason)"
        )
        out += [f"  {x.where}: {x.lines} lines -- {x.reason or 'NO REASON (# long: ...)'}" for x in found]

    many = many_positional(root)
    out.append(
        f"functions taking >= {MANY_POSITIONAL} positional parameters (self/cls not counted): {len(many)}"
        + ("" if list_all or not many else " (--list names them)")
    )
    if list_all:
        out += [f"  {where} ({n})" for where, n in many]

    graph = import_graph(root)
    cycles = find_cycles(graph)
    arrows = package_arrows(graph)
    out.append(
        f"imports: {len(graph)} modules, {sum(len(d) for d in graph.values())} module arrows, "
        f"{len(arrows)} package arrows"
    )
    out.append(f"  module cycles: {len(cycles)}")
    out += [f"    {' <-> '.join(c)}" for c in cycles]
    pcycles = package_cycles(graph)
    out.append(f"  package cycles: {len(pcycles)}")
    out += [f"    {' <-> '.join(c)}" for c in pcycles]
    bad = against_floors(graph)
    allowed = [k for k in bad if k in ALLOWED_UPWARD]
    out.append(
        f"  package arrows not pointing down the floors: {len(bad)} "
        f"({len(allowed)} allowed upward, at most {MAX_UPWARD}; {len(bad) - len(allowed)} against the floors)"
    )
    for (a, b), via in bad.items():
        tag = "allowed" if (a, b) in ALLOWED_UPWARD else "AGAINST THE FLOORS"
        out.append(
            f"    {a} -> {b} (floor {FLOORS.get(a, '?')} -> {FLOORS.get(b, '?')}, {tag}): {'; '.join(sorted(via))}"
        )
    unfloored = sorted({package_of(m) for m in graph} - {""} - set(FLOORS))
    if unfloored:
        out.append(f"  packages without a floor: {unfloored}")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Print the report; exit 0 whatever it finds (the tests enforce), even when a file does not parse."""
    ap = argparse.ArgumentParser(prog="python tools/house_report.py", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--list", action="store_true", help=f"name every function taking >= {MANY_POSITIONAL} positional parameters"
    )
    args = ap.parse_args(argv)
    try:
        lines = report(ROOT, list_all=args.list)
    except (OSError, SyntaxError, ValueError) as e:
        lines = [f"house report: could not read {ROOT}: {e!r}"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
