"""The house stays readable: no function in asyncrl/ over 60 lines, no module over 500 lines.

Where one must be longer, the reason stands in the code, on one line:

- a function: ``# long: <reason>`` on the ``def`` line, the line above it (above its decorators),
  or the first line of its body;
- a module: ``# long: <reason>`` in its first 5 lines.

The reason must say something (at least three words). Lines are counted as the file has them
(docstrings and comments included), from the ``def`` (decorators excluded) to the function's last line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "asyncrl"
MAX_FUNC_LINES = 60
MAX_FILE_LINES = 500
TAG = "# long:"


def _reason(line: str) -> str | None:
    i = line.find(TAG)
    if i < 0:
        return None
    text = line[i + len(TAG) :].strip()
    return text if len(text.split()) >= 3 else None


def _func_reason(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    candidates = [lines[node.lineno - 1], lines[first - 2] if first >= 2 else ""]
    if node.body:
        candidates.append(lines[node.body[0].lineno - 1])
        candidates.append(lines[node.body[0].lineno - 2])  # a comment line between the signature and the body
    return next((r for r in map(_reason, candidates) if r), None)


def oversize(root: Path = ROOT) -> list[str]:
    """Every function over ``MAX_FUNC_LINES`` and module over ``MAX_FILE_LINES`` without a reason."""
    out = []
    for path in sorted(root.rglob("*.py")):
        src = path.read_text()
        lines = src.splitlines()
        rel = path.relative_to(root.parent)
        if len(lines) > MAX_FILE_LINES and not any(_reason(x) for x in lines[:5]):
            out.append(f"{rel}: {len(lines)} lines (> {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNC_LINES and not _func_reason(lines, node):
                    out.append(f"{rel}:{node.lineno} {node.name}: {n} lines (> {MAX_FUNC_LINES})")
    return out


def test_no_oversize_function_or_module():
    found = oversize()
    assert not found, "split these, or give the reason on one line ('# long: ...'):\n" + "\n".join(found)


def test_the_check_sees_a_long_function_and_accepts_a_reason(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNC_LINES))
    (tmp_path / "a.py").write_text(f"def f():\n{body}\n")
    assert [x.split(" ")[1] for x in oversize(tmp_path)] == ["f:"]
    (tmp_path / "a.py").write_text(f"def f():  # long: one table of constants\n{body}\n")
    assert oversize(tmp_path) == []
    (tmp_path / "a.py").write_text(f"def f():  # long: why\n{body}\n")  # a reason of one word is none
    assert len(oversize(tmp_path)) == 1
    (tmp_path / "b.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert any(x.startswith("b.py:") or "b.py: " in x for x in oversize(tmp_path))
