"""The ground floor holds: no import cycle in asyncrl/, and packages import downward.

Every module under asyncrl/ is parsed with ``ast``; every ``import`` and ``from ... import`` counts,
at module top and inside function bodies alike (a lazy import is still an arrow). From the arrows
between modules we check:

- no cycle between modules (``a.py`` imports ``b.py`` imports ``a.py``, at any length);
- no cycle between packages (``asyncrl.config`` -> ``asyncrl.cluster`` -> ``asyncrl.config``);
- every arrow between packages points down the floors below, except the few upward arrows listed
  in ``ALLOWED_UPWARD`` (at most ``MAX_UPWARD``), each with its reason in docs/design.md.

The floors (``FLOORS``), the sideways arrows between packages of one floor (``SIDEWAYS``, a DAG) and the
allowed upward arrows are defined once, with the graph's reading, in ``tools/house_report.py``, which also
prints the figures; this test enforces them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "house_report.py"
_spec = importlib.util.spec_from_file_location("house_report", TOOL)
house = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(house)


def test_every_package_has_a_floor():
    packages = {house.package_of(m) for m in house.import_graph()} - {""}
    assert packages == set(house.FLOORS), "give each package under asyncrl/ a floor in FLOORS (tools/house_report.py)"


def test_no_module_cycle():
    cycles = house.find_cycles(house.import_graph())
    assert not cycles, "import cycles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_package_cycle():
    cycles = house.package_cycles(house.import_graph())
    assert not cycles, "import cycles between packages:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_sideways_arrows_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for a, b in house.SIDEWAYS:
        assert house.FLOORS[a] == house.FLOORS[b], f"SIDEWAYS {a}->{b} crosses floors"
        graph.setdefault(a, set()).add(b)
    assert not house.find_cycles(graph)


def test_packages_import_downward():
    assert len(house.ALLOWED_UPWARD) <= house.MAX_UPWARD
    bad = [
        f"{a} -> {b} (floor {house.FLOORS[a]} -> {house.FLOORS[b]}): " + "; ".join(sorted(via))
        for (a, b), via in house.against_floors(house.import_graph()).items()
        if (a, b) not in house.ALLOWED_UPWARD
    ]
    assert not bad, "upward or unlisted sideways package imports:\n" + "\n".join(bad)
