"""The HTTP tool server as a real subprocess on a free port, and HttpTool, its client, over real sockets.

Discovery, calls to the python and calculator tools and to a user tool loaded by ``module:attr``, every error path of
the protocol (an error reply, an unknown tool, a malformed body, a call past its timeout), and a server SIGKILLed in
the middle of a call: a ToolError naming the URL within the client's timeout, and the sandbox it ran is gone too.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from asyncrl.agent.tools.base import ToolError, ToolUnavailable
from asyncrl.agent.tools.http_tool import HttpTool, parse_call, server_timeout_s
from asyncrl.agent.tools.python_sandbox import sweep_stale_workdirs

REPO = Path(__file__).resolve().parents[2]

USER_TOOLS = """
import asyncio

class Echo:
    name = "echo"
    description = "Returns its arguments."
    parameters = {"type": "object"}
    async def call(self, arguments, *, timeout_s):
        return {"echo": arguments, "timeout_s": timeout_s}
    async def close(self):
        pass

class Stuck(Echo):
    name = "stuck"
    async def call(self, arguments, *, timeout_s):
        await asyncio.sleep(3600)  # ignores its deadline: the server's backstop answers

def make_stuck():
    return Stuck()

class Broken(Echo):
    name = "broken"
    async def call(self, arguments, *, timeout_s):
        from asyncrl.agent.tools.base import ToolUnavailable
        if arguments.get("how") == "unavailable":
            raise ToolUnavailable("its backend is down")
        raise RuntimeError("a bug in the tool")
