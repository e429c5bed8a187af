"""Broker throughput and hand-off latency on the production path: the real broker process, N production
agent-worker processes, and the runner's own batch fetch.

Measures over loopback TCP:
  1. groups/s through admission -> worker -> buffer -> hand-off, with small groups, in ``--reps``
     consecutive windows (median and spread). Each worker is ``asyncrl.agent.worker.AgentWorker`` itself
     (its event loop, one task per group, ``AgentLoop.run_group`` with the prompt's tokenization, one
     ``send_group`` per finished group with its trajectories on ``AsyncWorkerConnection``, which coalesces
     the groups finished in one event-loop turn into one ``groups`` message) with only the engine edge
     stubbed (``run_trajectory`` returns a ready trajectory at once); the consumer fetches each batch with
     ``asyncrl.trainer.leader.wait_batch`` exactly as the actor does (``get_batch``: zero-copy arrays);
  2. the hand-off of one batch of 512 groups x 5 trajectories x 2,000 tokens (buffer full) through that
     same fetch (under the actor's GC settings, the interpreter's defaults), and a raw ZeroMQ round trip
     of the same number of bytes (DEALER -> ROUTER, one small request, one one-frame reply), both in each repetition, the order alternating, under the same
     load: issuing is paused (a ``drain`` sync) while both run, and resumed after; ``--handoff-reps`` repetitions.
Targets: the CPU spent per small group, over all processes (broker, workers, consumer; every thread), at most
``CPU_US_PER_GROUP_TARGET`` (issue 45: issue 16's 20,000 groups/s on 2 cores, written as CPU so that the
absolute groups/s follows from the cores one has, and so that other jobs on the machine do not move it by taking
the cores); hand-off <= 1.5x the raw round trip. Groups/s is still printed, a figure, not a target.
Also printed: the CPU each process spent per group during the throughput run, and the broker's CPU per
group in process (no sockets; CPU time). Everything runs idle and under the harness's fixed background load
(``--load``; both by default, under ``idle`` and ``loaded`` in the JSON).

    python benchmarks/broker_bench.py --quick
The last stdout line is one JSON object with the figures (``benchmarks/harness.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.broker.client import BrokerClient  # noqa: E402
from asyncrl.broker.serve import freeze_setup_objects, tune_gc  # noqa: E402
from asyncrl.broker.types import Trajectory  # noqa: E402
from asyncrl.broker.wire import token_nbytes  # noqa: E402
from asyncrl.runner.broker_process import start_broker  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import harness  # noqa: E402


def _traj(n_prompt: int, n_resp: int, version: int) -> Trajectory:
    return Trajectory(
        prompt_ids=np.arange(n_prompt, dtype=np.int32),
        response_ids=np.arange(n_resp, dtype=np.int32),
        loss_mask=np.ones(n_resp, np.uint8),
        rollout_logprobs=np.full(n_resp, -0.5, np.float32),
        weight_versions=np.full(n_resp, version, np.int32),
        reward=1.0,
        min_version=version,
        max_version=version,
    )


class _NoRetriever:
    """The worker's retriever, never called: generation (the edge) is stubbed below."""

    async def close(self) -> None:
        return None


def worker_main(address: str, worker_id: str, n_prompt: int, n_resp: int, model_dir: str) -> int:
    """The PRODUCTION agent worker (``asyncrl.agent.worker.AgentWorker``: its event loop, ``run_group``, one
    ``send_group`` per finished group on ``AsyncWorkerConnection``) with only the engine edge stubbed:
    ``run_trajectory`` returns a ready trajectory at once."""
    import asyncio

    from asyncrl.agent.loop import AgentLoop
    from asyncrl.agent.worker import AgentWorker
    from asyncrl.config import load_config

    tune_gc()
    cfg = load_config(
        REPO / "configs/tiny.toml", ["agentloop.max_requests_per_engine=65536", "agentloop.heartbeat_interval_s=1.0"]
    )
    w = AgentWorker(
        cfg,
        broker_address=address,
        engine_urls=["http://127.0.0.1:9"],
        tokenizer_path=model_dir,
        worker_id=worker_id,
        retriever=_NoRetriever(),
        connect_timeout_s=30,
    )
    traj = _traj(n_prompt, n_resp, 0)

    async def run_trajectory(self, item, engine, *, prompt_ids, rid):
        return traj

    # the worker builds its AgentLoop inside run() (since the environment interface): stub the class, in this
    # benchmark-only worker process
    AgentLoop.run_trajectory = run_trajectory
    asyncio.run(w.run())
    return 0


