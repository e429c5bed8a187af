"""docs/guide.md: every fenced command marked runnable (```bash runnable) runs as written and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"


def runnable_commands() -> list[str]:
    blocks = re.findall(r"```bash runnable\n(.*?)```", GUIDE.read_text(), flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()]


def test_guide_is_linked_from_the_readme_and_has_runnable_commands():
    assert "docs/guide.md" in (ROOT / "README.md").read_text()
    assert len(runnable_commands()) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("command", runnable_commands())
def test_guide_command_runs(command):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = re.sub(r"^python\b", sys.executable, command)
    r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{command}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-3000:]}"
