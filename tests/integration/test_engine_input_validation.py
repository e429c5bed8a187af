"""One request must never kill the CPU engine (issue 15): a real engine process over HTTP.

- a hypothesis fuzz of ``/generate`` bodies: never a 500, never fatal, the engine answers a valid request after;
- one test per defect: ``top_k >= 2**63`` (used to overflow on the engine thread and exit the process), bad
  types/ranges in every field answered 400 naming the field (SGLang's ``{"error": {"message"}}`` for generate,
  its validation shape ``{"object": "error", "message", ...}`` for a control body of the wrong type,
  ``{"success": false, "message"}`` for a control call's refusal), ``temperature: NaN``, ``{"abort_all": "false"}``, an
  unbounded ``n``, a weight update with a bad name or shape (rejected before the collective, nothing written, no
  SIGABRT), and a client that disconnects (its request is aborted, as SGLang does).
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import aiohttp
import pytest
import torch.distributed as dist
from engine_raw import RawEngine  # tests/integration/engine_raw.py
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.cluster.weight_update_group import init_weight_update_group
from asyncrl.cpu_engine.model import iter_safetensors
from asyncrl.cpu_engine.testing import free_port, running_cpu_engine
from asyncrl.engine.client import SGLangClient, parse_prometheus
from asyncrl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

PROMPT = [11, 12, 13, 14, 15]
GREEDY = {"max_new_tokens": 6, "temperature": 0}
CONTEXT = 48  # keeps every fuzzed generation short


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("validation")
    return make_tiny_checkpoint(
        d / "model", arch="qwen2", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=128
    )


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    with running_cpu_engine(
        model_dir,
        log_dir=tmp_path_factory.mktemp("logs"),
        max_running_requests=8,
        extra=["--context-length", str(CONTEXT)],
    ) as sup:
        yield sup


def _post(url: str, path: str, body=None, *, raw: bytes | None = None, timeout_s: float = 30.0):
    async def go():
        async with aiohttp.ClientSession() as s:
            data = raw if raw is not None else json.dumps(body).encode()
            t = aiohttp.ClientTimeout(total=timeout_s)
            async with s.post(url + path, data=data, headers={"Content-Type": "application/json"}, timeout=t) as r:
                text = await r.text()
                return r.status, (json.loads(text) if r.content_type == "application/json" else text)

    return asyncio.run(go())


def _alive_and_answering(engine) -> None:
    assert engine.alive(), f"the engine exited (log: {engine.log_path})"
    status, out = _post(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert status == 200 and len(out["output_ids"]) == 6, out


# ---------------------------------------------------------------- /generate
def test_top_k_beyond_int64_is_served_and_not_fatal(engine):
    for k in (2**63, 2**70, 10**30):
        status, out = _post(
            engine.url,
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {"top_k": k, "max_new_tokens": 4, "temperature": 1.0}},
        )
        assert status == 200 and len(out["output_ids"]) == 4, out
    _alive_and_answering(engine)


BAD_GENERATE = [
    ({"sampling_params": {"temperature": math.nan}}, "temperature"),
    ({"sampling_params": {"temperature": math.inf}}, "temperature"),
    ({"sampling_params": {"top_p": math.nan}}, "top_p"),
    ({"sampling_params": {"min_p": -math.inf}}, "min_p"),
    ({"sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ({"sampling_params": {"max_new_tokens": math.inf}}, "max_new_tokens"),
    ({"sampling_params": {"top_k": 1.5}}, "top_k"),
    ({"sampling_params": {"n": math.inf}}, "n"),
    ({"sampling_params": {"n": 65}}, "n"),
    ({"sampling_params": {"min_new_tokens": -1}}, "min_new_tokens"),
    ({"sampling_params": {"sampling_seed": 2**70}}, "sampling_seed"),
    ({"sampling_params": {"stop_token_ids": [math.inf]}}, "stop_token_ids"),
    ({"sampling_params": {"stop": 5}}, "stop"),
    ({"sampling_params": {"stop": [None]}}, "stop"),
    ({"sampling_params": {"ignore_eos": "false"}}, "ignore_eos"),
    ({"sampling_params": {"frequency_penalty": [1]}}, "frequency_penalty"),
    ({"sampling_params": {"logit_bias": {"a": 1}}}, "logit_bias"),
    ({"sampling_params": []}, "sampling_params"),
    ({"input_ids": [[1, 2], 3]}, "input_ids[1]"),
    ({"input_ids": [1.0, 2]}, "input_ids"),
    ({"input_ids": [True, 2]}, "input_ids"),
    ({"input_ids": None, "text": 5}, "text"),
    ({"input_ids": None, "text": [5]}, "text"),
    ({"rid": ["a"]}, "rid"),
    ({"rid": 7}, "rid"),
    ({"logprob_start_len": "x"}, "logprob_start_len"),
    ({"logprob_start_len": math.inf}, "logprob_start_len"),
    ({"return_logprob": "yes"}, "return_logprob"),
    ({"stream": "false"}, "stream"),
]


def _dumps(body) -> bytes:
    """JSON as a careless client writes it: Python's NaN/Infinity literals, inf spelled as the number 1e400."""
    return json.dumps(body).replace("-Infinity", "-1e400").replace("Infinity", "1e400").encode()


