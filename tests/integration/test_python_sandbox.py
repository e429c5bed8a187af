"""The Python sandbox tool with real subprocesses: each limit made to trip for real, and nothing left behind.

A program that hangs, raises, prints 100 MB, allocates 4 GB, writes files or tries the network gives a ToolError the
policy reads; the process group (a forked grandchild too) is gone afterwards, also when the awaiting task is
cancelled; the working directory is removed; at most ``max_concurrent`` programs run at once.
"""

import asyncio
import os
import resource
import socket
import subprocess
import time

import pytest

from asyncrl.agent.tools.base import ToolError, ToolUnavailable
from asyncrl.agent.tools.python_sandbox import ISOLATION_MODES, WORKDIR_PREFIX, PythonTool, sweep_stale_workdirs

FORK_THEN = """
import os, time
child = os.fork()
if child == 0:
    time.sleep(1e6)
    os._exit(0)
print(os.getpid(), child, flush=True)
"""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphaned zombie waits for a reaper that is not ours)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_dead(pids, timeout_s=5.0):
    """SIGKILL is delivered asynchronously: poll until every pid is gone or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def run(tool, code, timeout_s=60.0):
    return asyncio.run(tool.call({"code": code}, timeout_s=timeout_s))


def test_prints_a_value_and_picks_an_isolation():
    tool = PythonTool(timeout_s=30.0)
    assert tool.network_isolation is None
    assert run(tool, "print(sum(range(10)))\nprint('é')") == "45\né\n"
    assert tool.network_isolation in ISOLATION_MODES
    assert tool.num_running == 0 and tool.num_waiting == 0


@pytest.mark.parametrize("hang", ["while True: pass", "time.sleep(1e6)"])
def test_a_hang_is_cut_at_the_wall_limit_and_its_group_killed(hang):
    tool = PythonTool(timeout_s=2.0, cpu_s=60)
    ticks = 0

    async def main():
        async def ticker():  # the event loop stays free while the program hangs
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(ticker())
        try:
            return await tool.call({"code": FORK_THEN + hang}, timeout_s=60.0)
        finally:
            t.cancel()

    start = time.monotonic()
    with pytest.raises(ToolError) as err:
        asyncio.run(main())
    elapsed = time.monotonic() - start
    assert str(err.value).startswith("timed out after 2.0 s")
    assert elapsed < 2.0 + 2.0
    assert ticks >= 1
    pids = [int(p) for p in str(err.value).split("\n")[1].split()]  # the output so far: program, grandchild
    assert len(pids) == 2
    assert wait_dead(pids) == []


def test_cpu_time_limit():
    tool = PythonTool(timeout_s=30.0, cpu_s=1)
    with pytest.raises(ToolError, match="^killed: CPU time limit 1 s"):
        run(tool, "while True: pass")


def test_a_raise_gives_its_traceback():
    with pytest.raises(ToolError) as err:
        run(PythonTool(timeout_s=30.0), "print('before')\ndef f():\n    raise ValueError('boom 17')\nf()\n")
    text = str(err.value)
    assert text.startswith("exit code 1\n")
    assert "before" in text and 'File "main.py", line 3, in f' in text and text.endswith("ValueError: boom 17")
    assert "<string>" not in text  # the prelude's frame is cut


def test_exit_code_and_stderr_on_failure_only():
    tool = PythonTool(timeout_s=30.0)
    assert run(tool, "import sys\nprint('out')\nprint('warn', file=sys.stderr)") == "out\n"
    with pytest.raises(ToolError, match=r"^exit code 3\nout\nwarn$"):
        run(tool, "import sys\nprint('out')\nprint('warn', file=sys.stderr)\nsys.exit(3)")


def test_100_mb_of_output_hits_the_cap_quickly():
    tool = PythonTool(timeout_s=60.0, max_output_bytes=4096)
    run(tool, "print(1)")  # the first call's imports are not what is measured
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ToolError) as err:
        run(tool, "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\n")
    assert time.monotonic() - start < 20.0
    text = str(err.value)
    assert text.startswith("output exceeded 4096 bytes")
    assert text.split("\n", 1)[1] == "x" * 4096
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb) / 1024
    assert growth_mb < 50


@pytest.fixture(params=ISOLATION_MODES)
def isolated_tool(request):
    tool = PythonTool(timeout_s=30.0, network_isolation=request.param)
    try:
        run(tool, "pass")
    except ToolUnavailable as exc:
        pytest.skip(f"{request.param} is not available here: {exc}")
    assert tool.network_isolation == request.param
    return tool


def test_the_network_is_out_of_reach(isolated_tool):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('connected')\n"
        with pytest.raises(ToolError) as err:
            run(isolated_tool, code)
        text = str(err.value)
        assert "connected" not in text.splitlines()
        expected = {"socket-guard": "network access is disabled in this sandbox"}
        assert expected.get(isolated_tool.network_isolation, "Network is unreachable") in text
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # a connection that had reached it would be waiting here
            listener.accept()


def test_a_program_cannot_rejoin_the_callers_network():
    """In a user namespace the program holds no capability outside it: setns() into the caller's network fails
    (``netns`` alone, as root, allows it: why ``auto`` prefers ``userns``)."""
    tool = PythonTool(timeout_s=30.0, network_isolation="userns")
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = os.open(f'/proc/{os.getppid()}/ns/net', os.O_RDONLY)\n"
        "print(libc.setns(fd, 0x40000000), os.strerror(ctypes.get_errno()))\n"
    )
    try:
        out = run(tool, code)
    except ToolUnavailable:
        pytest.skip("user namespaces are not available here")
    except ToolError as exc:  # /proc/<pid>/ns/net not even readable: refused earlier, as good
        assert "Permission denied" in str(exc)
        return
    assert out.startswith("-1 ")


def test_a_4_gb_allocation_is_a_memory_error():
    with pytest.raises(ToolError, match="MemoryError"):
        run(PythonTool(timeout_s=30.0, memory_mb=512), "b = bytearray(4 * 1024 ** 3)\nprint(len(b))")


def test_file_size_limit():
    """SIGXFSZ's default (Python itself ignores it, and an exec keeps that) kills the program at the limit."""
    tool = PythonTool(timeout_s=30.0, file_size_mb=1)
    with pytest.raises(ToolError, match="^killed: file size limit 1 MB"):
        run(tool, "open('big', 'wb').write(b'x' * (2 << 20))")
    with pytest.raises(ToolError, match="^killed: file size limit 1 MB"):
        run(
            tool,
            "import os\nos.dup2(os.open('big', os.O_WRONLY | os.O_CREAT), 1)\nos.execv('/bin/dd', ['dd', 'if=/dev/zero', 'bs=1M', 'count=2'])",
        )