def _config(tmp: Path, *, batch: int, group_size: int, inflight: int, buffered: int) -> tuple[str, str]:
    prompts = tmp / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(1000):
            f.write(json.dumps({"question": f"q{i}", "golden_answers": ["a"]}) + "\n")
    cfg = tmp / "bench.toml"
    cfg.write_text(
        f"[runner]\nasync_mode = true\n[data]\nrollout_batch_size = {batch}\n"
        f"[algorithm]\ngroup_size = {group_size}\n"
        f'[rollout_buffer]\nsubmission_granularity = "group"\nmax_inflight_groups = {inflight}\n'
        f"max_buffered_groups = {buffered}\nmax_dropped_groups_per_step = 1000000\n"
    )
    return str(cfg), str(prompts)


def _start(tmp: Path, n_workers: int, n_prompt: int, n_resp: int, model_dir: Path, **cfg_kw):
    cfg, prompts = _config(tmp, **cfg_kw)
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp / "broker.log"), log_level="WARNING")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", broker.address, f"w{i}", str(n_prompt), str(n_resp), str(model_dir)],
            env=env,
        )
        for i in range(n_workers)
    ]
    return broker, workers


def _stop(broker, workers, client) -> None:
    try:
        client.shutdown()
    except TimeoutError:
        pass
    client.close()
    for w in workers:
        try:
            w.wait(timeout=10)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait(timeout=10)
    broker.stop()


CPU_US_PER_GROUP_TARGET = 100.0  # 2 cores x 1e6 us / 20,000 groups/s (issue 16's target, on our 2-core machine)
FETCH_TIMEOUT_S = 120.0  # the first fetch waits for the workers to start (imports); later ones are quick


def _fetch(client: BrokerClient, step: int):
    """The actor's batch fetch exactly as the runner does it (``asyncrl.trainer.leader.wait_batch``; imported
    here, not at the top: the worker processes run this file too and need not import the runner)."""
    from asyncrl.trainer.leader import wait_batch

    return wait_batch(client, None, step=step, version=step - 1, timeout_s=FETCH_TIMEOUT_S, t0=time.monotonic())


def bench_throughput(tmp: Path, model_dir: Path, *, n_workers: int, window_s: float, reps: int) -> dict:
    """Groups/s in ``reps`` consecutive windows of ``window_s``. ``cpu_us_per_group``: CPU (all threads,
    ZeroMQ's I/O thread included) each process spent per group over all windows."""
    batch = 512
    broker, workers = _start(tmp, n_workers, 4, 8, model_dir, batch=batch, group_size=2, inflight=2048, buffered=4096)
    client = BrokerClient(broker.address, timeout_s=30)
    pids = {"broker": [broker.proc.pid], "workers": [w.pid for w in workers]}
    rates: list[float] = []
    window_cpu_us: list[float] = []  # CPU us per group of each window, all processes
    step, n_all = 1, 0
    try:
        _fetch(client, step)  # warm-up: workers connected and flowing
        cpu0 = {k: [_cpu_s(p) for p in v] for k, v in pids.items()}
        c0 = time.process_time()
        t_all = time.perf_counter()
        for _ in range(reps):
            t0, n, w0 = time.perf_counter(), 0, _all_cpu_s(pids)
            while time.perf_counter() - t0 < window_s:
                step += 1
                n += len(_fetch(client, step).groups)
            rates.append(n / (time.perf_counter() - t0))
            window_cpu_us.append((_all_cpu_s(pids) - w0) / n * 1e6)
            n_all += n
        dt = time.perf_counter() - t_all
        consumer_s = time.process_time() - c0
        cpu1 = {k: [_cpu_s(p) for p in v] for k, v in pids.items()}
    finally:
        _stop(broker, workers, client)
    cpu_us = {"consumer": consumer_s / n_all * 1e6}
    for k in pids:
        if None not in cpu0[k] + cpu1[k]:
            cpu_us[k] = sum(b - a for a, b in zip(cpu0[k], cpu1[k])) / n_all * 1e6
    return {
        "groups_per_s": harness.summary(rates),
        "groups": n_all,
        "seconds": dt,
        "workers": n_workers,
        "group_size": 2,
        "cpu_us_per_group": cpu_us,
        "window_cpu_us_per_group": window_cpu_us,
    }


