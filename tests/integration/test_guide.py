"""docs/guide.md: every fenced command marked runnable (```bash runnable) runs as written, exits 0 and prints the
lines recorded under it as ``# prints: ...`` (spacing and line wrapping aside): a command whose output changes
meaning fails here, not only one that stops running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
PRINTS = "# prints:"


def runnable_commands(text: str | None = None) -> list[tuple[str, list[str]]]:
    """(command, the lines it must print) of each runnable block's commands, in order."""
    blocks = re.findall(r"```bash runnable\n(.*?)```", GUIDE.read_text() if text is None else text, flags=re.S)
    out: list[tuple[str, list[str]]] = []
    for line in (x.strip() for b in blocks for x in b.splitlines()):
        if line.startswith(PRINTS):
            assert out, f"{line!r} comes before any command"
            out[-1][1].append(line[len(PRINTS) :].strip())
        elif line and not line.startswith("#"):
            out.append((line, []))
    return out


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_guide_is_linked_from_the_readme_and_every_runnable_command_says_what_it_prints():
    assert "docs/guide.md" in (ROOT / "README.md").read_text()
    commands = runnable_commands()
    assert len(commands) >= 3
    assert [c for c, prints in commands if not prints] == []  # nothing is checked for its exit code only


def test_the_prints_lines_belong_to_the_command_above_them():
    text = "```bash runnable\na --x\n# prints: one\n\n# a comment\nb\n# prints: two\n# prints:  three  \n```\n"
    assert runnable_commands(text) == [("a --x", ["one"]), ("b", ["two", "three"])]
    assert _flat("  8       571\n  632  ") == "8 571 632"


@pytest.mark.slow
@pytest.mark.parametrize("command,prints", runnable_commands(), ids=[c for c, _ in runnable_commands()])
def test_guide_command_runs_and_prints_what_the_guide_says(command, prints):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = re.sub(r"^python\b", sys.executable, command)
    r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{command}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-3000:]}"
    said = _flat(r.stdout + "\n" + r.stderr)
    missing = [p for p in prints if _flat(p) not in said]
    assert missing == [], f"{command}\ndoes not print {missing}\nstdout:\n{r.stdout[-3000:]}"
