"""The CPU engine over real HTTP: every endpoint's success and error shapes, stop rules, logprobs,
and the three pause modes with concurrent in-flight requests (driven through the SGLang client)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from engine_raw import RawEngine  # tests/integration/engine_raw.py

from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.engine.client import EngineError, SGLangClient
from asyncrl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("proto")
    model = make_tiny_checkpoint(
        d / "model", arch="qwen2", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=128
    )
    with running_cpu_engine(model, log_dir=d / "logs", max_running_requests=8) as sup:
        yield sup


def run(coro):
    return asyncio.run(coro)


async def _raw(url, method, path, body=None, data=None, content_type="application/json"):
    """-> (status, text); ``data`` (raw bytes) is sent with ``content_type``."""
    headers = {"Content-Type": content_type} if data is not None else None
    async with aiohttp.ClientSession() as s:
        t = aiohttp.ClientTimeout(total=30)
        async with s.request(method, url + path, json=body, data=data, headers=headers, timeout=t) as r:
            return r.status, await r.text()


async def _wait(pred, timeout_s=30.0):
    t0 = time.monotonic()
    while not await pred():
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        await asyncio.sleep(0.02)


def test_generate_shapes_and_errors(engine):
    async def go():
        async with SGLangClient(engine.url, request_timeout_s=60) as c:
            r = await c.generate([5, 6, 7, 8], {"max_new_tokens": 6, "temperature": 0}, rid="g1", logprob_start_len=0)
            assert r.rid == "g1" and len(r.output_ids) == 6 and r.finish_reason == {"type": "length", "length": 6}
            assert len(r.output_logprobs) == 6 and all(lp <= 0 for lp in r.output_logprobs)
            entries = r.meta_info["output_token_logprobs"]
            assert [e[1] for e in entries] == r.output_ids and entries[0][2] is None
            inp = r.meta_info["input_token_logprobs"]
            assert inp[0][0] is None and [e[1] for e in inp] == [5, 6, 7, 8] and all(e[0] < 0 for e in inp[1:])
            assert r.weight_version == "0" and r.weight_versions == [{"version": "0", "start": 0, "end": 6}]
            assert r.prompt_tokens == 4 and r.num_retractions == 0 and r.meta_info["reasoning_tokens"] == 0
            again = await c.generate([5, 6, 7, 8], {"max_new_tokens": 6, "temperature": 0})
            assert again.output_ids == r.output_ids  # greedy is deterministic
            # stop token id: output ids keep it, text drops it
            stop_tok = r.output_ids[2]
            s = await c.generate([5, 6, 7, 8], {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_tok]})
            assert s.output_ids == r.output_ids[:3] and s.finish_reason == {"type": "stop", "matched": stop_tok}
            # stop string: ids untrimmed, text cut before the string
            full = await c.generate([5, 6, 7, 8], {"max_new_tokens": 6, "temperature": 0, "skip_special_tokens": False})
            word = full.text[len(full.text) // 2 :][:2] or full.text
            st = await c.generate(
                [5, 6, 7, 8], {"max_new_tokens": 6, "temperature": 0, "stop": [word], "skip_special_tokens": False}
            )
            assert st.finish_reason == {"type": "stop", "matched": word}
            assert word not in st.text and r.output_ids[: len(st.output_ids)] == st.output_ids
            # sampling with a seed is reproducible
            a = await c.generate([9, 10], {"max_new_tokens": 8, "sampling_seed": 7})
            b = await c.generate([9, 10], {"max_new_tokens": 8, "sampling_seed": 7})
            assert a.output_ids == b.output_ids
            # errors: unknown sampling key, empty ids, invalid JSON, duplicate in-flight rid
            with pytest.raises(EngineError) as ei:
                await c.generate([1, 2], {"max_new_tokens": 2, "nonsense": 1})
            assert ei.value.status == 400 and "nonsense" in ei.value.message and ei.value.endpoint == "/generate"
            status, text = await _raw(engine.url, "POST", "/generate", {"input_ids": []})
            assert status == 400 and "message" in json.loads(text)["error"]
            status, text = await _raw(engine.url, "POST", "/generate", data=b"{not json")
            assert status == 400
            long = asyncio.create_task(c.generate([3, 4], LONG, rid="dup"))
            await _wait(lambda: _in_flight(c))
            with pytest.raises(EngineError) as ei:
                await c.generate([3, 4], {"max_new_tokens": 2}, rid="dup")
            assert ei.value.status == 400 and ei.value.message == "Duplicate request ID detected: dup"
            await RawEngine(c.url).post("/abort_request", {"rid": "dup"})
            res = await long
            assert res.finish_reason == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            assert 0 < len(res.output_ids) < 400
            # batch input
            status, text = await _raw(
                engine.url,
                "POST",
                "/generate",
                {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
            )
            assert status == 200 and [len(x["output_ids"]) for x in json.loads(text)] == [2, 2]

    run(go())


def test_prompt_plus_max_new_tokens_over_the_context_is_rejected_like_sglang(engine):
    """SGLang answers 400 naming the lengths instead of silently returning a shorter output."""

    async def go():
        status, text = await _raw(engine.url, "GET", "/get_server_info")
        ctx = json.loads(text)["context_length"]
        async with SGLangClient(engine.url, request_timeout_s=60) as c:
            with pytest.raises(EngineError) as ei:
                await c.generate([5, 6, 7, 8], {"max_new_tokens": ctx - 4, "temperature": 0})
            msg = ei.value.message
            assert ei.value.status == 400 and f"prompt (4 tokens) + max_new_tokens ({ctx - 4})" in msg
            assert f"context length ({ctx} tokens)" in msg
            with pytest.raises(EngineError) as ei:
                await c.generate(list(range(1, 4)) * ctx, {"max_new_tokens": 1})
            assert ei.value.status == 400 and str(ctx) in ei.value.message
            r = await c.generate([5, 6, 7, 8], {"max_new_tokens": 2, "temperature": 0})  # the engine serves on
            assert len(r.output_ids) == 2

    run(go())


async def _in_flight(c, n=1):
    m = await RawEngine(c.url).metrics()
    return m["num_running_reqs"] >= n


async def _held(c, n):
    return (await RawEngine(c.url).metrics())["num_held_by_pause_requests"] >= n


async def _queued(c, n):
    return (await RawEngine(c.url).metrics())["num_queue_reqs"] >= n


async def _engine_loop_turns(c, turns=5):
    """The engine's metrics after ``turns`` more turns of its scheduling loop: each /metrics is answered by that
    loop between two steps, and an unpaused loop with requests steps again before it answers the next one. So a
    paused engine that still generated would show it here, with no time window to guess."""
    for _ in range(turns):
        m = await RawEngine(c.url).metrics()
    return m


def test_info_metrics_flush_and_prefix_reuse(engine):
    async def go():
        async with SGLangClient(engine.url) as c:
            info = await c.model_info()
            assert info["weight_version"] == "0" and info["model_path"].endswith("model")
            assert info["served_model_name"] == info["model_path"] and info["architectures"] == ["Qwen2ForCausalLM"]
            assert info["load_format"] == "auto" and info["disaggregation_mode"] == "null"
            assert info["reasoning_parser"] is None and info["tool_call_parser"] is None
            si = await RawEngine(c.url).get("/server_info")
            assert si["max_running_requests"] == 8 and si["internal_states"][0]["paused"] is None
            assert not any(k.startswith("num_") for k in si["internal_states"][0]), "SGLang's: no request counts"
            assert (await _raw(engine.url, "GET", "/weight_version"))[0] == 404  # no such route on SGLang
            before = await RawEngine(c.url).metrics()
            prompt = list(range(10, 40))
            first = await c.generate(prompt, {"max_new_tokens": 5, "temperature": 0})
            turn2 = prompt + first.output_ids + [50, 51, 52]
            second = await c.generate(turn2, {"max_new_tokens": 5, "temperature": 0})
            assert second.cached_tokens >= len(prompt)  # multi-turn continuation reuses the prefix KV
            after = await RawEngine(c.url).metrics()
            assert after["generation_tokens_total"] - before["generation_tokens_total"] == 10
            assert after["cache_hit_rate"] > 0
            status, text = await _raw(engine.url, "GET", "/metrics")
            assert "# TYPE sglang:num_running_reqs gauge" in text and "sglang:generation_tokens_total{" in text
            await RawEngine(c.url).post("/flush_cache")
            third = await c.generate(turn2, {"max_new_tokens": 5, "temperature": 0})
            assert third.cached_tokens == 0 and third.output_ids == second.output_ids  # same result without cache
            status, _ = await _raw(engine.url, "GET", "/health")
            assert status == 200
            status, text = await _raw(
                engine.url,
                "POST",
                "/update_weights_from_distributed",
                {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]},
            )
            assert status == 400 and "begin_weight_update" in json.loads(text)["message"]
            with pytest.raises(EngineError, match="begin_weight_update"):
                await RawEngine(c.url).post("/end_weight_update")
            with pytest.raises(EngineError, match=r"\"The group to be destroyed does not exist\.\""):
                await RawEngine(c.url).post("/destroy_weights_update_group", {"group_name": "nope"})
            with pytest.raises(EngineError, match="gloo"):
                await RawEngine(c.url).post(
                    "/init_weights_update_group",
                    {
                        "master_address": "127.0.0.1",
                        "master_port": 1,
                        "rank_offset": 1,
                        "world_size": 2,
                        "backend": "nccl",
                        "group_name": "weight_update_group",
                    },
                )
            status, text = await _raw(engine.url, "POST", "/pause_generation", {"mode": "drain"})
            assert status == 400 and "drain" in json.loads(text)["message"]

    run(go())


VALIDATION_ERROR = {"object": "error", "type": "Bad Request", "param": None, "code": 400}
"""SGLang's answer to a body its request struct refuses (its ``validation_exception_handler``), less the message."""


