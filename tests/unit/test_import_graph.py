"""The ground floor holds: no import cycle in asyncrl/, and packages import downward.

Every module under asyncrl/ is parsed with ``ast``; every ``import`` and ``from ... import`` counts,
at module top and inside function bodies alike (a lazy import is still an arrow). From the arrows
between modules we check:

- no cycle between modules (``a.py`` imports ``b.py`` imports ``a.py``, at any length);
- no cycle between packages (``asyncrl.config`` -> ``asyncrl.cluster`` -> ``asyncrl.config``);
- every arrow between packages points down the floors below, except the few upward arrows listed
  in ``ALLOWED_UPWARD`` (at most ``MAX_UPWARD``), each with its reason in docs/design.md.

Floors (a package may import its own floor's siblings only as listed in ``FLOORS``' comment):

    0 config                                   typed config, derivation, validation, placement
    1 cluster                                  processes, addresses, discovery, Megatron CPU shims
    1 models                                   the one ModelSpec, safetensors reader, RoPE, plain decoder
    2 engine cpu_engine broker agent actor     the parts, one per process kind or seam
      sync embedded                            ... and the embedded default's synthetic data and warm start
    3 trainer eval simulate                    the step loop and the leader's parts; evaluation; the sizing tool
    4 runner                                   the process wiring: torchrun entry, role bodies, broker process

Packages on one floor may import each other only along ``SIDEWAYS`` arrows (a DAG), so the
package graph as a whole has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "asyncrl"

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


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
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


def import_graph() -> dict[str, set[str]]:
    """Module -> the asyncrl modules it imports (a name imported from a package that is a
    submodule counts as that submodule)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
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


def test_every_package_has_a_floor():
    packages = {package_of(m) for m in import_graph()} - {""}
    assert packages == set(FLOORS), "give each package under asyncrl/ a floor in FLOORS"


def test_no_module_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_package_cycle():
    pkg_graph: dict[str, set[str]] = {p: set() for p in FLOORS}
    for a, b in package_arrows(import_graph()):
        pkg_graph[a].add(b)
    cycles = find_cycles(pkg_graph)
    assert not cycles, "import cycles between packages:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_sideways_arrows_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for a, b in SIDEWAYS:
        assert FLOORS[a] == FLOORS[b], f"SIDEWAYS {a}->{b} crosses floors"
        graph.setdefault(a, set()).add(b)
    assert not find_cycles(graph)


def test_packages_import_downward():
    assert len(ALLOWED_UPWARD) <= MAX_UPWARD
    bad = []
    for (a, b), via in sorted(package_arrows(import_graph()).items()):
        down = FLOORS[b] < FLOORS[a] or (a, b) in SIDEWAYS
        if not down and (a, b) not in ALLOWED_UPWARD:
            bad.append(f"{a} -> {b} (floor {FLOORS[a]} -> {FLOORS[b]}): " + "; ".join(sorted(via)))
    assert not bad, "upward or unlisted sideways package imports:\n" + "\n".join(bad)
