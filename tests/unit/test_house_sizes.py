"""The house stays readable: no function in asyncrl/ over 60 lines, no module over 500 lines.

Where one must be longer, the reason stands in the code on one line, ``# long: <reason>``. The rule (the
limits, where a reason may stand, how lines are counted) is defined once, in ``tools/house_report.py``,
which also prints the figures; this test enforces it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "house_report.py"
_spec = importlib.util.spec_from_file_location("house_report", TOOL)
house = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(house)


def test_no_oversize_function_or_module():
    found = house.oversize()
    assert not found, "split these, or give the reason on one line ('# long: ...'):\n" + "\n".join(found)


def test_the_check_sees_a_long_function_and_accepts_a_reason(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(house.MAX_FUNC_LINES))
    (tmp_path / "a.py").write_text(f"def f():\n{body}\n")
    assert [x.split(" ")[1] for x in house.oversize(tmp_path)] == ["f:"]
    (tmp_path / "a.py").write_text(f"def f():  # long: one table of constants\n{body}\n")
    assert house.oversize(tmp_path) == []
    assert [x.reason for x in house.long_items(tmp_path)] == ["one table of constants"]  # what the report prints
    (tmp_path / "a.py").write_text(f"def f():  # long: why\n{body}\n")  # a reason of one word is none
    assert len(house.oversize(tmp_path)) == 1
    (tmp_path / "b.py").write_text("x = 1\n" * (house.MAX_FILE_LINES + 1))
    assert any(x.startswith("b.py:") or "b.py: " in x for x in house.oversize(tmp_path))


def test_positional_parameters_count_neither_self_nor_keyword_only(tmp_path):
    (tmp_path / "m.py").write_text(
        "class C:\n"
        "    def m(self, a, b, c, d, e): ...\n"  # 5: self not counted
        "    def k(self, a, b, c, d, *args, e, **kw): ...\n"  # 4: *args, keyword-only and **kw not counted
        "def f(a, b, /, c, d, e=1): ...\n"  # 5: positional-only counted
    )
    assert [(w.split(" ")[1], n) for w, n in house.many_positional(tmp_path)] == [("m", 5), ("f", 5)]


def test_the_report_runs_and_exits_0():
    assert house.main([]) == 0


def test_test_modules_have_unique_names():
    """The test folders are not packages, so pytest imports each test module by its file name: two with one name
    (tests/unit/x.py and tests/integration/x.py) stop the README's ``pytest tests`` at collection, though each folder
    alone passes."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, list[str]] = {}
    for p in tests.rglob("test_*.py"):
        if "__pycache__" not in p.parts:
            seen.setdefault(p.name, []).append(str(p.relative_to(tests)))
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}