def _all_cpu_s(pids: dict[str, list[int]]) -> float:
    """CPU seconds so far of this process and every process in ``pids`` (0 for one /proc cannot read)."""
    return time.process_time() + sum(_cpu_s(p) or 0.0 for v in pids.values() for p in v)


def bench_handoff(tmp: Path, model_dir: Path, *, reps: int) -> dict:
    """The hand-off and the raw round trip of the same bytes, under the same load: each repetition waits for
    a full buffer, pauses issuing (a ``drain`` sync: the workers go quiet), then times both, the order
    alternating, then resumes issuing."""
    batch, g, n_prompt, n_resp = 512, 5, 200, 1800
    nbytes = batch * g * token_nbytes(n_prompt, n_resp)
    broker, workers = _start(
        tmp, 2, n_prompt, n_resp, model_dir, batch=batch, group_size=g, inflight=batch, buffered=batch
    )
    client = BrokerClient(broker.address, timeout_s=60)
    raw = _RawPeer(nbytes)
    lat: list[float] = []
    raw_lat: list[float] = []

    def handoff(step: int) -> float:
        t0 = time.perf_counter()
        b = _fetch(client, step)
        dt = time.perf_counter() - t0
        got = sum(token_nbytes(len(t.prompt_ids), len(t.response_ids)) for gr in b.groups for t in gr.trajectories)
        assert len(b.groups) == batch and got == nbytes, (len(b.groups), got, nbytes)
        return dt

    try:
        _fetch(client, 1)  # warm-up (imports the runner); then the actor's set-up freeze, as in its step loop
        freeze_setup_objects()
        for step in range(2, reps + 3):
            deadline = time.monotonic() + 120
            while client.status()["num_buffered_groups"] < batch:
                assert time.monotonic() < deadline, "buffer did not fill"
                time.sleep(0.02)
            client.sync_begin("drain")  # issuing paused: both sides run on a quiet machine
            if step % 2:
                h, r = handoff(step), raw.roundtrip()
            else:
                r, h = raw.roundtrip(), handoff(step)
            client.sync_end(step)
            if step > 2:  # the first of each is a warm-up
                lat.append(h)
                raw_lat.append(r)
    finally:
        raw.close()
        _stop(broker, workers, client)
    return {
        "batch_groups": batch,
        "group_size": g,
        "tokens_per_traj": n_prompt + n_resp,
        "bytes": nbytes,
        "handoff_s": harness.summary(lat),
        "raw_s": harness.summary(raw_lat),
        "handoff_p99_s": _pct(lat, 99),
        "raw_p99_s": _pct(raw_lat, 99),
        "handoff": lat,
        "raw": raw_lat,
    }


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def raw_server_main(address_file: str, nbytes: int) -> int:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    payload = np.ones(nbytes, np.uint8).tobytes()
    Path(address_file).write_text(f"tcp://127.0.0.1:{port}")
    while True:
        if not sock.poll(30_000):
            return 1
        ident, req = sock.recv_multipart()
        if req == b"stop":
            return 0
        sock.send_multipart([ident, payload], copy=False)


