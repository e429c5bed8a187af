"""``/update_weights_from_disk`` on a real CPU engine process: after loading a perturbed checkpoint the
engine's greedy outputs and log-probs (prompt and output) equal those of an engine started from it, the
weight version is set; a missing directory or a checkpoint of another shape fails naming the path and
leaves the running weights untouched."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
import torch
from engine_raw import RawEngine  # tests/integration/engine_raw.py
from safetensors.torch import load_file, save_file

from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.engine.client import EngineError, SGLangClient
from asyncrl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

PROMPT = [11, 12, 13, 14, 15]
ARGS = dict(arch="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.5)
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def _perturbed(src, dst, scale=0.3):
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(7)
    for f in dst.glob("*.safetensors"):
        tensors = {
            k: (v + scale * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype)).contiguous()
            for k, v in load_file(str(f)).items()
        }
        save_file(tensors, str(f))
    return dst


async def _probe(c: SGLangClient):
    r = await c.generate(PROMPT, GREEDY, logprob_start_len=0)
    prompt_lps = [x[0] for x in r.meta_info["input_token_logprobs"] if x[0] is not None]
    return r.output_ids, r.output_logprobs, prompt_lps, r.weight_version


def test_load_perturbed_checkpoint_matches_an_engine_started_from_it(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", seed=0, **ARGS)
    b = _perturbed(a, tmp_path / "b")
    other = make_tiny_checkpoint(tmp_path / "other", seed=0, **{**ARGS, "hidden_size": 32, "intermediate_size": 64})

    async def on(url, fn):
        async with SGLangClient(url, request_timeout_s=60, control_timeout_s=60) as c:
            return await fn(c)

    with running_cpu_engine(b, log_dir=tmp_path / "logs_b", weight_version="0") as sup:
        ref = asyncio.run(on(sup.url, _probe))

    async def scenario(c: SGLangClient):
        before = await _probe(c)
        with pytest.raises(EngineError, match="no_such_dir") as e:  # SGLang: its loader finds no weights
            await c.update_weights_from_disk(str(tmp_path / "no_such_dir"), weight_version="9")
        assert e.value.message.startswith("Failed to get weights iterator: ") and e.value.message.endswith(".")
        with pytest.raises(EngineError, match="other") as e:  # SGLang: the load fails, it rolls back
            await c.update_weights_from_disk(str(other), weight_version="9")
        assert "shape" in e.value.message and e.value.message.startswith("Failed to update weights: ")
        assert e.value.message.endswith(".\nRolling back to original weights.")
        untouched = await _probe(c)
        assert (await c.model_info())["model_path"] == str(a)  # failed loads leave it
        # abort_all_requests: aborted before the load waits for the model-update lock, as SGLang's HTTP side does
        # (not left to run to its end while the lock waits for it)
        long = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 1500, "ignore_eos": True}))
        deadline = time.monotonic() + 60
        while (await RawEngine(c.url).metrics())["num_running_reqs"] < 1:
            assert time.monotonic() < deadline and not long.done(), "the long request never ran"
        res = await c.update_weights_from_disk(str(b), weight_version="3", abort_all_requests=True)
        assert (await long).aborted
        after = await _probe(c)
        info = await c.model_info()  # SGLang: a load moves model_path and served_model_name to the new path
        assert info["model_path"] == info["served_model_name"] == str(b) and info["tokenizer_path"] == str(a)
        return before, untouched, res, after, await c.weight_version()

    with running_cpu_engine(a, log_dir=tmp_path / "logs_a", weight_version="0") as sup:
        before, untouched, res, after, version = asyncio.run(on(sup.url, scenario))
    assert untouched == before  # failed loads changed nothing, not even the version
    assert res == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 3.",
        "num_paused_requests": 0,
    }
    assert before[:3] != ref[:3]
    assert after[0] == ref[0]
    assert after[1] == pytest.approx(ref[1], abs=1e-5) and after[2] == pytest.approx(ref[2], abs=1e-5)
    assert after[3] == "3" and version == "3"
