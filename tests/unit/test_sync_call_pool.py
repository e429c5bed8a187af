"""The weight sync's pool of kept threads for its blocking HTTP calls (no engine: plain callables)."""

from __future__ import annotations

import threading

import pytest

from asyncrl.engine.blocking import EngineStepError
from asyncrl.sync.call_pool import CallPool

WAIT_S = 10.0  # a generous bound for a wait that should end at once; never reached when the pool works


def test_a_blocked_call_does_not_delay_a_later_one():
    pool = CallPool()
    release = threading.Event()
    stuck = pool.submit(release.wait, WAIT_S)  # a call hung on a dead engine, until its own timeout
    try:
        assert pool.submit(lambda: "ok").result(timeout=WAIT_S) == "ok"
        assert not stuck.done()
    finally:
        release.set()
    assert stuck.result(timeout=WAIT_S) is True


def test_threads_are_kept_between_calls():
    pool = CallPool()
    names = {pool.submit(lambda: threading.current_thread().ident).result(timeout=WAIT_S) for _ in range(20)}
    assert len(names) == 1  # one after the other: the same kept thread every time
    together = threading.Barrier(3, timeout=WAIT_S)  # passes only if both calls run at once
    futs = [pool.submit(together.wait) for _ in range(2)]
    together_index = together.wait()
    got = [f.result(timeout=WAIT_S) for f in futs]
    assert len(set(got) | {together_index}) == 3  # three distinct parties: the two calls ran on two threads
    assert all(t.daemon for t in threading.enumerate() if t.name == "sync-call")


def test_fan_out_keeps_engine_order_and_names_the_failing_engine():
    pool = CallPool()
    assert pool.fan_out(["a", "b", "c"], str.upper, timeout_s=WAIT_S, step="s") == ["A", "B", "C"]

    def call(url: str) -> str:
        if url == "b":
            raise EngineStepError(url, "pause_generation", "HTTP 500")
        return url

    with pytest.raises(EngineStepError) as ei:
        pool.fan_out(["a", "b"], call, timeout_s=WAIT_S, step="pause_generation")
    assert ei.value.urls == ["b"] and ei.value.step == "pause_generation"


def test_fan_out_names_the_engine_that_did_not_answer():
    pool = CallPool()
    release = threading.Event()
    try:
        with pytest.raises(EngineStepError, match="no answer within") as ei:
            pool.fan_out(  # 2 s: "a" answers within it on a loaded host too
                ["a", "b"], lambda u: u == "b" and release.wait(WAIT_S), timeout_s=2.0, step="flush_cache"
            )
        assert ei.value.urls == ["b"]
    finally:
        release.set()


def test_an_idle_thread_ends_and_the_pool_still_works():
    pool = CallPool(idle_exit_s=0.05)
    first = pool.submit(threading.current_thread).result(timeout=WAIT_S)
    first.join(timeout=WAIT_S)  # ends once idle for idle_exit_s
    assert not first.is_alive()
    again = pool.submit(threading.current_thread).result(timeout=WAIT_S)
    assert again is not first and pool.submit(lambda: 7).result(timeout=WAIT_S) == 7