"""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for a reaper that is not ours)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, timeout_s=10.0):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def start_server(tmp_path, *tools, timeout_s=60.0):
    """The server on a free port, ready (its /health answers); returns (process, base URL)."""
    (tmp_path / "user_tools.py").write_text(USER_TOOLS)
    port = free_port()
    args = [sys.executable, "-m", "asyncrl.agent.tools.http_tool", "--port", str(port), "--max-timeout-s", "30"]
    for t in tools:
        args += ["--tool", t]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tool server exited {proc.returncode}: {(tmp_path / 'server.log').read_text()}")
        try:
            if http("GET", url + "/health", timeout_s=2.0)[0] == 200:
                return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop(proc)
            raise TimeoutError(f"tool server did not answer /health in {timeout_s} s")
        time.sleep(0.05)


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.fixture
def server(tmp_path):
    proc, url = start_server(
        tmp_path, "python", "calculator", "user_tools:Echo", "user_tools:make_stuck", "user_tools:Broken"
    )
    yield url
    stop(proc)


def test_discover_and_call_through_the_server(server):
    async def main():
        tools = await HttpTool.discover(server, timeout_s=10.0, call_timeout_s=20.0)
        by_name = {t.name: t for t in tools}
        try:
            assert sorted(by_name) == ["broken", "calculator", "echo", "python", "stuck"]
            assert by_name["python"].parameters["required"] == ["code"]
            assert "arithmetic" in by_name["calculator"].description
            assert await by_name["python"].call({"code": "print(6 * 7)"}, timeout_s=20.0) == "42\n"
            assert await by_name["calculator"].call({"expression": "2 + 3 * 4"}, timeout_s=20.0) == "14"
            echoed = await by_name["echo"].call({"x": [1, "two", None]}, timeout_s=8.0)
            assert echoed == {"echo": {"x": [1, "two", None]}, "timeout_s": server_timeout_s(8.0)}
            with pytest.raises(ToolError, match="ZeroDivisionError: division by zero"):
                await by_name["python"].call({"code": "1 / 0"}, timeout_s=20.0)
            with pytest.raises(ToolError, match=r"^cannot evaluate: names are not allowed \('x'\)$"):
                await by_name["calculator"].call({"expression": "x"}, timeout_s=20.0)
            start = time.monotonic()
            with pytest.raises(ToolError, match=r"^stuck: timed out after 1\.5 s$"):
                await by_name["stuck"].call({}, timeout_s=2.0)
            assert time.monotonic() - start < 2.0 + 1.0
            with pytest.raises(ToolError, match=r"failed \(HTTP 503\): broken unavailable: its backend is down$"):
                await by_name["broken"].call({"how": "unavailable"}, timeout_s=5.0)
            with pytest.raises(ToolError, match=rf"^tool server {server}/call failed \(HTTP 500\)"):
                await by_name["broken"].call({}, timeout_s=5.0)  # aiohttp's own 500 page: not JSON, quoted
        finally:
            for t in tools:
                await t.close()

    asyncio.run(main())


def test_protocol_errors(server):
    status, body = http("GET", server + "/tools")
    assert status == 200 and {t["name"] for t in body["tools"]} == {"python", "calculator", "echo", "stuck", "broken"}
    status, body = http("POST", server + "/call", {"name": "nope", "arguments": {}})
    assert status == 404 and "unknown tool 'nope'" in body["error"] and "calculator" in body["error"]
    for bad, field in [
        ({"arguments": {}}, "'name'"),
        ({"name": "calculator", "arguments": [1]}, "'arguments'"),
        ({"name": "calculator", "arguments": {}, "timeout_s": -1}, "'timeout_s'"),
        ({"name": "calculator", "arguments": {}, "timeout_s": "5"}, "'timeout_s'"),
        ([1, 2], "JSON object"),
    ]:
        status, body = http("POST", server + "/call", bad)
        assert status == 400 and field in body["error"], (bad, body)
    status, body = http("POST", server + "/call", b"{not json")
    assert status == 400 and "invalid JSON body" in body["error"]

    async def unknown():
        tool = HttpTool(server, "nope", timeout_s=10.0)
        try:
            await tool.call({}, timeout_s=10.0)
        finally:
            await tool.close()

    with pytest.raises(ToolError, match=r"refused the call \(HTTP 404\): unknown tool 'nope'"):
        asyncio.run(unknown())


def test_a_server_killed_mid_call_is_a_tool_error_naming_the_url(tmp_path):
    proc, url = start_server(tmp_path, "python")
    marker = tmp_path / "sandbox.pid"
    code = f"import os, time\nopen({str(marker)!r}, 'w').write(f'{{os.getpid()}} {{os.getcwd()}}')\ntime.sleep(60)\n"
    tool = HttpTool(url, "python", timeout_s=30.0)

    async def main():
        call = asyncio.create_task(tool.call({"code": code}, timeout_s=30.0))
        deadline = time.monotonic() + 30
        while not (marker.exists() and len(marker.read_text().split()) == 2) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)  # the server alone: its sandbox has a session of its own
        try:
            with pytest.raises(ToolError) as err:
                await call
        finally:
            await tool.close()
        return err.value, time.monotonic() - killed_at

    try:
        err, after_s = asyncio.run(main())
    finally:
        stop(proc)
    assert str(err).startswith(f"tool server unreachable: {url}/call")
    assert after_s < 10.0  # the client's timeout is 30 s: the broken connection was seen, not waited out
    sandbox_pid, workdir = marker.read_text().split()
    sandbox_pid = int(sandbox_pid)
    deadline = time.monotonic() + 10
    while alive(sandbox_pid) and time.monotonic() < deadline:  # PR_SET_PDEATHSIG: it dies with the server
        time.sleep(0.05)
    assert not alive(sandbox_pid)
    assert os.path.isdir(workdir)  # the SIGKILLed server could not remove it: the next tool's first call does
    assert workdir in sweep_stale_workdirs()
    assert not os.path.exists(workdir)


def test_no_server_at_all():
    url = f"http://127.0.0.1:{free_port()}"

    async def main():
        tool = HttpTool(url, "python", timeout_s=5.0)
        try:
            with pytest.raises(ToolError, match=f"^tool server unreachable: {url}/call"):
                await tool.call({"code": "print(1)"}, timeout_s=5.0)
        finally:
            await tool.close()
        with pytest.raises(ToolUnavailable, match=f"tool server {url}/tools"):
            await HttpTool.discover(url, timeout_s=5.0)

    asyncio.run(main())


@pytest.mark.parametrize(
    "spec, says",
    [
        ("no_such_module_xyz:Tool", "cannot import 'no_such_module_xyz'"),
        ("user_tools:Missing", "has no attribute 'Missing'"),
        ("user_tools", "expected python | calculator | module:attr"),
        ("user_tools:USER_NAME", "'name' must match"),
    ],
)
def test_a_bad_tool_spec_stops_the_server_naming_it(tmp_path, spec, says):
    (tmp_path / "user_tools.py").write_text(USER_TOOLS + "\nUSER_NAME = 'not a tool'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl.agent.tools.http_tool", "--port", "0", "--tool", "calculator", "--tool", spec],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"--tool {spec}: " in done.stderr and says in done.stderr


def test_parse_call_names_the_field():
    assert parse_call({"name": "a", "arguments": {"x": 1}, "timeout_s": 99}, max_timeout_s=30.0) == (
        "a",
        {"x": 1},
        30.0,
    )
    assert parse_call({"name": "a"}, max_timeout_s=30.0) == ("a", {}, 30.0)
    with pytest.raises(ValueError, match="'timeout_s'"):
        parse_call({"name": "a", "timeout_s": True}, max_timeout_s=30.0)
