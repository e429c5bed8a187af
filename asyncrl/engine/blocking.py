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

    fan_out(urls, lambda u: post_json(u, "/flush_cache", {}, timeout_s=60, step="flush_cache"),
            timeout_s=60, step="flush_cache")
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.cluster.auth import auth_headers
from asyncrl.engine.client import EngineError


class EngineStepError(EngineError):
    """A blocking step (weight sync, drain, scrape, probe) failed on one (or several) engines; ``urls`` and
    ``step`` say where, ``detail`` what. An ``EngineError`` like the async client's (``url``: the first engine,
    ``endpoint``: the step, ``message``: the detail), so one ``except EngineError`` covers both transports."""

    def __init__(self, urls: str | Sequence[str], step: str, detail: str):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.step = step
        self.detail = detail
        self.url, self.endpoint, self.status, self.message = (self.urls[0] if self.urls else ""), step, None, detail
        RuntimeError.__init__(self, f"weight sync step {step!r} failed on engine {', '.join(self.urls)}: {detail}")


# Idle keep-alive connections kept per engine: a sync makes 5-7 calls per engine in a row, and a fresh
# TCP connection each (connect + accept on the engine's event loop) was a visible share of the sync's
# fixed cost. A few per engine cover the calls one sync has open at once (end + model_info).
_POOL_MAX_PER_ENGINE = 4
_pool: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
_pool_lock = threading.Lock()


def _take(key: tuple[str, str, int], timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
    """An idle connection to ``key`` (reused=True) or a new one."""
    with _pool_lock:
        idle = _pool.get(key)
        conn = idle.pop() if idle else None
    if conn is not None:
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn, True
    scheme, host, port = key
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    return cls(host, port, timeout=timeout_s), False


def _give(key: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
    with _pool_lock:
        idle = _pool.setdefault(key, [])
        if len(idle) < _POOL_MAX_PER_ENGINE:
            idle.append(conn)
            return
    conn.close()


def _request(url: str, path: str, *, method: str, body: Any, timeout_s: float, step: str) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    headers = {**auth_headers(), **({"Content-Type": "application/json"} if data is not None else {})}
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise EngineStepError(url, step, f"{method} {path}: not an http(s) URL")
    key = (u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80))
    target = u.path.rstrip("/") + path
    for attempt in (0, 1):
        conn, reused = _take(key, timeout_s)
        try:
            conn.request(method, target, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
            conn.close()
            if reused and attempt == 0:
                continue  # the engine closed an idle keep-alive connection: the request never reached it
            raise EngineStepError(url, step, f"{method} {path} connection error: {e}") from e
        except TimeoutError as e:
            conn.close()
            raise EngineStepError(url, step, f"{method} {path} timed out after {timeout_s:g} s") from e
        except (OSError, http.client.HTTPException) as e:  # refused, no route, a malformed answer
            conn.close()
            raise EngineStepError(url, step, f"{method} {path} unreachable: {e}") from e
        if resp.will_close:
            conn.close()
        else:
            _give(key, conn)
        if resp.status >= 400:
            text = raw.decode(errors="replace")[:2000]
            raise EngineStepError(url, step, f"HTTP {resp.status} from {method} {path}: {text}")
        return raw
    raise AssertionError("unreachable: the loop returns or raises")


def _decode(raw: bytes, url: str, path: str, step: str) -> Any:
    """JSON answer, or ``{"text": ...}`` for the plain-text ones (SGLang's ``/flush_cache``)."""
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {"text": raw.decode(errors="replace")}


def post_json(url: str, path: str, body: Any, *, timeout_s: float, step: str, check_success: bool = True) -> dict:
    """POST ``body`` as JSON; with ``check_success``, a ``{"success": false}`` answer raises."""
    out = _decode(_request(url, path, method="POST", body=body, timeout_s=timeout_s, step=step), url, path, step)
    if check_success and isinstance(out, dict) and out.get("success") is False:
        raise EngineStepError(url, step, f"{path} answered success=false: {out.get('message', '')}")
    return out


def get_json(url: str, path: str, *, timeout_s: float, step: str) -> Any:
    return _decode(_request(url, path, method="GET", body=None, timeout_s=timeout_s, step=step), url, path, step)


def get_text(url: str, path: str, *, timeout_s: float, step: str) -> str:
    return _request(url, path, method="GET", body=None, timeout_s=timeout_s, step=step).decode(errors="replace")


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
