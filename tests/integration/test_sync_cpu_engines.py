"""Weight sync into two real CPU engines, in every pause mode, with requests in flight.

The "trainer" is this test process: a plain-PyTorch decoder (``TorchDecoder``, HF names) loaded
from the tiny checkpoint, perturbed as a training step would, pushed through the real weight-sync
group (gloo, TCPStore + PrefixStore rendezvous) and the real HTTP sequence. After each sync, each
engine's log-probs for a fixed prompt must equal the trainer's own within 1e-4 and its
``weight_version`` the trainer's version.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
from proc_helpers import wait_for
from sync_helpers import greedy_logprobs, trainer_logprobs

from asyncrl.config.schema import SyncConfig
from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.engine.blocking import get_json, get_text, post_json
from asyncrl.engine.client import parse_prometheus
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.models.torch_decoder import TorchDecoder
from asyncrl.sync.bucketing import iter_buckets
from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
from asyncrl.sync.weight_sync import SyncHooks, WeightSyncer

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
LONG_TOKENS = 160  # long enough that requests are still decoding when the sync starts


@dataclass
class Env:
    engines: list
    group: WeightSyncGroup
    trainer: TorchDecoder
    sync_cfg: SyncConfig
    version: int = 0

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    ckpt = make_tiny_checkpoint(root / "model", arch="qwen2", seed=0, num_hidden_layers=2)
    extra = ["--weight-sync-timeout-s", str(TIMEOUT_S)]
    with (
        running_cpu_engine(ckpt, log_dir=root / "logs", max_running_requests=8, weight_version="0", extra=extra) as e1,
        running_cpu_engine(ckpt, log_dir=root / "logs", max_running_requests=8, weight_version="0", extra=extra) as e2,
    ):
        # Small buckets so a sync is several buckets; flattened on (the default SGLang path for
        # slime/Miles); the per-tensor path is covered by the recreate test below.
        cfg = SyncConfig(
            bucket_bytes=256 * 1024,
            flattened_bucket=True,
            backend="gloo",
            join_timeout_s=TIMEOUT_S,
            step_timeout_s=TIMEOUT_S,
        )
        group = WeightSyncGroup(
            [EngineEndpoint(e1.url), EngineEndpoint(e2.url)],
            cfg,
            master_address="127.0.0.1",
            control_timeout_s=TIMEOUT_S,
        )
        group.init()
        try:
            yield Env(engines=[e1, e2], group=group, trainer=TorchDecoder.from_pretrained(ckpt), sync_cfg=cfg)
        finally:
            group.destroy()


def _train_step(model: TorchDecoder, seed: int) -> None:
    """Stand-in for an optimizer step: a seeded perturbation of every parameter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def _engine_logprobs(url: str) -> tuple[list[int], list[float], dict]:
    return greedy_logprobs(url, max_new_tokens=8, timeout_s=TIMEOUT_S)


def _assert_engines_match_trainer(env: Env) -> None:
    for url in env.urls:
        assert str(get_json(url, "/model_info", timeout_s=10, step="t")["weight_version"]) == str(env.version)
        ids, lps, meta = _engine_logprobs(url)
        assert meta["weight_versions"] == [{"version": str(env.version), "start": 0, "end": len(ids)}]
        expected = trainer_logprobs(env.trainer, ids)
        torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-4, rtol=0)