def bench_broker_cpu(n_groups: int, *, per_message: int = 64) -> dict:
    """The broker's own work per small group, in process (no sockets), as the server does it: decode the
    workers' ``groups`` messages (``per_message`` groups each), core (finish, buffer, admission), encode the
    issues (rows) and the hand-off (the batch's group table). CPU time (``process_time``), so other jobs on the
    machine do not inflate it; the workers' encoding is excluded. 1e6 / us_per_group is the ceiling of one
    broker core on this machine."""
    from asyncrl.broker import protocol as P
    from asyncrl.broker.core import BrokerCore, CoreSettings
    from asyncrl.broker.types import PromptItem

    core = BrokerCore(
        [PromptItem(i, f"q{i}", ["a"]) for i in range(1000)],
        clock=time.monotonic,
        settings=CoreSettings(
            rollout_batch_size=512,
            group_size=2,
            max_inflight_groups=2048,
            max_buffered_groups=4096,
            max_dropped_groups_per_step=10**9,
            submission_granularity="group",
        ),
    )
    core.add_worker("w0", capacity=1 << 16)
    core.add_worker("w1", capacity=1 << 16)
    trajs = [_traj(4, 8, 0) for _ in range(2)]
    done, step, worker_s = 0, 0, 0.0
    t0 = time.process_time()
    while done < n_groups:
        issues = core.take_issues()
        per_worker: dict[str, list] = {}
        for i in issues:
            per_worker.setdefault(i.worker_id, []).append(
                [i.group_id, i.group_size, i.version, i.epoch, P.item_row(i.item)]
            )
        for rows in per_worker.values():
            P.encode(P.ISSUE, {"rows": rows})
        reports = []
        for k in range(0, len(issues), per_message):
            t1 = time.process_time()
            frames = P.finished_groups_frames([(i.group_id, trajs, False, "") for i in issues[k : k + per_message]])
            worker_s += time.process_time() - t1
            reports += [(gid, tr, ab) for gid, tr, ab, _ in P.unpack_finished_groups(P.decode(frames))[1]]
        core.groups_finished(reports)
        done += len(reports)
        core.request_batch(step)
        batch = core.take_batch()
        if batch is not None:
            table, frames = P.pack_groups(batch.groups)
            P.encode(P.BATCH, {"groups": table, "metrics": batch.metrics}, frames)
            step += 1
    us = (time.process_time() - t0 - worker_s) / done * 1e6
    return {"us_per_group": us, "ceiling_groups_per_s": 1e6 / us, "groups_per_message": per_message}


def _cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user + system, all threads) of a process, from /proc (None where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _RawPeer:
    """A ROUTER in another process answering each small request with ``nbytes`` bytes (one frame)."""

    def __init__(self, nbytes: int):
        fd, self.addr_file = tempfile.mkstemp()
        os.close(fd)
        os.unlink(self.addr_file)
        self.nbytes = nbytes
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, __file__, "--raw-server", self.addr_file, str(nbytes)], env=env)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.addr_file):
            assert time.monotonic() < deadline and self.proc.poll() is None, "raw server did not start"
            time.sleep(0.02)
        time.sleep(0.05)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(Path(self.addr_file).read_text())

    def roundtrip(self) -> float:
        t0 = time.perf_counter()
        self.sock.send(b"get")
        assert self.sock.poll(30_000), "raw server did not answer"
        frame = self.sock.recv(copy=False)
        dt = time.perf_counter() - t0
        assert len(frame.buffer) == self.nbytes
        return dt

    def close(self) -> None:
        try:
            self.sock.send(b"stop")
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.sock.close()
        if os.path.exists(self.addr_file):
            os.unlink(self.addr_file)