@pytest.mark.parametrize("patch,field", BAD_GENERATE, ids=[f for _, f in BAD_GENERATE])
def test_bad_generate_field_is_400_naming_it(engine, patch, field):
    body = {"input_ids": PROMPT, "sampling_params": GREEDY}
    body.update(patch)
    if body.get("input_ids") is None:
        body.pop("input_ids")
    status, out = _post(engine.url, "/generate", raw=_dumps(body))
    assert status == 400, out
    assert field in out["error"]["message"], out


def test_undecodable_body_is_400(engine):
    for raw in (b"\xff\xfe", b"[" * 100_000, b"{", b"[]"):
        status, out = _post(engine.url, "/generate", raw=raw)
        assert status == 400, out
    _alive_and_answering(engine)


BAD_CONTROL = [
    ("/abort_request", {"abort_all": "false"}, "abort_all"),
    ("/abort_request", {"rid": 5}, "rid"),
    (
        "/init_weights_update_group",
        {"master_address": "x", "master_port": math.inf, "rank_offset": 1, "world_size": 2, "backend": "gloo"},
        "master_port",
    ),
    (
        "/init_weights_update_group",
        {"master_address": "x", "master_port": 5, "rank_offset": 3, "world_size": 2, "backend": "gloo"},
        "rank_offset",
    ),
    ("/update_weights_from_distributed", {"group_name": 7}, "group_name"),
    ("/update_weight_version", {"new_version": [1]}, "new_version"),
    ("/update_weight_version", {"new_version": "2", "abort_all_requests": "false"}, "abort_all_requests"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent", "flush_cache": "x"}, "flush_cache"),
    ("/destroy_weights_update_group", {"group_name": ["x"]}, "group_name"),
    ("/pause_generation", {"mode": ["x"]}, "mode"),
]


@pytest.mark.parametrize("path,body,field", BAD_CONTROL, ids=[f"{p[1:]}-{f}" for p, _, f in BAD_CONTROL])
def test_bad_control_field_is_400_naming_it(engine, path, body, field):
    status, out = _post(engine.url, path, raw=_dumps(body))
    assert status == 400, out
    message = out["error"]["message"] if "error" in out else out["message"]
    assert field in message and out.get("success", False) is False, out


def test_weight_update_outside_begin_end_is_refused_in_order(engine):
    """SGLang 0.5.23's session rules, kept in the scheduler process: an update or an end outside a session is a 400
    saying so, a second begin while one is open is refused (a retried sync must end the first), and inside a session
    an update reaches the receive, which names the group it lacks. A body SGLang's struct refuses is its validation
    error first, in a session or not (``test_engine_protocol``)."""
    status, out = _post(engine.url, "/update_weights_from_distributed", {"names": ["x"], "dtypes": [], "shapes": []})
    assert status == 400 and "must run between begin_weight_update() and end_weight_update()" in out["message"], out
    status, out = _post(engine.url, "/end_weight_update", {})
    assert status == 400 and "no weight-update session is open" in out["message"], out
    assert _post(engine.url, "/begin_weight_update", {"selector": "some"})[0] == 400
    try:
        assert _post(engine.url, "/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
        status, out = _post(engine.url, "/begin_weight_update", {"selector": "all"})
        assert status == 400 and "a weight-update session is already open" in out["message"], out
        meta = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
        status, out = _post(engine.url, "/update_weights_from_distributed", {**meta, "group_name": "nope"})
        assert status == 400 and out["message"].startswith("Failed to receive weights: Group nope not in ["), out
        assert out["message"].endswith("]. Please call `init_weights_update_group` first."), out
    finally:
        assert _post(engine.url, "/end_weight_update", {})[0] == 200
    assert _post(engine.url, "/begin_weight_update", {})[0] == 200, "a begin after the end opens a new session"
    assert _post(engine.url, "/end_weight_update", {})[0] == 200


def test_a_failed_group_init_answers_sglangs_text(engine):
    """A join that fails (here at once: the name of the engine's own one-process world, which torch refuses to
    reuse) answers SGLang's "Failed to initialize custom process group: {e}." (its trailing period included)."""
    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    status, out = _post(engine.url, "/init_weights_update_group", {**body, "group_name": "0"})
    assert status == 400 and out["success"] is False, out
    assert out["message"].startswith("Failed to initialize custom process group: ") and out["message"][-2:] != "..", out
    assert out["message"].endswith("before joining again."), out


def test_abort_all_string_false_aborts_nothing(engine):
    async def go():
        async with aiohttp.ClientSession() as s:
            long = asyncio.create_task(
                s.post(
                    engine.url + "/generate",
                    json={
                        "input_ids": PROMPT,
                        "rid": "keep-me",
                        "sampling_params": {
                            "max_new_tokens": CONTEXT - len(PROMPT) - 1,
                            "temperature": 1.0,
                            "ignore_eos": True,
                        },
                    },
                )
            )
            async with s.post(engine.url + "/abort_request", json={"abort_all": "false"}) as r:
                assert r.status == 400
            async with await long as r:
                out = await r.json()
            assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]

    asyncio.run(go())


def test_n_is_bounded_and_served(engine):
    status, out = _post(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": {**GREEDY, "n": 3}})
    assert status == 200 and len(out) == 3
    status, out = _post(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": {**GREEDY, "n": 10**9}})
    assert status == 400 and "n" in out["error"]["message"]


# ---------------------------------------------------------------- a client that goes away
def _metric(url: str, name: str) -> float:
    async def go():
        async with SGLangClient(url, request_timeout_s=30) as c:
            return await RawEngine(c.url).metrics()

    return asyncio.run(go())[name]


def _series(url: str) -> dict[str, float]:
    """Every ``sglang:*`` series of ``/metrics`` as the scraper reads them."""

    async def go():
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
            return parse_prometheus(await r.text())

    return asyncio.run(go())


def test_disconnected_client_request_is_aborted(engine):
    """While the engine is paused a request waits at the pause gate (as on SGLang, in the HTTP process); its client
    times out and closes the connection. Once generation continues the engine aborts it at once instead of
    generating for nobody, and counts it on ``/metrics`` (``sglang:num_disconnect_aborted_requests_total``, and in
    ``num_aborted_requests_total`` as SGLang does)."""
    before = _series(engine.url)
    assert _post(engine.url, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        with pytest.raises(asyncio.TimeoutError):
            _post(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}, timeout_s=1.0)
        assert _metric(engine.url, "num_queue_reqs") == 0, "a request sent while paused is held before the queue"
    finally:
        assert _post(engine.url, "/continue_generation", {})[0] == 200
    deadline = time.monotonic() + 30
    while (
        _series(engine.url)["num_disconnect_aborted_requests_total"] == before["num_disconnect_aborted_requests_total"]
    ):
        assert time.monotonic() < deadline, "the abandoned request was not aborted after the continue"
        time.sleep(0.05)
    after = _series(engine.url)
    assert after["num_disconnect_aborted_requests_total"] == before["num_disconnect_aborted_requests_total"] + 1
    assert after["num_aborted_requests_total"] == before["num_aborted_requests_total"] + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 64, "it generated for nobody"
    _alive_and_answering(engine)


# ---------------------------------------------------------------- weight updates: validated, then atomic
def test_bad_weight_update_is_rejected_before_the_collective_and_writes_nothing(engine, model_dir):
    """A bucket whose second tensor's shape disagrees with the model, and other malformed metadata: each is a 400
    before any broadcast (before: the first tensor was already written, and a size mismatch inside gloo aborted
    the engine). A correct update still goes through the same group afterwards. (A name the model lacks is not a
    400: SGLang receives it and drops it with a warning; ``test_sync_cpu_engines`` covers it.)"""
    weights = dict(iter_safetensors(model_dir))
    names = sorted(weights)[:2]
    new = {n: weights[n] + 1.0 for n in names}

    async def go():
        async with SGLangClient(engine.url, request_timeout_s=60, control_timeout_s=60) as c:
            before = (await c.generate(PROMPT, GREEDY, return_logprob=True)).output_logprobs
            port = free_port()
            join = asyncio.create_task(
                RawEngine(c.url).post(
                    "/init_weights_update_group",
                    {
                        "master_address": "127.0.0.1",
                        "master_port": port,
                        "rank_offset": 1,
                        "world_size": 2,
                        "group_name": "val",
                        "backend": "gloo",
                    },
                    timeout_s=60,
                )
            )
            pg = await asyncio.to_thread(
                init_weight_update_group, "127.0.0.1", port, rank=0, world_size=2, group_name="val", timeout_s=60
            )
            assert (await join)["success"] is True
            await RawEngine(c.url).post("/begin_weight_update")
            good = {
                "names": names,
                "dtypes": ["float32"] * 2,
                "shapes": [list(new[n].shape) for n in names],
                "group_name": "val",
            }
            bad = [
                ({"shapes": [good["shapes"][0], [3, 3]]}, "shape"),
                ({"names": [1, 2]}, "names"),
                ({"names": [names[0], names[0]]}, "names"),
                ({"dtypes": ["float32", 5]}, "dtypes"),
                ({"dtypes": ["float32", "int64"]}, "dtypes"),
                ({"shapes": [good["shapes"][0], [math.inf]]}, "shapes"),
                ({"flush_cache": "no"}, "flush_cache"),
                ({"abort_all_requests": "false"}, "abort_all_requests"),
                ({"weight_version": [1]}, "weight_version"),
            ]
            for patch, what in bad:
                status, out = await asyncio.to_thread(
                    _post, engine.url, "/update_weights_from_distributed", raw=_dumps({**good, **patch}), timeout_s=10
                )
                assert status == 400 and what in out["message"], (patch, out)
            after = (await c.generate(PROMPT, GREEDY, return_logprob=True)).output_logprobs
            assert after == before  # nothing was written
            call = asyncio.create_task(
                RawEngine(c.url).post(
                    "/update_weights_from_distributed",
                    {
                        "names": names,
                        "dtypes": ["float32"] * 2,
                        "shapes": [list(new[n].shape) for n in names],
                        "group_name": "val",
                    },
                )
            )
            await asyncio.to_thread(lambda: [dist.broadcast(new[n].contiguous(), group_src=0, group=pg) for n in names])
            assert (await call)["success"] is True
            await RawEngine(c.url).post("/end_weight_update")
            changed = (await c.generate(PROMPT, GREEDY, return_logprob=True)).output_logprobs
            assert changed != before
            await RawEngine(c.url).post("/destroy_weights_update_group", {"group_name": "val"})
        dist.destroy_process_group(pg)

    asyncio.run(go())
    assert engine.alive()


# ---------------------------------------------------------------- the fuzz (last: it may leave odd state behind)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.sampled_from([2**63, 2**64, -(2**63), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
SP_KEYS = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "min_new_tokens",
    "sampling_seed",
    "frequency_penalty",
    "logit_bias",
    "json_schema",
    "stream_interval",
    "bogus",
]
sampling = st.dictionaries(st.sampled_from(SP_KEYS), json_values, max_size=5)
ids = st.lists(st.integers(0, 40), min_size=0, max_size=6)
generate_body = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": st.one_of(ids, st.lists(ids, max_size=3), json_values),
        "text": st.one_of(st.text(max_size=12), json_values),
        "sampling_params": st.one_of(sampling, st.lists(sampling, max_size=3), json_values),
        "rid": json_values,
        "return_logprob": json_values,
        "logprob_start_len": json_values,
        "stream": json_values,
        "extra_key": json_values,
    },
)


def test_fuzz_generate_never_500_never_fatal(engine):
    statuses: dict[int, int] = {}

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(body=generate_body)
    def one(body):
        if isinstance(body.get("sampling_params"), dict):  # keep the valid ones short
            body["sampling_params"].setdefault("max_new_tokens", 4)
        status, out = _post(engine.url, "/generate", raw=_dumps(body))
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400), (status, body, out)
        if status == 400:
            assert isinstance(out["error"]["message"], str)

    one()
    assert statuses.get(400, 0) > 50 and statuses.get(200, 0) > 0, statuses
    _alive_and_answering(engine)
