"""Blocking JSON-over-HTTP calls to engines for the weight sync, fanned out on threads.

Contract
- Every call has a timeout and every failure raises ``EngineStepError`` naming the engine URL and
  the step (e.g. ``"pause_generation"``) — connection refused, HTTP error status, a timeout, or an
  SGLang-style ``{"success": false, "message": ...}`` answer alike.
- ``fan_out`` runs one call per engine concurrently and returns their answers in engine order; it
  raises on the FIRST failure (it does not wait for the slow ones) and, at its deadline, names every
  engine that has not answered.
- Daemon threads (not asyncio) on purpose: the trainer thread must be free to run the blocking
  ``torch.distributed.broadcast`` while the engines' HTTP calls are open, and a call still blocked
  on a dead engine when the run fails must not keep the process alive at exit.
- ``Exchange``: the same calls with the same failure rules, to several engines from the calling thread
  and no thread at all (requests written at once, answers read as they come, each engine's calls in
  order); the weight sync's steps use it, the trainer queueing its broadcasts between ``start`` and
  ``wait`` (async collectives), so no thread hand-off sits on the sync's critical path.

    fan_out(urls, lambda u: post_json(u, "/flush_cache", {}, timeout_s=60, step="flush_cache"),
            timeout_s=60, step="flush_cache")
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import selectors
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from asyncrl.cluster.auth import auth_headers
from asyncrl.engine.client import EngineError, parse_engine_load
from asyncrl.engine.http1 import BadResponse, Connection, ConnectionClosed, request_bytes


class EngineStepError(EngineError):
    """A blocking step (weight sync, drain, scrape, probe) failed on one (or several) engines; ``urls`` and
    ``step`` say where, ``detail`` what. An ``EngineError`` like the async client's (``url``: the first engine,
    ``endpoint``: the step, ``message``: the detail), so one ``except EngineError`` covers both transports."""

    def __init__(self, urls: str | Sequence[str], step: str, detail: str):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.step = step
        self.detail = detail
        self.url, self.endpoint, self.status, self.message = (self.urls[0] if self.urls else ""), step, None, detail
        """``status``: the HTTP status when the engine answered with an error one (None: no answer)."""
        RuntimeError.__init__(self, f"engine step {step!r} failed on {', '.join(self.urls)}: {detail}")


# Idle keep-alive connections kept per engine: a sync makes 5-7 calls per engine in a row, and a fresh
# TCP connection each (connect + accept on the engine's event loop) was a visible share of the sync's
# fixed cost. A few per engine cover the calls one sync has open at once (end + model_info).
_POOL_MAX_PER_ENGINE = 4
_pool: dict[tuple[str, str, int], list[Connection]] = {}
_pool_lock = threading.Lock()


def _take(key: tuple[str, str, int], timeout_s: float) -> tuple[Connection, bool]:
    """An idle connection to ``key`` (reused=True) or a new one."""
    with _pool_lock:
        idle = _pool.get(key)
        conn = idle.pop() if idle else None
    if conn is not None:
        return conn, True
    return Connection(*key, timeout_s=timeout_s), False


def _give(key: tuple[str, str, int], conn: Connection) -> None:
    with _pool_lock:
        idle = _pool.setdefault(key, [])
        if len(idle) < _POOL_MAX_PER_ENGINE:
            idle.append(conn)
            return
    conn.close()


@dataclass(frozen=True)
class Call:
    """One call of an ``Exchange``: ``GET`` (``body`` None) or ``POST`` JSON; ``check_success``: a
    ``{"success": false}`` answer raises. ``pipelined``: written right behind the chain's previous call, on its
    connection, without waiting for its answer (HTTP/1.1 pipelining: the engine answers in order, so this one runs
    after the previous one did, one round trip sooner; uvicorn, which SGLang serves with, and aiohttp, the CPU
    engine's, queue a connection's pipelined requests and run them one after another). Use it only where running
    after a FAILED previous call is harmless: the request is already on the wire when that answer is read."""

    path: str
    body: Any
    step: str
    method: str = "POST"
    check_success: bool = True
    pipelined: bool = False

    @functools.cached_property
    def data(self) -> bytes | None:
        """The body as sent (encoded once however many engines get it)."""
        return _encode(self.body)


class _Req:
    """Calls to one engine written at once on one kept-alive connection (``send``): one call, or a call and the
    calls pipelined behind it, answered in order; their answers are read one by one (``read``), so one thread can
    have requests to several engines on the wire at once (``Exchange``)."""

    def __init__(self, url: str, calls: Sequence[Call]):
        self.url, self.calls = url, list(calls)
        self.answered = 0
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            c = self.calls[0]
            raise EngineStepError(url, c.step, f"{c.method} {c.path}: not an http(s) URL")
        self.key = (u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80))
        self.base = u.path.rstrip("/")
        self.conn: Connection | None = None
        self.reused = False
        self.resent = False
        """The calls were sent again after a close with no answer (once at most)."""

    @property
    def call(self) -> Call:
        """The call whose answer ``read`` returns next."""
        return self.calls[self.answered]

    @property
    def done(self) -> bool:
        return self.answered == len(self.calls)

    def _fail(self, e: BaseException, timeout_s: float) -> EngineStepError:
        m, p, step = self.call.method, self.call.path, self.call.step
        if isinstance(e, TimeoutError):
            return EngineStepError(self.url, step, f"{m} {p} timed out after {timeout_s:g} s")
        if isinstance(e, (ConnectionClosed, ConnectionResetError, BrokenPipeError)):
            return EngineStepError(self.url, step, f"{m} {p} connection error: {e}")
        return EngineStepError(self.url, step, f"{m} {p} unreachable: {e}")  # refused, no route, malformed

    def _unanswered(self, e: BaseException) -> bool:
        """The engine closed the connection with nothing sent back for this call, on a connection that had served
        before (a reused idle one, or one a pipelined call's predecessor was answered on): the call never ran."""
        return (self.reused or self.answered > 0) and (
            isinstance(e, (ConnectionResetError, BrokenPipeError))
            or (isinstance(e, ConnectionClosed) and not e.got_bytes)
        )

    def _bytes(self, host: str) -> bytes:
        out = []
        for c in self.calls[self.answered :]:
            headers = {**auth_headers(), **({"Content-Type": "application/json"} if c.data is not None else {})}
            out.append(request_bytes(c.method, self.base + c.path, c.data, headers, host=host))
        return b"".join(out)

    def send(self, timeout_s: float, *, fresh: bool = False) -> None:
        """Write every call not answered yet on an idle kept-alive connection (a new one with ``fresh``); a reused
        connection the engine had closed is replaced once."""
        for attempt in (0, 1):
            try:
                if fresh or attempt:
                    self.conn, self.reused = Connection(*self.key, timeout_s=timeout_s), False
                else:
                    self.conn, self.reused = _take(self.key, timeout_s)
                self.conn.send(self._bytes(self.conn.host_header), timeout_s=timeout_s)
                return
            except OSError as e:
                if self.conn is not None:
                    self.conn.close()
                if not (self.reused and self._unanswered(e) and attempt == 0):
                    raise self._fail(e, timeout_s) from e

    def read(self, timeout_s: float) -> bytes:
        """The next call's answer (blocks until it is complete, at most ``timeout_s``); an HTTP error status raises.
        The calls are sent again, once, when the engine closed the connection before answering them. The
        connection goes back to the pool once every call was answered (never with answers still due)."""
        assert self.conn is not None, "send() first"
        while True:
            conn = self.conn
            try:
                resp = conn.read(timeout_s=timeout_s, head_request=self.call.method == "HEAD")
            except (OSError, BadResponse) as e:
                conn.close()
                if self._unanswered(e) and not self.resent:
                    self.resent = True
                    self.send(timeout_s, fresh=True)
                    continue
                raise self._fail(e, timeout_s) from e
            call = self.call
            self.answered += 1
            if self.done and not resp.will_close:
                _give(self.key, conn)
            if self.done or resp.status >= 400:
                if not self.done:
                    conn.close()  # answers still due on it: never reused
                self.conn = None
            elif resp.will_close:  # the engine closed after this answer: the calls behind it go on a new connection
                self.send(timeout_s, fresh=True)
            if resp.status >= 400:
                text = resp.body.decode(errors="replace")[:2000]
                err = EngineStepError(self.url, call.step, f"HTTP {resp.status} from {call.method} {call.path}: {text}")
                err.status = resp.status
                raise err
            return resp.body


def _encode(body: Any) -> bytes | None:
    return None if body is None else json.dumps(body).encode()


def _request(url: str, path: str, *, method: str, body: Any, timeout_s: float, step: str) -> bytes:
    req = _Req(url, [Call(path, body, step, method=method)])
    req.send(timeout_s)
    return req.read(timeout_s)


def _decode(raw: bytes, url: str, path: str, step: str) -> Any:
    """JSON answer, or ``{"text": ...}`` for the plain-text ones (SGLang's ``/flush_cache``)."""
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {"text": raw.decode(errors="replace")}


def _checked(out: Any, url: str, path: str, step: str) -> Any:
    """``out``, unless it is SGLang's ``{"success": false, "message"}`` (raised, naming the engine and step)."""
    if isinstance(out, dict) and out.get("success") is False:
        raise EngineStepError(url, step, f"{path} answered success=false: {out.get('message', '')}")
    return out


def post_json(url: str, path: str, body: Any, *, timeout_s: float, step: str, check_success: bool = True) -> dict:
    """POST ``body`` as JSON; with ``check_success``, a ``{"success": false}`` answer raises."""
    out = _decode(_request(url, path, method="POST", body=body, timeout_s=timeout_s, step=step), url, path, step)
    return _checked(out, url, path, step) if check_success else out


def get_json(url: str, path: str, *, timeout_s: float, step: str) -> Any:
    return _decode(_request(url, path, method="GET", body=None, timeout_s=timeout_s, step=step), url, path, step)


def get_text(url: str, path: str, *, timeout_s: float, step: str) -> str:
    return _request(url, path, method="GET", body=None, timeout_s=timeout_s, step=step).decode(errors="replace")


class Exchange:
    """Calls to several engines made from the calling thread, with no thread per call. Each chain (an engine's
    URL and its calls) runs in order: its next call goes out when the previous one answered, or at once behind it
    when it is ``pipelined`` (on the same connection; answered in order); the chains run side by side (two chains
    may name the same engine: each has its own connection). ``start`` writes every
    chain's first request on a kept-alive connection and returns at once (the caller may then queue its
    broadcasts); ``wait`` reads the answers as their sockets turn readable, sends the next calls, and returns
    every chain's answers, in chain and call order. As ``wait_all``: the first failure raises (it does not wait
    for the slow engines), the deadline (``timeout_s`` from ``start``) names every engine not done, and
    ``poll`` (called every ~50 ms while waiting) may raise to abort. On the trainer's critical path this saves
    the two thread hand-offs per call of a thread fan-out (hand the call to a thread, wake the waiter).

        ex = Exchange([(u, [Call("/pause_generation", {"mode": "retract"}, "pause_generation"),
                            Call("/begin_weight_update", {"selector": "all"}, "begin_weight_update")]) for u in urls],
                      timeout_s=60)
        answers = ex.run()   # [[pause answer, begin answer] for each engine]
    """

    def __init__(self, chains: Sequence[tuple[str, Sequence[Call]]], *, timeout_s: float):
        self.chains = [(u, list(cs)) for u, cs in chains]
        self.timeout_s = timeout_s
        self.answers: list[list[Any]] = [[] for _ in self.chains]
        self._live: dict[int, _Req] = {}
        self._deadline = 0.0

    def _send(self, i: int) -> None:
        """Chain ``i``'s next call, and the calls pipelined behind it, written at once."""
        url, calls = self.chains[i]
        k = len(self.answers[i])
        n = k + 1
        while n < len(calls) and calls[n].pipelined:
            n += 1
        req = _Req(url, calls[k:n])
        req.send(self.timeout_s)
        self._live[i] = req

    def _answer(self, i: int, req: _Req) -> None:
        url, c = self.chains[i][0], req.call
        out = _decode(req.read(self.timeout_s), url, c.path, c.step)
        self.answers[i].append(_checked(out, url, c.path, c.step) if c.check_success else out)

    def start(self) -> Exchange:
        self._deadline = time.monotonic() + self.timeout_s
        for i, (_, calls) in enumerate(self.chains):
            if calls:
                self._send(i)
        return self

    def wait(self, *, poll: Callable[[], Any] | None = None) -> list[list[Any]]:
        with selectors.DefaultSelector() as sel:
            for i, req in self._live.items():
                sel.register(req.conn.sock, selectors.EVENT_READ, i)
            while self._live:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    late = list(dict.fromkeys(r.url for r in self._live.values()))
                    step = next(iter(self._live.values())).call.step
                    raise EngineStepError(late, step, f"no answer within {self.timeout_s:g} s")
                for key, _ in sel.select(timeout=min(left, 0.05) if poll else left):
                    i = key.data
                    sel.unregister(key.fileobj)
                    req = self._live.pop(i)
                    self._answer(i, req)
                    while not req.done and req.conn.buffered:  # a pipelined answer came with the one read
                        self._answer(i, req)
                    if req.done and len(self.answers[i]) < len(self.chains[i][1]):
                        self._send(i)  # the chain's next call(s), on a connection of their own
                    elif not req.done:  # pipelined answers still due on this connection
                        self._live[i] = req
                    if i in self._live:
                        sel.register(self._live[i].conn.sock, selectors.EVENT_READ, i)
                if poll is not None:
                    poll()
        return self.answers

    def run(self) -> list[list[Any]]:
        return self.start().wait()


def spawn(fn: Callable[..., Any], *args: Any, name: str = "sync-http", **kwargs: Any) -> cf.Future:
    """Run ``fn(*args, **kwargs)`` on a fresh daemon thread; result or exception lands in the Future."""
    fut: cf.Future = cf.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter, never swallowed
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def fan_out(urls: Sequence[str], call: Callable[[str], Any], *, timeout_s: float, step: str) -> list[Any]:
    """``call(url)`` for every engine at once; answers in ``urls`` order; first failure raises."""
    futures = {spawn(call, u, name=f"sync-{step}"): u for u in urls}
    return wait_all(futures, timeout_s=timeout_s, step=step)


def wait_all(
    futures: dict[cf.Future, str], *, timeout_s: float, step: str, poll: Callable[[], bool] | None = None
) -> list[Any]:
    """Wait for ``{future: url}``; raise on the first failure or, at the deadline, name the laggards.

    ``poll`` (optional) is called every ~50 ms while waiting; it may raise to abort the wait (the
    caller's own side of the step failed), so one loop watches both sides.
    """
    deadline = time.monotonic() + timeout_s
    pending = set(futures)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            late = [futures[f] for f in futures if f in pending]
            raise EngineStepError(late, step, f"no answer within {timeout_s:g} s")
        done, pending = cf.wait(pending, timeout=min(left, 0.05) if poll else left, return_when=cf.FIRST_EXCEPTION)
        for f in done:
            exc = f.exception()
            if exc is not None:
                if isinstance(exc, EngineStepError):
                    raise exc
                raise EngineStepError(futures[f], step, f"{type(exc).__name__}: {exc}") from exc
        if poll is not None:
            poll()
    return [f.result() for f in futures]


def _find_key(obj: Any, keys: tuple[str, ...]) -> Optional[float]:
    """Sum of numeric values under any of ``keys`` anywhere in a JSON document."""
    found: list[float] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                if k in keys and isinstance(v, (int, float)):
                    found.append(float(v))
                else:
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(obj)
    return sum(found) if found else None


def engine_load(url: str, *, timeout_s: float) -> float:
    """Running + queued requests of one engine: ``/metrics``, else ``/server_info``."""
    try:
        load = parse_engine_load(get_text(url, "/metrics", timeout_s=timeout_s, step="drain"))
    except EngineStepError as e:
        if "HTTP 404" not in e.detail:
            raise
        load = None
    if load is None:
        info = get_json(url, "/server_info", timeout_s=timeout_s, step="drain")
        load = _find_key(info, ("num_running_reqs", "num_queue_reqs", "#running-req", "#queue-req"))
    if load is None:
        raise EngineStepError(
            url,
            "drain",
            "neither /metrics (sglang:num_running_reqs) nor "
            "/server_info reports running requests; start SGLang with --enable-metrics",
        )
    return load
