"""Shared parts of the weight-sync recovery tests: a plain-PyTorch trainer with what ``sync_weights`` reads, one that
loses an engine in the middle of a sync (SIGKILL), the rollout rank's watcher, and the served-weights check.

Real parts: the tests drive real CPU engine processes through these; nothing here stands in for one."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from asyncrl.engine.blocking import get_json, post_json
from asyncrl.engine.liveness import HealthTracker
from asyncrl.models.torch_decoder import TorchDecoder
from asyncrl.sync.bucketing import iter_buckets

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


class Trainer:
    """What ``sync_weights`` needs of the actor: a version and the HF buckets."""

    def __init__(self, model: TorchDecoder, version: int):
        self.model, self.version = model, version

    def iter_hf_buckets(self, bucket_bytes: int):
        return iter_buckets(self.model.state_dict().items(), bucket_bytes)

    def train(self, by: float = 0.01) -> None:
        """A "step": every parameter moves, the version goes up."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(by)
        self.version += 1


class KillsAfterFirstBucket(Trainer):
    """A trainer whose next sync loses an engine for real: after the first bucket went out (every engine had begun
    the update and received it), ``victim`` is SIGKILLed before the second bucket is handed over."""

    def __init__(self, model: TorchDecoder, version: int, victim):
        super().__init__(model, version)
        self.victim, self.armed = victim, True

    def iter_hf_buckets(self, bucket_bytes: int):
        for i, bucket in enumerate(super().iter_hf_buckets(bucket_bytes)):
            if i == 1 and self.armed:
                self.armed = False
                os.kill(self.victim.pid, signal.SIGKILL)
                self.victim.child.popen.wait(timeout=30)
            yield bucket


def watch_and_restart(sup, counts: list[int], stop: threading.Event, unhealthy_after_s: float, index: int = 0) -> None:
    """The rollout rank's part: probe, call the hang, relaunch, announce. Stays alive until ``stop``: the engine's
    death signal follows the thread that spawned it."""
    tracker = HealthTracker(unhealthy_after_s=unhealthy_after_s)
    while not stop.is_set():
        ok = sup.alive() and sup.probe(timeout_s=0.5)
        verdict = tracker.observe(alive=sup.alive(), ok=ok, t=time.monotonic(), exit_code=sup.exit_code())
        if verdict is not None:
            sup.relaunch(verdict)
            sup.wait_ready()
            counts[index] = sup.restarts
            tracker.reset()
        stop.wait(0.2)


def served_version(url: str) -> str:
    return str(get_json(url, "/model_info", timeout_s=10, step="model_info")["weight_version"])


def greedy_logprobs(url: str, *, max_new_tokens: int = 4, timeout_s: float = 30) -> tuple[list[int], list[float], dict]:
    """The engine's greedy continuation of ``PROMPT``: its token ids, their log-probs, and the answer's meta_info."""
    out = post_json(
        url,
        "/generate",
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        },
        timeout_s=timeout_s,
        step="generate",
        check_success=False,
    )
    lps = out["meta_info"]["output_token_logprobs"]
    return [t for _, t, _ in lps], [lp for lp, _, _ in lps], out["meta_info"]


def trainer_logprobs(model: TorchDecoder, ids: list[int]) -> torch.Tensor:
    """The model's log-probs of ``ids`` continuing ``PROMPT``."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + ids]))[0].float(), dim=-1)
    n = len(PROMPT)
    return logp[n - 1 : n - 1 + len(ids)].gather(1, torch.tensor(ids)[:, None])[:, 0]


def assert_serves(url: str, trainer: Trainer) -> None:
    """The engine generates (it is not paused) and its greedy log-probs equal the trainer's model's."""
    ids, lps, _ = greedy_logprobs(url)
    torch.testing.assert_close(torch.tensor(lps), trainer_logprobs(trainer.model, ids), atol=1e-4, rtol=0)
