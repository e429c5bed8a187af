"""The step loop's engine metrics are real: while requests run on a live CPU engine, the scraper
(``asyncrl.trainer.engine_scraper.EngineScraper``, the one that feeds ``sglang_num_running_reqs`` into
metrics.jsonl) reports them. Before issue 13 it looked up ``sglang:``-prefixed names that the
Prometheus reader strips, so every figure was 0."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from engine_raw import RawEngine  # tests/integration/engine_raw.py

from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.engine.client import SGLangClient
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.trainer.engine_scraper import EngineScraper

pytestmark = pytest.mark.slow

NUM_REQUESTS = 4


def test_scraper_sees_running_requests_on_a_real_engine(tmp_path):
    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    with running_cpu_engine(model, log_dir=tmp_path / "logs", max_running_requests=NUM_REQUESTS) as sup:
        idle = EngineScraper([sup.url], interval_s=3600).scrape()
        assert idle["sglang_num_running_reqs"] == 0.0 and idle["engine/0/num_running_reqs"] == 0.0
        done = threading.Event()

        async def load() -> None:
            params = {"max_new_tokens": 1800, "temperature": 1.0, "ignore_eos": True}
            async with SGLangClient(sup.url, request_timeout_s=120) as c:
                await asyncio.gather(*(c.generate([1, 2, 3], params, rid=f"r{i}") for i in range(NUM_REQUESTS)))

        def run_load() -> None:
            try:
                asyncio.run(load())
            finally:
                done.set()

        threading.Thread(target=run_load, daemon=True).start()
        scraper = EngineScraper([sup.url], interval_s=0.05, timeout_s=5.0)
        seen = 0.0
        deadline = time.monotonic() + 60
        try:
            while not done.is_set() and time.monotonic() < deadline:
                seen = max(seen, scraper.latest().get("sglang_num_running_reqs", 0.0))
                if seen > 0:
                    break
                time.sleep(0.02)
        finally:
            scraper.close()
            asyncio.run(_abort_all(sup.url))
            done.wait(30)
        assert seen > 0, "no running request seen while requests were generating"
        assert seen <= NUM_REQUESTS


async def _abort_all(url: str) -> None:
    async with SGLangClient(url) as c:
        await RawEngine(c.url).post("/abort_request", {"abort_all": True})
