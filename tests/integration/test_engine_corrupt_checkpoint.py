"""``/update_weights_from_disk`` of a corrupt ``model.safetensors`` on a real CPU engine process: a truncated
copy and a garbage file each answer 400 with SGLang's ``{"success": false, "message": ...}`` naming the file
(before: ``safetensors.SafetensorError`` escaped, 500 "Server got itself in trouble"), the running weights and
version are untouched, and a good checkpoint still loads after them."""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import pytest

from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

ARGS = dict(arch="llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
PROMPT = [11, 12, 13, 14, 15]


async def _post(url: str, path: str, body: dict) -> tuple[int, dict | str]:
    """-> (status, the JSON body, or the text of one that is not JSON)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(url + path, json=body) as r:
            text = await r.text()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def _corrupt(src, dst, how: str):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    data = f.read_bytes()
    if how == "truncated":
        f.write_bytes(data[: len(data) // 2])  # the header promises more bytes than the file holds
    else:
        f.write_bytes(b"\x07garbage, not a safetensors header" * 64)
    return f


def test_a_corrupt_safetensors_file_is_a_400_naming_it(tmp_path):
    good = make_tiny_checkpoint(tmp_path / "good", seed=0, **ARGS)
    files = {how: _corrupt(good, tmp_path / how, how) for how in ("truncated", "garbage")}

    async def scenario(url: str):
        gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        before = await _post(url, "/generate", gen)
        answers = {
            how: await _post(url, "/update_weights_from_disk", {"model_path": str(f.parent), "weight_version": "9"})
            for how, f in files.items()
        }
        untouched = await _post(url, "/generate", gen)
        ok = await _post(url, "/update_weights_from_disk", {"model_path": str(good), "weight_version": "2"})
        return before, answers, untouched, ok

    with running_cpu_engine(good, log_dir=tmp_path / "logs", weight_version="0") as sup:
        before, answers, untouched, ok = asyncio.run(scenario(sup.url))
    for how, (status, body) in answers.items():
        assert status == 400, (how, status, body)
        assert body["success"] is False and str(files[how]) in body["message"], (how, body)
    assert untouched[1]["output_ids"] == before[1]["output_ids"]
    assert untouched[1]["meta_info"]["weight_version"] == "0"
    assert ok[0] == 200 and ok[1]["success"] is True