@dataclass
class Traffic:
    """Client threads keeping requests in flight; ``turns`` sequential requests per thread, each
    turn waiting while ``released`` is clear (workers holding new turns under drain). A turn after the
    first also waits for ``sync_started``: a new turn is one the workers hold once the sync began (without
    it a fast engine could finish every first turn, and run the second, before the test's sync began)."""

    urls: list[str]
    per_engine: int
    turns: int = 1
    released: threading.Event = field(default_factory=threading.Event)
    sync_started: threading.Event = field(default_factory=threading.Event)
    results: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    first_done: list = field(default_factory=list)

    def start(self) -> None:
        self.released.set()
        self.threads = [
            threading.Thread(target=self._run, args=(u, i), daemon=True)
            for u in self.urls
            for i in range(self.per_engine)
        ]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int) -> None:
        try:
            for turn in range(self.turns):
                if turn > 0:
                    assert self.sync_started.wait(TIMEOUT_S), "the sync never started"
                assert self.released.wait(TIMEOUT_S), "held too long"
                out = post_json(
                    url,
                    "/generate",
                    {
                        "input_ids": [3 + i, 8, 13 + turn],
                        "rid": f"traffic-{url[-5:]}-{i}-{turn}",
                        "sampling_params": {"max_new_tokens": LONG_TOKENS, "temperature": 1.0, "ignore_eos": True},
                    },
                    timeout_s=TIMEOUT_S,
                    step="generate",
                    check_success=False,
                )
                self.results.append(out["meta_info"])
                if turn == 0:
                    self.first_done.append(i)
        except BaseException as e:  # noqa: BLE001 - re-raised by join()
            self.errors.append(e)

    def on_sync_begin(self, mode: str) -> None:
        """The sync's ``sync_begin`` hook: under drain, hold new turns (a worker's hold); then let the turns
        after the first go on to wait for ``released``."""
        if mode == "drain":
            self.released.clear()
        self.sync_started.set()  # after the hold: a second turn waits for both

    def wait_running(self, *, in_flight: bool = True) -> None:
        """Until every engine reports a running request (``num_running_reqs``: admitted and prefilled, so it
        has decoded a token; a queued one is not retracted by a pause). With ``in_flight`` the traffic must
        still be running when this returns; without it (drain), traffic that already finished will do."""
        deadline = time.monotonic() + TIMEOUT_S
        while min(_running(u) for u in self.urls) < 1:
            if len(self.first_done) == len(self.threads):  # every first turn already ran (a fast engine)
                assert not in_flight, "every request finished before the sync began; nothing was in flight"
                return
            assert time.monotonic() < deadline, "traffic never reached the engines"
            time.sleep(0.01)

    def join(self) -> list[dict]:
        for t in self.threads:
            t.join(TIMEOUT_S)
            assert not t.is_alive(), "a generate call did not finish"
        if self.errors:
            raise self.errors[0]
        return self.results


def _running(url: str) -> float:
    return parse_prometheus(get_text(url, "/metrics", timeout_s=10, step="metrics")).get("num_running_reqs", 0.0)


def _versions(meta: dict) -> list[str]:
    return [w["version"] for w in meta["weight_versions"]]


@pytest.mark.parametrize("mode", ["retract", "in_place", "drain"])
def test_sync_with_requests_in_flight(env: Env, mode: str):
    old = str(env.version)
    _train_step(env.trainer, seed=100 + env.version)
    new_version = env.version + 1
    traffic = Traffic(env.urls, per_engine=3, turns=2 if mode == "drain" else 1)
    events = []

    def begin(m):
        events.append(("begin", m))
        traffic.on_sync_begin(m)  # under drain, workers hold new turns

    def end(v):
        events.append(("end", v))
        traffic.released.set()

    syncer = WeightSyncer(
        env.group, pause_mode=mode, sync_cfg=env.sync_cfg, hooks=SyncHooks(sync_begin=begin, sync_end=end)
    )
    traffic.start()
    traffic.wait_running(in_flight=mode != "drain")
    buckets = iter_buckets(env.trainer.state_dict().items(), env.sync_cfg.bucket_bytes)
    result = syncer.sync(buckets, version=new_version)
    env.version = new_version
    metas = traffic.join()

    assert events == [("begin", mode), ("end", new_version)]
    assert result.num_buckets > 1
    assert result.num_bytes == sum(t.numel() * t.element_size() for t in env.trainer.state_dict().values())
    m = result.metrics()
    assert m["time/sync_weights"] > 0 and m["sync/bytes_per_s"] > 0
    # the split: control (HTTP calls) + gather (the bucket iterator) + transfer make up the whole sync
    parts = m["time/sync_control"] + m["time/sync_gather"] + m["time/sync_transfer"]
    assert m["time/sync_control"] > 0 and m["time/sync_transfer"] > 0 and m["time/sync_gather"] >= 0
    assert parts <= m["time/sync_weights"] + 1e-6 and parts >= 0.9 * m["time/sync_weights"]
    assert m["time/sync_control"] == pytest.approx(m["time/sync_pause"] + m["time/sync_finish"])
    if mode == "in_place":
        # in_place cannot flush while requests run, so the prefix cache still holds the fixed
        # prompt's old-version KV (the documented cost of in_place); flush now that they finished.
        for u in env.urls:
            post_json(u, "/flush_cache", {}, timeout_s=10, step="flush_cache")
    _assert_engines_match_trainer(env)

    assert all(x["finish_reason"]["type"] == "length" for x in metas)
    if mode == "retract":
        split = [x for x in metas if x["num_retractions"] > 0]
        assert split, "no request was retracted by the sync"
        assert any(_versions(x) == [old, str(new_version)] for x in split)
    elif mode == "in_place":
        assert all(x["num_retractions"] == 0 for x in metas)
        assert any(_versions(x) == [old, str(new_version)] for x in metas)  # resumed on new weights
    else:  # drain: nothing spans two versions; the held second turns ran on the new weights
        assert all(len(_versions(x)) == 1 for x in metas)
        assert {_versions(x)[0] for x in metas} == {old, str(new_version)}
        assert all(x["num_retractions"] == 0 for x in metas)