@pytest.mark.parametrize(
    "path,data,field",
    [
        ("/pause_generation", b"", "body"),  # no body: every struct route requires one, also those of defaults only
        ("/continue_generation", b"", "body"),
        ("/begin_weight_update", b"", "body"),
        ("/end_weight_update", b"", "body"),
        ("/abort_request", b"", "body"),
        ("/generate", b"{not json", "body"),
        ("/generate", b"[1, 2]", "body"),
        ("/pause_generation", b'{"mode": "drain"}', "body.mode"),
        ("/begin_weight_update", b'{"selector": "some"}', "body.selector"),
        ("/init_weights_update_group", b'{"master_address": "127.0.0.1", "master_port": "x"}', "body.master_port"),
        ("/update_weights_from_distributed", b'{"names": ["a"], "dtypes": ["float32"]}', "body.shapes"),
        ("/update_weight_version", b'{"new_version": 5}', "body.new_version"),
        ("/update_weights_from_disk", b"{}", "body.model_path"),
        ("/get_weights_by_name", b'{"truncate_size": 3}', "body.name"),
        ("/abort_request", b'{"rid": 5}', "body.rid"),
        ("/pause_generation", (b'{"mode": "abort"}', "text/plain"), "body"),  # FastAPI parses JSON types only
        ("/generate", (b'{"input_ids": [1]}', "application/x-www-form-urlencoded"), "body"),
    ],
)
def test_a_body_sglang_refuses_is_its_validation_error(engine, path, data, field):
    """SGLang 0.5.23 checks each body against its request struct before the handler runs: no body, bad JSON, not
    an object, not sent as JSON, a required field missing or a field of the wrong type is a 400 of its validation
    handler's shape, the message naming the field. (The session rule does not come first: an update outside a
    session with a bad body is this error too.)"""
    data, content_type = data if isinstance(data, tuple) else (data, "application/json")
    status, text = run(_raw(engine.url, "POST", path, data=data, content_type=content_type))
    out = json.loads(text)
    assert status == 400 and {k: out.get(k) for k in VALIDATION_ERROR} == VALIDATION_ERROR, out
    assert f"{field}:" in out["message"], out


