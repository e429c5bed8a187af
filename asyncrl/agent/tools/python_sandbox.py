"""``PythonTool``: the policy's Python code in a limited subprocess; nothing it does can reach into the caller.

Contract: ``call({"code": "print(6 * 7)"}, timeout_s=...)`` returns the program's stdout as text (at most
``max_output_bytes``), or raises ``ToolError`` with a short message the policy reads, its first line saying how the
program ended and the rest its output (stdout, then stderr: the traceback's last lines): ``exit code 1`` (a raise,
a ``MemoryError``), ``timed out after 5.0 s``, ``killed: CPU time limit 5 s``, ``killed: file size limit 64 MB``,
``output exceeded 8192 bytes: the program was killed, its output cut there:``. It raises ``ToolUnavailable`` only
when the network isolation asked for cannot be had on this machine (at the first call). It returns or raises within
``timeout_s`` (plus the time to kill and reap: milliseconds), never hangs or crashes the event loop (all its waiting
is async), and always kills the program's whole process group and reaps it, also when the awaiting task is
cancelled.

Each run, in a fresh temporary directory (its working directory, ``HOME`` and ``TMPDIR``; removed afterwards, or,
when this process was SIGKILLed first, by the first call of a later tool: ``sweep_stale_workdirs``):
``python -I`` (isolated: no user site, no ``PYTHON*`` variables, no cwd on ``sys.path``) with stdin closed, an
environment of ``PATH``, ``LANG``, ``HOME``, ``TMPDIR`` only (no inherited secrets), its own session and process
group (``start_new_session``), ``RLIMIT_CPU`` (``cpu_s``; SIGKILL one second later), ``RLIMIT_AS`` (``memory_mb``),
``RLIMIT_FSIZE`` (``file_size_mb``), no core dumps, and SIGKILL when this process dies (``PR_SET_PDEATHSIG``).
stdout and stderr are read as they come; past ``max_output_bytes`` (both together) the group is killed. At most
``max_concurrent`` programs run at once (an ``asyncio.Semaphore``; the wait counts against ``timeout_s``).

No network: the first call picks, and logs in one line, the strongest isolation this machine allows, kept in
``tool.network_isolation``: ``userns`` (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``: a new network namespace, only a
loopback that is down, inside a new user namespace, so the program holds no capability outside it and cannot
``setns()`` back; needs unprivileged user namespaces, or root), else ``netns`` (``unshare(CLONE_NEWNET)`` alone, for
root where user namespaces are disabled; a root program can undo it with ``setns()`` into this process's namespace,
so it is second), else ``socket-guard`` (a prelude that refuses ``connect``/``sendto``/``bind`` on IPv4/IPv6
sockets: a guard against accidents, not a wall; code that calls ``_socket`` or ``ctypes`` directly gets past it).
Not isolated: the file system (a program can read what this user can; writes are bounded by ``RLIMIT_FSIZE`` per
file only), a grandchild that calls ``setsid()`` leaves the process group, and the number of processes is not
bounded (``RLIMIT_NPROC`` counts all of a user's processes; both need a PID namespace or a cgroup, not used here).

    tool = PythonTool(timeout_s=5.0, memory_mb=512)
    await tool.call({"code": "print(sum(range(10)))"}, timeout_s=5.0)   # "45\\n"
    tool.network_isolation                                              # "userns", after the first call
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

from asyncrl.agent.tools.base import ToolError, ToolUnavailable

log = logging.getLogger("asyncrl.tools.python")

ISOLATION_MODES = ("userns", "netns", "socket-guard")  # strongest first: "auto" takes the first that works
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"  # the child's PATH: system binaries only, nothing of the caller's
READ_GRACE_S = 2.0  # after the kill, how long the pipes may take to close (a setsid() grandchild may hold them)
PROBE_TIMEOUT_S = 30.0  # the isolation probe is one interpreter start; generous for a loaded machine
CHUNK_BYTES = 65536  # one pipe read
WORKDIR_PREFIX = "asyncrl-python-"  # + the owning process's pid + "-": how a later sweep knows a dir is stale

# Runs in the child before the policy's code: argv[1] is the JSON settings. Limits last, so the set-up is not
# bound by them; the policy's code runs in a fresh namespace with the prelude's frame cut from its tracebacks.
_PRELUDE = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the tool's process
if os.getppid() != cfg["ppid"]:
    os._exit(137)  # the tool's process died before the line above
flags = {"netns": 0x40000000, "userns": 0x10000000 | 0x40000000}.get(cfg["network"], 0)
if flags and libc.unshare(flags) != 0:
    sys.stderr.write("sandbox set-up failed: unshare: " + os.strerror(ctypes.get_errno()) + "\n")
    os._exit(97)
if cfg["network"] == "socket-guard":
    import socket
    def _guard(name):
        real = getattr(socket.socket, name)
        def refuse(self, *args):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                raise PermissionError(1, "network access is disabled in this sandbox")
            return real(self, *args)
        setattr(socket.socket, name, refuse)
    for _name in ("connect", "connect_ex", "sendto", "sendmsg", "bind"):
        _guard(_name)
if cfg.get("probe"):
    os._exit(0)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"], cfg["memory_bytes"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_bytes"], cfg["file_size_bytes"]))
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it (an OSError instead); the limit kills, clearly
sys.stdout.reconfigure(line_buffering=True)
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as f:
    _code = compile(f.read(), "main.py", "exec")
try:
    exec(_code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as exc:
    import traceback
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # every member already gone
        pass


def _text(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")


def _tail(data: bytes, limit: int) -> str:
    return _text(data[-limit:]) if len(data) > limit else _text(data)


class _Capture:
    """stdout and stderr read from our own pipes as they come (loop readers), at most ``cap`` bytes kept of both
    together, the rest read and dropped; ``overflow`` is set past the cap, ``eof`` once both pipes closed. Our own
    pipes, not asyncio's: its ``Process.wait()`` (3.11) also waits for its pipes, which a grandchild may hold."""

    def __init__(self, cap: int):
        self.cap = cap
        self.kept = {"out": bytearray(), "err": bytearray()}
        self.num_bytes = 0
        self.overflow = asyncio.Event()
        self.eof = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._open: dict[int, str] = {}

    def pipe(self, stream: str) -> int:
        """A new pipe whose read end is watched as ``stream`` (out | err); returns the write end, for the child."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        self._open[read_fd] = stream
        self._loop.add_reader(read_fd, self._on_readable, read_fd)
        return write_fd

    def _on_readable(self, fd: int) -> None:
        try:
            chunk = os.read(fd, CHUNK_BYTES)
        except BlockingIOError:
            return
        if not chunk:
            self._forget(fd)
            return
        room = max(self.cap - self.num_bytes, 0)
        self.kept[self._open[fd]] += chunk[:room]
        self.num_bytes += len(chunk)
        if self.num_bytes > self.cap:
            self.overflow.set()

    def _forget(self, fd: int) -> None:
        self._loop.remove_reader(fd)
        os.close(fd)
        del self._open[fd]
        if not self._open:
            self.eof.set()

    def close(self) -> None:
        for fd in list(self._open):
            self._forget(fd)


def describe_exit(returncode: int, *, cpu_s: int, file_size_mb: int) -> str:
    """One line for how the program ended (pure)."""
    if returncode >= 0:
        return f"exit code {returncode}"
    sig = -returncode
    if sig == signal.SIGXCPU:
        return f"killed: CPU time limit {cpu_s} s"
    if sig == signal.SIGXFSZ:
        return f"killed: file size limit {file_size_mb} MB"
    if sig == signal.SIGKILL:
        return f"killed by SIGKILL (the CPU time limit {cpu_s} s, or out of memory)"
    try:
        return f"killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"killed by signal {sig}"


class PythonTool:
    """Runs Python code in a limited subprocess (the module docstring has the contract). One instance serves one
    event loop (its semaphore binds to it)."""

    name = "python"
    description = (
        "Runs a Python 3 program and returns what it prints to stdout. Each call is a fresh process with no network "
        "and limited time, memory and output; print the values you need."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program"}},
        "required": ["code"],
    }

    def __init__(
        self,
        *,
        timeout_s: float = 10.0,
        cpu_s: int = 10,
        memory_mb: int = 1024,
        max_output_bytes: int = 8192,
        max_concurrent: int | None = None,
        file_size_mb: int = 64,
        network_isolation: str = "auto",
    ):
        for key, value in [("timeout_s", timeout_s), ("cpu_s", cpu_s), ("memory_mb", memory_mb)]:
            if not value > 0:
                raise ValueError(f"PythonTool: {key} must be > 0, got {value!r}")
        for key, value in [("max_output_bytes", max_output_bytes), ("file_size_mb", file_size_mb)]:
            if not value > 0:
                raise ValueError(f"PythonTool: {key} must be > 0, got {value!r}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"PythonTool: max_concurrent must be >= 1 or None (cpu count), got {max_concurrent!r}")
        if network_isolation not in ("auto", *ISOLATION_MODES):
            raise ValueError(
                f"PythonTool: network_isolation must be auto | {' | '.join(ISOLATION_MODES)}, got {network_isolation!r}"
            )
        self.timeout_s = float(timeout_s)
        self.cpu_s = int(cpu_s)
        self.memory_mb = int(memory_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.file_size_mb = int(file_size_mb)
        self.max_concurrent = max_concurrent or os.cpu_count() or 1
        self.requested_isolation = network_isolation
        self.network_isolation: str | None = None
        """The isolation in use (``userns`` | ``netns`` | ``socket-guard``); None until the first call."""
        self.num_running = 0
        self.num_waiting = 0
        self._slots = asyncio.Semaphore(self.max_concurrent)
        self._isolation_lock = asyncio.Lock()

    async def call(self, arguments: dict, *, timeout_s: float) -> str:
        limit_s = min(self.timeout_s, timeout_s)
        deadline = time.monotonic() + limit_s
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str):
            raise ToolError(f"python: argument 'code' must be a string, got {type(code).__name__}")
        mode = await self._isolation()
        self.num_waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise ToolError(f"timed out after {limit_s:.1f} s waiting for a free sandbox") from None
        finally:
            self.num_waiting -= 1
        self.num_running += 1
        try:
            return await self._run(code, deadline, limit_s, mode)
        finally:
            self.num_running -= 1
            self._slots.release()

    async def close(self) -> None:
        return None  # every run cleans up after itself; nothing is held between calls

    async def _isolation(self) -> str:
        async with self._isolation_lock:
            if self.network_isolation is None:
                self.network_isolation = await self._pick_isolation()
                removed = await asyncio.to_thread(sweep_stale_workdirs)
                if removed:
                    log.info("python tool: removed %d working directories of dead tool processes", len(removed))
        return self.network_isolation

    async def _pick_isolation(self) -> str:
        modes = ISOLATION_MODES if self.requested_isolation == "auto" else (self.requested_isolation,)
        failures = []
        for mode in modes:
            reason = await self._probe(mode)
            if reason is None:
                log.info("python tool: network isolation %s (asked for %s)", mode, self.requested_isolation)
                return mode
            failures.append(f"{mode}: {reason}")
        raise ToolUnavailable(
            f"python tool: network isolation {self.requested_isolation!r} failed: {'; '.join(failures)}"
        )

    async def _probe(self, mode: str) -> str | None:
        """None when the prelude sets ``mode`` up in a child, else why not."""
        if mode == "socket-guard":
            return None  # plain Python: it always works
        cfg = json.dumps({"ppid": os.getpid(), "network": mode, "probe": True})
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-I", "-c", _PRELUDE, cfg],
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            cwd="/",
            env={"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return f"the probe did not finish in {PROBE_TIMEOUT_S} s"
        finally:
            _kill_group(proc.pid)
            await proc.wait()
        return None if proc.returncode == 0 else (_text(err).strip() or f"exit code {proc.returncode}")

    async def _run(self, code: str, deadline: float, limit_s: float, mode: str) -> str:
        workdir = await asyncio.to_thread(_make_workdir, code)
        capture = _Capture(self.max_output_bytes)
        proc = None
        try:
            cfg = {
                "ppid": os.getpid(),
                "network": mode,
                "cpu_s": self.cpu_s,
                "memory_bytes": self.memory_mb << 20,
                "file_size_bytes": self.file_size_mb << 20,
            }
            env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
            out_w = capture.pipe("out")
            err_w = capture.pipe("err")
            try:
                proc = await asyncio.create_subprocess_exec(
                    *[sys.executable, "-I", "-c", _PRELUDE, json.dumps(cfg)],
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=err_w,
                    cwd=workdir,
                    env=env,
                    start_new_session=True,
                )
            finally:
                os.close(out_w)  # the child holds its copies; EOF comes when every writer is gone
                os.close(err_w)
            return await self._collect(proc, capture, deadline, limit_s)
        finally:
            try:
                capture.close()
                if proc is not None:
                    _kill_group(proc.pid)  # also on success: a forked child that outlived the program
                    await proc.wait()
            finally:
                await asyncio.shield(asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True))

    async def _collect(
        self, proc: asyncio.subprocess.Process, capture: _Capture, deadline: float, limit_s: float
    ) -> str:
        """Wait for the program's end, its output cap or the deadline; kill its group; the result or ToolError."""
        wall_s = max(deadline - time.monotonic(), 0.0)
        waiter = asyncio.create_task(proc.wait())
        overflow = asyncio.create_task(capture.overflow.wait())
        eof = asyncio.create_task(capture.eof.wait())
        try:
            done, _ = await asyncio.wait([waiter, overflow], timeout=wall_s, return_when=asyncio.FIRST_COMPLETED)
            _kill_group(proc.pid)  # the pipes close once every writer is dead
            await asyncio.wait([eof], timeout=READ_GRACE_S)
        finally:
            overflow.cancel()
            eof.cancel()
            _kill_group(proc.pid)
        returncode = await waiter
        out, err = bytes(capture.kept["out"]), bytes(capture.kept["err"])
        if capture.overflow.is_set():
            raise ToolError(
                f"output exceeded {self.max_output_bytes} bytes: the program was killed, its output cut there:\n"
                + _text(out + err)
            )
        text = _tail(out + err, self.max_output_bytes).rstrip()
        if not done:
            raise ToolError(f"timed out after {limit_s:.1f} s" + (f"; its output so far:\n{text}" if text else ""))
        if returncode == 0:
            return _text(out)
        how = describe_exit(returncode, cpu_s=self.cpu_s, file_size_mb=self.file_size_mb)
        raise ToolError(f"{how}\n{text}" if text else how)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale_workdirs(base: str | None = None) -> list[str]:
    """Remove the working directories (under ``base``, the temp dir by default) of tool processes that died without
    cleaning up (a SIGKILL); a directory whose owner pid is alive is left alone. Returns what it removed."""
    base = base or tempfile.gettempdir()
    removed = []
    for entry in os.scandir(base):
        pid_text = entry.name[len(WORKDIR_PREFIX) :].split("-", 1)[0]
        if (
            not entry.name.startswith(WORKDIR_PREFIX)
            or not pid_text.isdigit()
            or not entry.is_dir(follow_symlinks=False)
        ):
            continue
        if entry.stat(follow_symlinks=False).st_uid == os.getuid() and not _pid_alive(int(pid_text)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _make_workdir(code: str) -> str:
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
        f.write(code)
    return workdir