def _paused(url: str) -> bool:
    info = get_json(url, "/server_info", timeout_s=10, step="server_info")
    return bool(info["internal_states"][0]["paused"])


def test_first_bucket_is_gathered_while_the_engines_pause(env: Env, monkeypatch):
    """The pause and the begin go out before the first bucket is gathered, and their answers are read only after
    it: the producer's first bucket waits until every engine says it is paused (its own state, over HTTP), and the
    real exchange's calls and reads are recorded in order around it. The overlapped gather counts as gather, not
    as pause, so the parts still add up to the sync."""
    from asyncrl.sync import weight_sync

    events: list[str] = []

    class RecordingExchange(weight_sync.Exchange):
        def start(self):
            events.append("sent " + " ".join(c.step for c in self.chains[0][1]))
            return super().start()

        def wait(self, **kw):
            answers = super().wait(**kw)
            events.append("read " + " ".join(c.step for c in self.chains[0][1]))
            return answers

    monkeypatch.setattr(weight_sync, "Exchange", RecordingExchange)
    _train_step(env.trainer, seed=700 + env.version)

    def buckets():
        wait_for(lambda: all(_paused(u) for u in env.urls), "every engine paused", timeout_s=TIMEOUT_S)
        events.append("first bucket")
        yield from iter_buckets(env.trainer.state_dict().items(), env.sync_cfg.bucket_bytes)

    env.version += 1
    res = WeightSyncer(env.group, pause_mode="retract", sync_cfg=env.sync_cfg).sync(buckets(), version=env.version)
    pause = "pause_generation begin_weight_update"
    assert events[:3] == [f"sent {pause}", "first bucket", f"read {pause}"], events
    assert not any(_paused(u) for u in env.urls)  # resumed
    m = res.metrics()
    parts = m["time/sync_control"] + m["time/sync_gather"] + m["time/sync_transfer"]
    assert parts == pytest.approx(m["time/sync_weights"], rel=0.1) and m["time/sync_pause"] >= 0
    _assert_engines_match_trainer(env)


def test_engine_restart_then_recreate_group(env: Env):
    """An engine restarts (back to the checkpoint's weights, version "0"): destroy + init the
    group, sync (per-tensor broadcasts this time) and both engines serve the trainer's weights."""
    e2 = env.engines[1]
    e2.stop()
    e2.start()
    assert str(get_json(e2.url, "/model_info", timeout_s=10, step="t")["weight_version"]) == "0"
    env.group.recreate()
    _train_step(env.trainer, seed=999)
    cfg = SyncConfig(
        bucket_bytes=1 << 20, flattened_bucket=False, backend="gloo", join_timeout_s=TIMEOUT_S, step_timeout_s=TIMEOUT_S
    )
    syncer = WeightSyncer(env.group, pause_mode="retract", sync_cfg=cfg)
    env.version += 1
    syncer.sync(iter_buckets(env.trainer.state_dict().items(), cfg.bucket_bytes), version=env.version)
    _assert_engines_match_trainer(env)


