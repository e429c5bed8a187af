"""A real CPU engine process serves a tiny Qwen3-MoE as SGLang would, and takes updates of its experts.

Started as SGLang is (``python -m asyncrl.cpu_engine.server``): its greedy outputs and prompt log-probs are
transformers' ``Qwen3MoeForCausalLM``'s; after a broadcast of another checkpoint's routers and experts under the HF
names (per tensor and flattened) they are those of the checkpoint with those tensors swapped in, and after
``/update_weights_from_disk`` those of the other checkpoint. ``/get_weights_by_name`` answers as SGLang 0.5.23 does
for ``Qwen3MoeForCausalLM`` (which does not implement it); a name the model lacks is dropped from a broadcast with
a warning (as SGLang's loader) and refuses a disk load. Started with ``--enable-return-routed-experts``, it returns
each token's experts as SGLang does (``meta_info["routed_experts"]``)."""

from __future__ import annotations

import asyncio
import base64
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from engine_raw import RawEngine  # tests/integration/engine_raw.py
from safetensors.torch import load_file, save_file

from asyncrl.cluster.weight_update_group import destroy_weight_update_group, init_weight_update_group
from asyncrl.cpu_engine.model import load_model
from asyncrl.cpu_engine.testing import free_port, running_cpu_engine
from asyncrl.engine.client import EngineError
from asyncrl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

PROMPT = [11, 12, 13, 14, 15, 16, 17]
NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
LOGPROB_ATOL = 1e-4  # fp32 on both sides (tests/unit/test_cpu_engine_moe.py)
ARGS = dict(arch="qwen3_moe", num_hidden_layers=2)


def _is_routing(name: str) -> bool:
    return ".mlp.gate." in name or ".mlp.experts." in name


def _with_experts_of(base, donor, out):
    """``base`` with ``donor``'s routers and experts: what the engine must serve after the broadcast."""
    shutil.copytree(base, out)
    mine, theirs = load_file(str(base / "model.safetensors")), load_file(str(donor / "model.safetensors"))
    save_file({n: theirs[n] if _is_routing(n) else t for n, t in mine.items()}, str(out / "model.safetensors"))
    return out


def _reference(model_dir) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of PROMPT (NEW tokens, EOS ignored) and its prompt log-probs."""
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW):
            logits = m(input_ids=torch.tensor([ids])).logits[0]
            if len(ids) == len(PROMPT):
                lp = torch.log_softmax(logits, dim=-1)
                prompt_lps = lp[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
            ids.append(int(logits[-1].argmax()))
    return ids[len(PROMPT) :], prompt_lps


async def _served(raw: RawEngine) -> tuple[list[int], torch.Tensor]:
    r = await raw.post(
        "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}
    )
    lps = [x[0] for x in r["meta_info"]["input_token_logprobs"] if x[0] is not None]
    return r["output_ids"], torch.tensor(lps)


def _assert_serves(got, want) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=LOGPROB_ATOL, rtol=0)


async def _join(raw: RawEngine, group: str):
    port = free_port()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group,
        "backend": "gloo",
    }
    call = asyncio.create_task(raw.post("/init_weights_update_group", body, timeout_s=60))
    pg = await asyncio.to_thread(
        init_weight_update_group, "127.0.0.1", port, rank=0, world_size=2, group_name=group, timeout_s=60
    )
    assert (await call)["success"] is True
    return pg


async def _push(raw: RawEngine, pg, group: str, named: dict[str, torch.Tensor], load_format) -> None:
    ts = [t.contiguous() for t in named.values()]
    body = {
        "names": list(named),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in ts],
        "shapes": [list(t.shape) for t in ts],
        "group_name": group,
        "load_format": load_format,
    }
    call = asyncio.create_task(raw.post("/update_weights_from_distributed", body))

    def send():
        if load_format == "flattened_bucket":
            dist.broadcast(torch.cat([t.view(-1).view(torch.uint8) for t in ts]), group_src=0, group=pg)
        else:
            for t in ts:
                dist.broadcast(t, group_src=0, group=pg)

    await asyncio.to_thread(send)
    assert (await call)["success"] is True


def test_serves_the_moe_and_takes_updates_of_its_experts(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", seed=0, **ARGS)
    b = make_tiny_checkpoint(tmp_path / "b", seed=1, **ARGS)
    mixed = _with_experts_of(a, b, tmp_path / "a_with_b_experts")
    ref = {"a": _reference(a), "b": _reference(b), "mixed": _reference(mixed)}
    assert ref["a"][0] != ref["mixed"][0] != ref["b"][0]  # the experts alone change the greedy output
    routing = {n: t for n, t in sorted(load_file(str(b / "model.safetensors")).items()) if _is_routing(n)}
    assert len(routing) == 2 * (1 + 3 * 8)
    names = list(routing)
    unknown = "model.layers.0.mlp.experts.8.up_proj.weight"  # the model has experts 0..7

    async def go(url):
        raw = RawEngine(url)
        _assert_serves(await _served(raw), ref["a"])
        with pytest.raises(EngineError, match="Get parameter by name failed") as e:
            await raw.post("/get_weights_by_name", {"name": names[0], "truncate_size": 2})
        assert e.value.status == 400
        pg = await _join(raw, "wsync")
        await raw.post("/begin_weight_update")
        first = {n: routing[n] for n in names[: len(names) // 2]} | {unknown: torch.ones(64, 128)}
        await _push(raw, pg, "wsync", first, None)
        await _push(raw, pg, "wsync", {n: routing[n] for n in names[len(names) // 2 :]}, "flattened_bucket")
        await raw.post("/end_weight_update")
        _assert_serves(await _served(raw), ref["mixed"])
        await raw.post("/destroy_weights_update_group", {"group_name": "wsync"})
        destroy_weight_update_group(pg)

        await raw.post("/update_weights_from_disk", {"model_path": str(b)})
        _assert_serves(await _served(raw), ref["b"])
        extra = shutil.copytree(b, tmp_path / "b_extra")
        tensors = load_file(str(extra / "model.safetensors"))
        save_file({**tensors, unknown: torch.ones(64, 128)}, str(extra / "model.safetensors"))
        with pytest.raises(EngineError, match=f"unknown parameter '{unknown}'"):
            await raw.post("/update_weights_from_disk", {"model_path": str(extra)})
        _assert_serves(await _served(raw), ref["b"])

    with running_cpu_engine(a, log_dir=tmp_path / "logs", max_running_requests=4) as sup:
        asyncio.run(go(sup.url))
    log = (tmp_path / "logs").glob("*.log")
    assert any(f"Parameter {unknown} not found in params_dict" in p.read_text() for p in log)


def _routing(meta: dict, spec) -> torch.Tensor:
    """``meta_info["routed_experts"]`` decoded as SGLang's ``extract_routed_experts_from_meta_info`` does."""
    raw = base64.b64decode(meta["routed_experts"])
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(-1, spec.num_layers, spec.num_experts_per_tok)