def test_writes_stay_in_a_temp_dir_that_is_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", "hunter2")
    code = (
        "import os, sys, tempfile\n"
        "open('out.txt', 'w').write('hi')\n"
        "open(os.path.expanduser('~/home.txt'), 'w').write('hi')\n"
        "tempfile.NamedTemporaryFile(delete=False).write(b'hi')\n"
        "print(os.getcwd())\nprint(sorted(os.environ))\nprint(sorted(os.listdir('.')))\nprint(sys.flags.isolated)\n"
    )
    cwd, env, listing, isolated = run(PythonTool(timeout_s=30.0), code).splitlines()
    assert cwd != str(tmp_path) and not os.path.exists(cwd)
    assert env == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    assert listing.startswith("['home.txt', 'main.py', 'out.txt', 'tmp")
    assert isolated == "1"
    assert list(tmp_path.iterdir()) == []


def test_at_most_max_concurrent_programs_run(tmp_path):
    tool = PythonTool(timeout_s=60.0, max_concurrent=2)
    code = (
        "import os, sys, time\n"
        f"d = {str(tmp_path)!r}\n"
        "start = time.monotonic()\n"
        "open(os.path.join(d, f'start-{os.getpid()}'), 'w').write(repr(start))\n"
        "deadline = start + 30\n"
        "while not os.path.exists(os.path.join(d, 'go')) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(start, time.monotonic())\n"
    )

    def started():
        return [p for p in tmp_path.iterdir() if p.name.startswith("start-")]

    async def main():
        calls = [asyncio.create_task(tool.call({"code": code}, timeout_s=60.0)) for _ in range(4)]
        deadline = time.monotonic() + 30
        while not (len(started()) == 2 and tool.num_waiting == 2) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert (len(started()), tool.num_running, tool.num_waiting) == (2, 2, 2)
        (tmp_path / "go").touch()
        return await asyncio.gather(*calls)

    intervals = [tuple(map(float, out.split())) for out in asyncio.run(main())]
    assert len(started()) == 4
    most = max(sum(1 for s, e in intervals if s <= t < e) for t, _ in intervals)
    assert most <= 2


def test_waiting_for_a_slot_counts_against_the_timeout(tmp_path):
    tool = PythonTool(timeout_s=60.0, max_concurrent=1)
    started = tmp_path / "started"

    async def main():
        busy = asyncio.create_task(
            tool.call({"code": f"import time\nopen({str(started)!r}, 'w')\ntime.sleep(60)"}, timeout_s=60.0)
        )
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        try:
            with pytest.raises(ToolError, match=r"^timed out after 0\.5 s waiting for a free sandbox$"):
                await tool.call({"code": "print(1)"}, timeout_s=0.5)
        finally:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)

    asyncio.run(main())
    assert (tool.num_running, tool.num_waiting) == (0, 0)


def test_cancelling_the_caller_kills_the_group(tmp_path):
    tool = PythonTool(timeout_s=60.0)
    pid_file = tmp_path / "pids"
    code = FORK_THEN.replace(
        "print(os.getpid(), child, flush=True)",
        f"open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child}} {{os.getcwd()}}')\ntime.sleep(1e6)",
    )

    async def main():
        task = asyncio.create_task(tool.call({"code": code}, timeout_s=60.0))
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and len(pid_file.read_text().split()) == 3) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    leader, grandchild, workdir = pid_file.read_text().split()
    assert not alive(int(leader))  # reaped before the cancelled call returned
    assert wait_dead([int(grandchild)]) == []
    assert not os.path.exists(workdir)
    assert tool.num_running == 0


def test_the_sweep_removes_only_dead_owners_dirs(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{WORKDIR_PREFIX}{dead.pid}-abc"
    mine = tmp_path / f"{WORKDIR_PREFIX}{os.getpid()}-abc"
    other = tmp_path / "asyncrl-python-notapid-abc"
    for d in (stale, mine, other):
        d.mkdir()
        (d / "main.py").write_text("print(1)")
    assert sweep_stale_workdirs(str(tmp_path)) == [str(stale)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"memory_mb": -1}, "memory_mb"),
        ({"max_output_bytes": 0}, "max_output_bytes"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"network_isolation": "none"}, "network_isolation"),
    ],
)
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        PythonTool(**kwargs)


def test_bad_arguments_name_the_field():
    with pytest.raises(ToolError, match="'code' must be a string"):
        asyncio.run(PythonTool().call({"source": "print(1)"}, timeout_s=5.0))