def test_begin_weight_update_takes_every_selector(engine):
    """``target``, ``draft`` and ``all`` each open the session (the CPU engine has no draft model: each is all)."""

    async def go():
        raw = RawEngine(engine.url)
        for selector in ("target", "draft", "all"):
            assert (await raw.post("/begin_weight_update", {"selector": selector}))["message"] == "Success"
            assert (await raw.post("/end_weight_update", {}))["message"] == "Success"

    run(go())


def test_pause_abort_then_requests_wait_for_continue(engine):
    async def go():
        async with SGLangClient(engine.url, request_timeout_s=60) as c:
            tasks = [asyncio.create_task(c.generate([20 + i, 21], LONG)) for i in range(3)]
            await _wait(lambda: _in_flight(c, 3))
            assert (await RawEngine(c.url).post("/pause_generation", {"mode": "abort"}))["status"] == "ok"
            done = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert all(r.aborted and len(r.output_ids) < 400 for r in done)
            before = (await RawEngine(c.url).metrics())["generation_tokens_total"]
            late = asyncio.create_task(c.generate([30, 31], {"max_new_tokens": 4, "temperature": 0}))
            await _wait(lambda: _held(c, 1))  # accepted, and held by the pause before the scheduler, as SGLang ...
            m = await _engine_loop_turns(c)
            assert not late.done()  # ... until the continue; an abort-all does not reach it there (SGLang neither)
            assert m["num_queue_reqs"] == 0 and m["num_running_reqs"] == 0 and m["generation_tokens_total"] == before
            await RawEngine(c.url).post("/abort_request", {"abort_all": True})
            await RawEngine(c.url).post("/continue_generation")
            r = await asyncio.wait_for(late, 30)
            assert r.finish_reason["type"] == "length" and len(r.output_ids) == 4

    run(go())