_DEFAULT_GC_THRESHOLD = gc.get_threshold()  # before any tune_gc: what the actor process runs with


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker_main(argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5])
    if argv and argv[0] == "--raw-server":
        return raw_server_main(argv[1], int(argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 9 by default: one hand-off in 5 took 10-20x the median on 2 idle cores (measured), which moves a 5-run median
    harness.add_args(ap, reps=9, load=True)
    ap.add_argument("--workers", type=int, default=2)
    # 21 by default: the per-repetition hand-off/raw ratio ranges 0.95-2.3 on 2 cores, and the median of 9 printed
    # 1.27, 1.32 and 1.78 within ten minutes (2026-12-05); a repetition costs ~0.5 s (the buffer refills)
    ap.add_argument("--handoff-reps", type=int, default=21, help="timed hand-off repetitions (default 21)")
    args = ap.parse_args(argv)
    rep = harness.Report("broker_bench", argv)
    from asyncrl.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as d:
        model_dir = make_tiny_checkpoint(Path(d) / "model", arch="qwen2", seed=0)  # the workers' tokenizer
        for cond in harness.conditions(args.load):
            with rep.condition(cond):
                rep.record(_one_condition(rep, Path(d) / cond, model_dir, args))
    rep.emit({"zmq": zmq.zmq_version(), "cpu_us_per_group_target": CPU_US_PER_GROUP_TARGET}, save=args.save)
    return 0


def _one_condition(rep, tmp: Path, model_dir: Path, args) -> dict:
    """Throughput, the broker's CPU in process and the hand-off, under the current condition; ratios to ``rep``."""
    tmp.mkdir()
    window = 1.5 if args.quick else 4.0
    tune_gc()  # the consumer's GC for the throughput run (again: the previous condition's hand-off undid it)
    tp = bench_throughput(tmp, model_dir, n_workers=args.workers, window_s=window, reps=args.reps)
    gps, cpu_w = tp["groups_per_s"], tp["window_cpu_us_per_group"]
    print(
        f"throughput (production worker and fetch): {harness.fmt(gps, ' groups/s')}; CPU per group, all processes: "
        f"{harness.fmt(harness.summary(cpu_w), ' us')} (target <= {CPU_US_PER_GROUP_TARGET:g}); CPU us/group "
        + ", ".join(f"{k} {v:.1f}" for k, v in tp["cpu_us_per_group"].items()),
        flush=True,
    )
    cpu = bench_broker_cpu(20000 if args.quick else 100000)
    print(
        f"broker CPU per small group (in process, no sockets): {cpu['us_per_group']:.1f} us "
        f"-> ceiling {cpu['ceiling_groups_per_s']:.0f} groups/s on one core of this machine",
        flush=True,
    )
    # the hand-off is fetched under the actor's own GC settings (the interpreter's thresholds, the set-up
    # heap frozen: ``freeze_setup_objects`` in bench_handoff), so the figure is what production gets
    gc.unfreeze()
    gc.set_threshold(*_DEFAULT_GC_THRESHOLD)
    ho = bench_handoff(tmp, model_dir, reps=args.handoff_reps)
    print(
        f"hand-off of {ho['batch_groups']} groups x {ho['group_size']} x {ho['tokens_per_traj']} tokens "
        f"({ho['bytes'] / 1e6:.1f} MB): {harness.fmt(ho['handoff_s'], ' ms', 1e3)}; raw ZeroMQ "
        f"{harness.fmt(ho['raw_s'], ' ms', 1e3)}",
        flush=True,
    )
    rep.ratio(
        "cpu_us_per_group_over_target_ratio",
        cpu_w,
        [CPU_US_PER_GROUP_TARGET] * len(cpu_w),
        target=1.0,
        at_least=False,
        note=f"CPU us per group per window, all processes / {CPU_US_PER_GROUP_TARGET:g} (issue 45)",
    )
    rep.ratio(
        "handoff_over_raw_ratio",
        ho.pop("handoff"),
        ho.pop("raw"),
        target=1.5,
        at_least=False,
        note="hand-off s / raw ZeroMQ round trip s of the same bytes, same repetition, issuing paused",
    )
    return {"throughput": tp, "broker_cpu": cpu, "handoff": ho}


if __name__ == "__main__":
    sys.exit(main())