def _reference_routing(model_dir, ids: list[int], k: int) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
    return torch.stack([lg.topk(k, dim=-1).indices for lg in logits], dim=1).to(torch.int32)


def test_routed_experts_are_returned_as_sglang_returns_them(tmp_path):
    """``--enable-return-routed-experts``: ``return_routed_experts`` answers ``meta_info["routed_experts"]``, base64
    of int32 [prompt + output - 1 - routed_experts_start_len, layers, top-k] (every token the model ran), the
    experts transformers routes each to; also for a prompt served from the prefix cache and for a batch. A start
    outside [0, prompt] is SGLang's 400; without the flag (or without asking) there is no such key."""
    path = make_tiny_checkpoint(tmp_path / "m", seed=2, **ARGS)
    spec = load_model(path).spec
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True}

    async def go(url):
        raw = RawEngine(url)
        r = await raw.post("/generate", body)
        seq = PROMPT + r["output_ids"]
        want = _reference_routing(path, seq[:-1], spec.num_experts_per_tok)
        assert torch.equal(_routing(r["meta_info"], spec), want)
        again = await raw.post("/generate", {**body, "routed_experts_start_len": 3})  # its prompt from the cache
        assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == r["output_ids"]
        assert torch.equal(_routing(again["meta_info"], spec), want[3:])
        batch = await raw.post("/generate", {**body, "input_ids": [PROMPT, PROMPT[:4]]})
        assert torch.equal(_routing(batch[0]["meta_info"], spec), want)
        assert (
            "routed_experts" not in (await raw.post("/generate", {**body, "return_routed_experts": False}))["meta_info"]
        )
        for start, text in (
            (-1, "recv_req.routed_experts_start_len=-1 is lower than 0. "),
            (
                8,
                "recv_req.routed_experts_start_len=8 is higher than the number of input tokens "
                "len(req.origin_input_ids)=7. Please use a smaller routed_experts_start_len.",
            ),
        ):
            with pytest.raises(EngineError, match=re.escape(text)) as e:
                await raw.post("/generate", {**body, "routed_experts_start_len": start})
            assert e.value.status == 400

    with running_cpu_engine(path, log_dir=tmp_path / "logs", extra=["--enable-return-routed-experts"]) as sup:
        asyncio.run(go(sup.url))

    async def without_flag(url):
        r = await RawEngine(url).post("/generate", body)
        assert "routed_experts" not in r["meta_info"] and r["meta_info"]["completion_tokens"] == NEW

    with running_cpu_engine(path, log_dir=tmp_path / "logs_off") as sup:
        asyncio.run(without_flag(sup.url))