def test_pause_retract_resumes_under_new_version(engine):
    async def go():
        async with SGLangClient(engine.url, request_timeout_s=60) as c:
            tasks = [asyncio.create_task(c.generate([40 + i, 41], LONG)) for i in range(3)]
            await _wait(lambda: _in_flight(c, 3))
            await RawEngine(c.url).post("/pause_generation", {"mode": "retract"})
            m = await RawEngine(c.url).metrics()
            assert m["num_running_reqs"] == 0 and m["num_queue_reqs"] == 3 and m["num_retracted_reqs"] == 3
            await RawEngine(c.url).post("/flush_cache")  # nothing holds KV after a retract
            await RawEngine(c.url).post("/update_weight_version", {"new_version": "1", "abort_all_requests": False})
            assert not any(t.done() for t in tasks)
            await RawEngine(c.url).post("/continue_generation")
            done = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            for r in done:
                assert r.finish_reason == {"type": "length", "length": 400} and len(r.output_ids) == 400
                assert r.num_retractions == 1 and r.weight_version == "1"
                (a, b) = r.weight_versions
                assert a["version"] == "0" and b["version"] == "1"
                assert a["start"] == 0 and a["end"] == b["start"] and b["end"] == 400 and 0 < a["end"] < 400
            await RawEngine(c.url).post("/update_weight_version", {"new_version": "0", "abort_all_requests": False})

    run(go())


def test_pause_in_place_keeps_kv(engine):
    async def go():
        async with SGLangClient(engine.url, request_timeout_s=60) as c:
            tasks = [asyncio.create_task(c.generate([60 + i, 61], LONG)) for i in range(2)]
            await _wait(lambda: _in_flight(c, 2))
            await RawEngine(c.url).post("/pause_generation", {"mode": "in_place"})
            m1 = await RawEngine(c.url).metrics()
            m2 = await _engine_loop_turns(c)
            assert m1["num_running_reqs"] == 2 and m1["num_paused_reqs"] == 2
            assert m2["generation_tokens_total"] == m1["generation_tokens_total"]  # no stepping while paused
            with pytest.raises(EngineError) as ei:
                await RawEngine(c.url).post("/flush_cache")  # refused: requests hold KV
            assert ei.value.status == 400 and ei.value.message == "Flush cache failed.\n"
            await RawEngine(c.url).post("/continue_generation")
            done = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert all(len(r.output_ids) == 400 and r.num_retractions == 0 for r in done)

    run(go())


def test_update_weight_version_aborts_by_default(engine):
    async def go():
        async with SGLangClient(engine.url, request_timeout_s=60) as c:
            t = asyncio.create_task(c.generate([70, 71], LONG))
            await _wait(lambda: _in_flight(c))
            status, text = await _raw(engine.url, "POST", "/update_weight_version", {"new_version": "5"})
            assert status == 200 and json.loads(text) == {
                "success": True,
                "message": "Weight version updated to 5",
                "new_version": "5",
            }
            r = await asyncio.wait_for(t, 30)
            assert r.aborted
            assert (await c.model_info())["weight_version"] == "5"
            await RawEngine(c.url).post("/update_weight_version", {"new_version": "0", "abort_all_requests": False})

    run(go())