@pytest.mark.parametrize(
    "case", ["last-bucket-carries-version", "separate-version-call", "answer-without-version-note"]
)
def test_version_rides_on_the_last_bucket(env: Env, monkeypatch, case: str):
    """``iter_buckets`` marks its final bucket: that update call carries the new version (SGLang's
    ``weight_version``) and no ``/update_weight_version`` goes out; buckets from a producer that does not
    mark them (plain lists) get the separate call. The update calls flush (``flush_cache``), so no separate
    ``/flush_cache`` goes out. ``/model_info`` is read only from an engine whose update answer did not
    confirm the version: every engine after the separate call, and the one engine whose answer lacks
    SGLang's " Weight version updated to V." note (as an SGLang that ignores the field would answer; the
    note is cut from its real answer here). Either way every engine serves the new weights and version, and
    its update is ended once: pipelined behind the version-carrying update, else in the finish (after the sync, an
    update without a begin is refused). The real calls are recorded as they are written."""
    from asyncrl.engine import blocking
    from asyncrl.sync import weight_sync

    sent: list[tuple[str, str, dict, bool]] = []
    real_send = blocking._Req.send

    def recording_send(self, timeout_s, **kw):
        sent.extend((self.url, c.path, c.body or {}, c.pipelined) for c in self.calls[self.answered :])
        return real_send(self, timeout_s, **kw)

    class RecordingExchange(weight_sync.Exchange):
        """The real exchange (one answer's note cut)."""

        def wait(self, **kw):
            answers = super().wait(**kw)
            for (url, calls), outs in zip(self.chains, answers):
                for j, (c, out) in enumerate(zip(calls, outs)):
                    cut = case == "answer-without-version-note" and url == env.urls[1]
                    if cut and c.path == "/update_weights_from_distributed" and c.body.get("weight_version"):
                        outs[j] = {**out, "message": out["message"].split(" Weight version")[0]}
            return answers

    monkeypatch.setattr(weight_sync, "Exchange", RecordingExchange)
    monkeypatch.setattr(blocking._Req, "send", recording_send)
    _train_step(env.trainer, seed=500 + env.version)
    buckets = list(iter_buckets(env.trainer.state_dict().items(), env.sync_cfg.bucket_bytes))
    if case == "separate-version-call":
        buckets = [list(b) for b in buckets]
    env.version += 1
    WeightSyncer(env.group, pause_mode="retract", sync_cfg=env.sync_cfg).sync(iter(buckets), version=env.version)
    paths = [p for _, p, _, _ in sent]
    updates = [b for _, p, b, _ in sent if p == "/update_weights_from_distributed"]
    assert len(updates) == len(buckets) * len(env.urls) and len(buckets) > 1
    assert all(b["flush_cache"] is True for b in updates) and "/flush_cache" not in paths
    carried = [b["weight_version"] for b in updates]
    checked = [u for u, p, _, _ in sent if p == "/model_info"]
    ends = [(u, pipelined) for u, p, _, pipelined in sent if p == "/end_weight_update"]
    assert sorted(u for u, _ in ends) == sorted(env.urls)
    assert all(pipelined == (case != "separate-version-call") for _, pipelined in ends)
    for u in env.urls:
        with pytest.raises(blocking.EngineStepError, match="must run between begin_weight_update"):
            probe = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[1]]}
            blocking.post_json(u, "/update_weights_from_distributed", probe, timeout_s=30, step="probe")
    if case == "separate-version-call":
        assert carried == [None] * len(updates)
        assert paths.count("/update_weight_version") == len(env.urls)
        assert sorted(checked) == sorted(env.urls)
    else:
        assert carried == [None] * (len(updates) - len(env.urls)) + [str(env.version)] * len(env.urls)
        assert "/update_weight_version" not in paths
        assert checked == ([env.urls[1]] if case == "answer-without-version-note" else [])
    _assert_engines_match_trainer(env)


def test_failed_update_names_engine_and_step_and_the_retry_is_accepted(env: Env):
    """An engine that rejects a bucket (a tensor of the wrong shape) fails the sync at once, naming the
    engine and the step, instead of waiting for the broadcast to time out. The failed sync closes every
    engine's weight-update session, so the retried sync's begin is accepted (the engines refuse a second begin
    while one is open, as SGLang does) and the retry carries the trainer's weights."""
    from asyncrl.engine.blocking import EngineStepError

    syncer = WeightSyncer(env.group, pause_mode="retract", sync_cfg=env.sync_cfg)
    bad = [[("model.norm.weight", torch.zeros(3, 5))]]
    t0 = time.monotonic()
    with pytest.raises(EngineStepError) as ei:
        syncer.sync(bad, version=env.version + 1)
    assert ei.value.step == "update_weights_from_distributed"
    assert set(ei.value.urls) <= set(env.urls) and ei.value.urls
    assert time.monotonic() - t0 < TIMEOUT_S
    for u in env.urls:  # the failure path ended the session: an end now finds none open
        with pytest.raises(EngineStepError, match="no weight-update session is open"):
            post_json(u, "/end_weight_update", {}, timeout_s=TIMEOUT_S, step="probe")
    env.group.recreate()  # the trainer's side of the refused broadcast is in flight: the recovery re-forms the group
    _train_step(env.trainer, seed=77)
    env.version += 1
    syncer.sync(iter_buckets(env.trainer.state_dict().items(), env.sync_cfg.bucket_bytes), version=env.version)
    _assert_engines_match_trainer(env)


def test_unknown_name_is_received_dropped_and_answered_success_as_sglang(env: Env):
    """SGLang's loaders warn on a parameter name the model lacks and still answer success; so does the CPU engine
    (the sync's weight verification, not the update's answer, is what catches a name drift). The bytes are
    received (the broadcast completes), a warning names the parameter, and the served weights do not change."""
    syncer = WeightSyncer(env.group, pause_mode="retract", sync_cfg=env.sync_cfg)
    syncer.pause()
    try:
        stats = syncer.push([[("model.no_such_weight", torch.ones(4))]])
    finally:
        syncer.close_sessions()
        for u in env.urls:
            post_json(u, "/continue_generation", {}, timeout_s=30, step="continue")
    assert stats.num_tensors == 1
    for e in env.engines:
        assert "Parameter model.no_such_weight not found" in e.log_path.read_text()
    _assert_engines_match_trainer(env)
