"""docs/environments.md's complete example, as a user runs it: its Python block (first line ``# example: my_env.py``)
written to a folder outside the package, its bash command run (with the test's prepared artefacts, ports and 4
steps); the environment trains and its own metrics reach metrics.jsonl and TensorBoard."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from proc_helpers import REPO, read_metrics, tiny_cmd, tiny_env
from test_e2e import tb_scalars

pytestmark = pytest.mark.slow

DOC = REPO / "docs" / "environments.md"


def example_blocks() -> tuple[str, str]:
    text = DOC.read_text()
    code = re.search(r"```python\n(# example: my_env\.py\n.*?)```", text, re.DOTALL)
    assert code, "docs/environments.md has no python block starting with '# example: my_env.py'"
    after = text[code.end() :]
    cmd = re.search(r"```bash\n(.*?)```", after, re.DOTALL)
    assert cmd, "no bash block after the example"
    return code.group(1), cmd.group(1).strip()


def test_the_documented_example_environment_trains_on_the_cpu_default(prepared, tmp_path):
    code, cmd = example_blocks()
    env_dir = tmp_path / "user_code"
    env_dir.mkdir()
    (env_dir / "my_env.py").write_text(code)
    words = shlex.split(cmd)
    assert words[0] == "PYTHONPATH=." and words[1:6] == [
        "torchrun",
        "--nproc_per_node",
        "2",
        "launch/train.py",
        "configs/tiny.toml",
    ], cmd
    overrides = [w for w in words[6:] if not w.startswith("runner.max_steps=")]
    assert "agentloop.task_name=my_env:ENV" in overrides, cmd
    run_dir = tmp_path / "run"
    env = tiny_env()
    env["PYTHONPATH"] = os.pathsep.join([str(env_dir), env["PYTHONPATH"]])
    dry = subprocess.run(
        [sys.executable, "launch/train.py", "configs/tiny.toml", *overrides, "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0 and "environment 'my_env:ENV' (MyEnv), tools: search, spell" in dry.stdout, dry.stderr
    r = subprocess.run(
        tiny_cmd(prepared, run_dir, *overrides, "runner.max_steps=4"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3, 4]
    assert all(0.0 <= x["env/answered"] <= 1.0 and 0.0 <= x["env/exact"] <= 1.0 for x in recs), recs[-1]
    tb = tb_scalars(run_dir)
    assert set(tb["env/answered"]) == {1, 2, 3, 4} and set(tb["env/exact"]) == {1, 2, 3, 4}