def test_unknown_path_and_wrong_method_answer_as_fastapi(engine):
    """SGLang's FastAPI app: 404 ``{"detail": "Not Found"}``, 405 ``{"detail": "Method Not Allowed"}`` with an
    ``Allow`` header (a GET route does not serve HEAD there); ``/flush_cache`` takes GET and POST only, ``/metrics``
    any method."""

    async def go():
        async with aiohttp.ClientSession() as s:
            t = aiohttp.ClientTimeout(total=30)
            async with s.get(engine.url + "/no_such_route", timeout=t) as r:
                assert (r.status, await r.json()) == (404, {"detail": "Not Found"})
            async with s.get(engine.url + "/pause_generation", timeout=t) as r:
                assert (r.status, await r.json()) == (405, {"detail": "Method Not Allowed"})
                assert r.headers["Allow"] == "POST"
            async with s.put(engine.url + "/flush_cache", timeout=t) as r:
                assert r.status == 405 and set(r.headers["Allow"].split(", ")) == {"GET", "POST"}
            async with s.head(engine.url + "/health", timeout=t) as r:
                assert r.status == 405
            async with s.get(engine.url + "/flush_cache", timeout=t) as r:
                assert r.status == 200
            async with s.post(engine.url + "/metrics", timeout=t) as r:
                assert r.status == 200 and "sglang:num_running_reqs" in await r.text()

    run(go())


def test_abort_request_needs_the_exact_rid_of_a_request_in_flight(engine):
    """As SGLang's HTTP side: an abort by rid is sent to the scheduler only for the exact rid of a request in
    flight, so neither a prefix nor the base rid of ``n > 1`` samples (``L`` for ``L_0``, ``L_1``) aborts anything."""

    async def go():
        async with SGLangClient(engine.url, request_timeout_s=60) as c:
            raw = RawEngine(c.url)
            body = {"input_ids": [3, 4], "rid": "L", "sampling_params": {**LONG, "n": 2}}
            pair = asyncio.create_task(_raw(engine.url, "POST", "/generate", body))
            await _wait(lambda: _in_flight(c, 2))
            for rid in ("L", "L_", "nope"):  # answered before any abort could run: none was sent
                await raw.post("/abort_request", {"rid": rid})
            assert (await raw.metrics())["num_running_reqs"] == 2 and not pair.done()
            await raw.post("/abort_request", {"rid": "L_0"})
            await raw.post("/abort_request", {"rid": "L_1"})
            status, text = await asyncio.wait_for(pair, 30)
            out = json.loads(text)
            assert status == 200 and [o["meta_info"]["finish_reason"]["type"] for o in out] == ["abort", "abort"]
            assert all(len(o["output_ids"]) < 400 for o in out)

    run(go())


def test_flush_cache_with_a_timeout_waits_for_idle(engine):
    """SGLang's ``/flush_cache?timeout=T``: with requests in the engine it waits for none to run or wait, then
    flushes; any flush meanwhile is refused; at T it gives up (a pause ``in_place`` keeps its requests running)."""

    async def flush(query=""):
        return await _raw(engine.url, "POST", "/flush_cache" + query)

    async def another_in_progress():
        return await flush() == (400, "Another flush_cache is already in progress.")

    async def go():
        async with SGLangClient(engine.url, request_timeout_s=60) as c:
            raw = RawEngine(c.url)
            for bad in ("?timeout=-1", "?timeout=x"):
                status, text = await flush(bad)
                assert status == 400 and "query.timeout" in json.loads(text)["message"]
            tasks = [asyncio.create_task(c.generate([80 + i, 81], LONG)) for i in range(2)]
            await _wait(lambda: _in_flight(c, 2))
            waiting = asyncio.create_task(flush("?timeout=60"))
            await _wait(another_in_progress)
            await raw.post("/abort_request", {"abort_all": True})
            status, text = await asyncio.wait_for(waiting, 30)
            assert status == 200 and text.startswith("Cache flushed.")
            assert all(r.aborted for r in await asyncio.gather(*tasks))

            tasks = [asyncio.create_task(c.generate([90 + i, 91], LONG)) for i in range(2)]
            await _wait(lambda: _in_flight(c, 2))
            await raw.post("/pause_generation", {"mode": "in_place"})
            assert await flush("?timeout=0.3") == (400, "Timed out waiting for idle state.")
            await raw.post("/continue_generation", {})
            await raw.post("/abort_request", {"abort_all": True})
            assert all(r.aborted for r in await asyncio.gather(*tasks))
            assert (await flush("?timeout=5"))[0] == 200  # idle: at once

    run(go())
