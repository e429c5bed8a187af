"""The broker core at scale, and weight sync on paper.

1. Core CPU time per event. ``BrokerCore`` (the class the broker process runs) driven directly in a
   steady state, no simulator in between: ``N`` groups in flight on ``W`` workers (capacity
   ``N x G / (1.2 W)`` each, the RLinf default's 20% headroom), ``sample`` granularity, a staleness
   cap; each step the actor asks for a batch, random in-flight groups finish (per trajectory:
   the simulator's membership query ``is_inflight`` and a ``trajectory_finished``; then the
   ``group_finished``; the replacement groups are issued), the batch is handed over and a sync
   (``sync_begin`` / ``sync_end``) bumps the version. Events = the core calls that change state
   (trajectory_finished, group_finished, request_batch, sync_begin, sync_end); the time of the
   queries (``is_inflight``, ``take_issues``, ``take_batch``) is counted in too. CPU time
   (``time.process_time``) of the timed steps, minus the same driver run against a null core
   (its own bookkeeping), over >= 5 repetitions (fresh core each): median and spread.
   Two curves: against in-flight groups (1k..16k, 1,000 workers) and against workers (8..1,000,
   16k groups in flight).
2. The core's CPU time per step at 1,000 engines and 16k in-flight groups (batch 1024 x 8) as a share
   of the step. The step comes from the simulator's model (``benchmarks/simulate.py --setup``
   defaults, the issue's command): each engine generates at most ``PEAK_TOK_S`` tokens/s, a
   trajectory has uniform 1..3 turns of ``TURN_TOKENS`` tokens on average, the trainer takes
   ``TRAIN_S`` and a sync ``SYNC_S``; step = max(generation at the saturated rate, training) + sync.
   ``core_step_share_ratio`` is against that step (target <= 1%); ``core_generation_share_ratio``
   against the generation-bound step alone (train_s -> 0), the stricter reading.
3. Weight sync on paper: for a model size, engine count and link bandwidth, bytes / bandwidth plus our
   sync code's control overhead: per bucket, ``bucket_meta`` + ``update_request`` for its tensors and
   the ``/update_weights_from_distributed`` fan-out (``spawn`` + ``post_json`` + ``wait_all``, the code
   of ``asyncrl.sync.weight_sync.push_buckets``) to ``E`` stub engines on localhost answering at once;
   per sync, the six other HTTP steps (pause, begin, version, end, flush, continue) the same way.
   Measured here, median of >= 5 repetitions; the committed ``weight_sync_bench.json``'s measured
   sync - transfer of a real 1-engine sync is printed beside it. Summed with the transfer (the HTTP
   call overlaps the broadcast in the real code, so this is an upper bound), and printed next to
   Miles' published 2.67 s for a 30B MoE over NCCL broadcast (figure as cited in issue #16).

    python benchmarks/scale.py --quick      # < 2 minutes
    python benchmarks/scale.py              # the full grid (about 10 minutes on 2 loaded cores)
    python benchmarks/scale.py --quick --write   # also writes benchmarks/baselines/scale.json
The last stdout line is one JSON object with the figures. ``--load`` (``benchmarks/harness.py``): idle, under the
fixed background load (two busy processes), or both (the default): each condition's figures under ``idle`` /
``loaded``, the first's also at the top level (``top_level_condition``), the keys as before.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import torch  # noqa: E402

from asyncrl.broker.core import BrokerCore, CoreSettings  # noqa: E402
from asyncrl.broker.types import PromptItem, Trajectory  # noqa: E402
from asyncrl.engine.blocking import post_json, spawn, wait_all  # noqa: E402
from asyncrl.sync.bucketing import bucket_meta, update_request  # noqa: E402

BASELINES = Path(__file__).resolve().parent / "baselines"
# the simulator's model (benchmarks/simulate.py SimSetup defaults, the issue's --setup command)
PEAK_TOK_S = 4000.0  # one engine's saturated generated tokens/s
TURN_TOKENS = 250.0  # mean generated tokens per turn
MEAN_TURNS = 2.0  # turns uniform in 1..3
TRAIN_S = 6.0
SYNC_S = 0.3
STALENESS_CAP = 4  # exercises the buffer's get-time filter on every arrival while the actor waits
SHARE_TARGET = 0.01  # issue #16: the core's CPU time per step <= 1% of the step
MILES_30B_SYNC_S = 2.67  # Miles, Qwen3-30B-A3B over NCCL broadcast (as cited in issue #16)
OLD_MEMBERSHIP = "ids"  # --old-membership: only for a core without is_inflight (the before figure)


# --------------------------------------------------------------------------- 1. the core per event
def _batch_for(inflight: int) -> int:
    """Batch in the issue's proportion (1024 groups for 16k in flight)."""
    return max(16, round(inflight * 1024 / 16000))


class _NullCore:
    """The driver's own bookkeeping: the same calls, answered with the least work (subtracted)."""

    def __init__(self, inflight: int, batch: int):
        self.live, self.next_id, self.batch, self.n, self.version = set(range(inflight)), inflight, batch, 0, 0
        self.out: list[int] = []
        self.ready = False

    def is_inflight(self, gid: int) -> bool:
        return gid in self.live

    def trajectory_finished(self, gid: int, i: int, t) -> bool:
        return True

    def group_finished(self, gid: int, trajs) -> bool:
        self.live.discard(gid)
        self.live.add(self.next_id)
        self.out.append(self.next_id)
        self.next_id += 1
        self.n += 1
        self.ready = self.n >= self.batch
        return True

    def take_issues(self) -> list:
        out, self.out = self.out, []
        return [_Gid(g) for g in out]

    def take_batch(self):
        if not self.ready:
            return None
        self.ready, self.n = False, 0
        return True

    def request_batch(self, step: int) -> None:
        pass

    def sync_begin(self, mode: str) -> None:
        pass

    def sync_end(self, version: int) -> None:
        self.version = version


@dataclass
class _Gid:
    group_id: int


def _core(inflight: int, workers: int, batch: int, gs: int, clock) -> BrokerCore:
    s = CoreSettings(
        rollout_batch_size=batch,
        group_size=gs,
        max_inflight_groups=inflight,
        max_buffered_groups=inflight + batch,
        max_dropped_groups_per_step=10**9,
        submission_granularity="sample",
        max_staleness=STALENESS_CAP,
        seed=0,
        no_data_warning_s=1e9,
        worker_heartbeat_timeout_s=1e9,
    )
    core = BrokerCore([PromptItem(i, f"q{i}") for i in range(4096)], settings=s, clock=clock)
    cap = max(1, math.ceil(inflight * gs / (1.2 * workers)))
    core.hold_issuing()  # every worker joins before the first burst (the old core gives it all to the first)
    for w in range(workers):
        core.add_worker(f"w{w}", capacity=cap)
    core.release_issuing()
    return core


def drive(inflight: int, workers: int, *, steps: int, gs: int = 8, seed: int = 0, null: bool = False) -> dict:
    """One repetition: a fresh core in steady state, one warm-up step, ``steps`` timed steps."""
    batch = _batch_for(inflight)
    now = [0.0]
    core = _NullCore(inflight, batch) if null else _core(inflight, workers, batch, gs, lambda: now[0])
    live = list(range(inflight)) if null else [iss.group_id for iss in core.take_issues()]
    assert len(live) == inflight, (len(live), inflight)
    member = getattr(core, "is_inflight", None)
    if member is None:  # a core from before is_inflight: the simulator's list scan, or the server's owner()
        member = (
            (lambda g: g in core.inflight_group_ids())
            if OLD_MEMBERSHIP == "ids"
            else (lambda g: core.owner(g) is not None)
        )
    rng = random.Random(seed)
    events = 0
    t0 = 0.0
    for step in range(steps + 1):
        if step == 1:
            t0, events = time.process_time(), 0
        v = core.version
        trajs = [Trajectory([0], [1], [1], [0.0], min_version=v, max_version=v) for _ in range(gs)]
        core.request_batch(step)
        events += 1
        while core.take_batch() is None:
            j = rng.randrange(len(live))
            gid = live[j]
            live[j] = live[-1]
            live.pop()
            now[0] += 1e-4
            for i in range(gs):
                if member(gid):
                    core.trajectory_finished(gid, i, trajs[i])
            core.group_finished(gid, trajs)
            events += gs + 1
            live.extend([iss.group_id for iss in core.take_issues()])
        core.sync_begin("retract")
        core.sync_end(step + 1)
        events += 2
        live.extend([iss.group_id for iss in core.take_issues()])
    cpu = time.process_time() - t0
    return {"cpu_s": cpu, "events": events, "steps": steps}


def per_event(inflight: int, workers: int, *, steps: int, reps: int) -> dict:
    """Median and spread over ``reps`` of (core run - null run) CPU time per event; the two interleaved."""
    net, per_step = [], []
    for r in range(reps):
        real = drive(inflight, workers, steps=steps, seed=r)
        null = drive(inflight, workers, steps=steps, seed=r, null=True)
        cpu = max(0.0, real["cpu_s"] - null["cpu_s"])
        net.append(cpu / real["events"] * 1e6)
        per_step.append(cpu / steps)
    events_per_step = real["events"] / steps
    return {
        "inflight": inflight,
        "workers": workers,
        "batch": _batch_for(inflight),
        "reps": reps,
        "events_per_step": events_per_step,
        "us_per_event": statistics.median(net),
        "us_per_event_min": min(net),
        "us_per_event_max": max(net),
        "core_s_per_step": statistics.median(per_step),
        "core_s_per_step_spread": [min(per_step), max(per_step)],
    }


def step_model(engines: int, batch: int, gs: int) -> dict:
    """The simulator's step at saturated engines: max(generation, training) + sync."""
    gen_s = batch * gs * MEAN_TURNS * TURN_TOKENS / (engines * PEAK_TOK_S)
    return {
        "generation_s": gen_s,
        "train_s": TRAIN_S,
        "sync_s": SYNC_S,
        "step_s": max(gen_s, TRAIN_S) + SYNC_S,
        "generation_bound_step_s": gen_s + SYNC_S,
    }


# --------------------------------------------------------------------------- 3. weight sync on paper
class _StubEngine(BaseHTTPRequestHandler):
    """Answers every POST at once with ``{"success": true}`` (the engine's own work is not control)."""

    protocol_version = "HTTP/1.0"

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"success": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


def _fan_out_s(urls: list[str], path: str, body: dict, *, step: str) -> float:
    t = time.perf_counter()
    futures = {spawn(post_json, u, path, body, timeout_s=30.0, step=step, name="scale-http"): u for u in urls}
    wait_all(futures, timeout_s=30.0, step=step)
    return time.perf_counter() - t


def control_overhead(engines: int, tensors_per_bucket: int, *, reps: int) -> dict:
    """Per bucket: metadata + the update fan-out; per sync: six other fan-outs. Median of ``reps``."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _StubEngine)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        urls = [f"http://127.0.0.1:{srv.server_address[1]}"] * engines
        bucket = [
            (
                f"model.layers.{i // 64}.mlp.experts.{i % 64}.w{i % 3}.weight",
                torch.empty(768, 2048, dtype=torch.bfloat16, device="meta"),
            )
            for i in range(tensors_per_bucket)
        ]
        per_bucket, per_sync = [], []
        for _ in range(reps):
            t = time.perf_counter()
            body = update_request(bucket_meta(bucket), group_name="scale", flush_cache=True, flattened=False)
            meta_s = time.perf_counter() - t
            per_bucket.append(
                meta_s
                + _fan_out_s(urls, "/update_weights_from_distributed", body, step="update_weights_from_distributed")
            )
            per_sync.append(
                sum(
                    _fan_out_s(urls, p, {}, step=p.strip("/"))
                    for p in (
                        "/pause_generation",
                        "/begin_weight_update",
                        "/update_weight_version",
                        "/end_weight_update",
                        "/flush_cache",
                        "/continue_generation",
                    )
                )
            )
    finally:
        srv.shutdown()
        srv.server_close()
    return {
        "engines": engines,
        "tensors_per_bucket": tensors_per_bucket,
        "reps": reps,
        "per_bucket_s": statistics.median(per_bucket),
        "per_bucket_spread_s": [min(per_bucket), max(per_bucket)],
        "per_sync_s": statistics.median(per_sync),
        "per_sync_spread_s": [min(per_sync), max(per_sync)],
    }


def sync_on_paper(
    *, params: float, bytes_per_param: int, tensors: int, bucket_bytes: int, link_gb_s: float, ctrl: dict
) -> dict:
    model_bytes = params * bytes_per_param
    buckets = math.ceil(model_bytes / bucket_bytes)
    transfer_s = model_bytes / (link_gb_s * 1e9)
    # per-bucket overhead measured at ctrl["tensors_per_bucket"]; the metadata part scales with tensors per bucket
    control_s = ctrl["per_sync_s"] + buckets * ctrl["per_bucket_s"]
    return {
        "params": params,
        "bytes": model_bytes,
        "tensors": tensors,
        "buckets": buckets,
        "bucket_bytes": bucket_bytes,
        "link_GB_s": link_gb_s,
        "engines": ctrl["engines"],
        "transfer_s": transfer_s,
        "control_s": control_s,
        "sync_s": transfer_s + control_s,
    }


def _committed_sync_control() -> dict:
    p = BASELINES / "weight_sync_bench.json"
    try:
        # harness.Report's file: the newest run, then the history; its idle condition where it has one (--load)
        d = harness.condition_view(json.loads(p.read_text())["latest"])
        r = d["results"]["engines1"]
        return {
            "file": str(p.relative_to(BASELINES.parents[1])),
            "date": d.get("date"),
            "sync_minus_transfer_s": r["sync_s"]["median"] - r["transfer_s"]["median"],
            "control_s": r["control_s"]["median"],
            "num_buckets": d.get("num_buckets"),
        }
    except (OSError, ValueError, KeyError, StopIteration) as e:
        return {"file": str(p), "error": f"{type(e).__name__}: {e}"}


# --------------------------------------------------------------------------- main
def _measure(args) -> dict:
    """The three parts under the current condition; their figures (the JSON's keys as before ``--load``)."""
    steps = 1 if args.quick else 3
    inflights = (1000, 4000, 16000) if args.quick else (1000, 2000, 4000, 8000, 16000)
    workerss = (8, 64, 1000) if args.quick else (8, 64, 256, 1000)
    gs = 8
    print(f"== core CPU time per event (median of {args.reps}, [min, max]); {steps} timed step(s) each")
    curve_n, curve_w = [], []
    for n in inflights:
        curve_n.append(per_event(n, 1000, steps=steps, reps=args.reps))
        c = curve_n[-1]
        print(
            f"  in-flight {n:6d}, workers 1000: {c['us_per_event']:7.2f} us/event "
            f"[{c['us_per_event_min']:.2f}, {c['us_per_event_max']:.2f}]",
            flush=True,
        )
    for w in workerss:
        hit = next((c for c in curve_n if c["workers"] == w and c["inflight"] == 16000), None)
        curve_w.append(hit or per_event(16000, w, steps=steps, reps=args.reps))
        c = curve_w[-1]
        print(
            f"  in-flight  16000, workers {w:4d}: {c['us_per_event']:7.2f} us/event "
            f"[{c['us_per_event_min']:.2f}, {c['us_per_event_max']:.2f}]",
            flush=True,
        )
    at = next(c for c in curve_w if c["workers"] == 1000)
    model = step_model(1000, at["batch"], gs)
    share = at["core_s_per_step"] / model["step_s"]
    share_gen = at["core_s_per_step"] / model["generation_bound_step_s"]
    print(
        f"\n== 1,000 engines, 16k groups in flight, batch {at['batch']} x {gs}: core {at['core_s_per_step'] * 1e3:.1f} ms "
        f"CPU per step ({at['events_per_step']:.0f} events)"
    )
    print(
        f"  step (simulator's model: max(generation {model['generation_s']:.2f} s, train {TRAIN_S:g} s) + sync "
        f"{SYNC_S:g} s) = {model['step_s']:.2f} s: core share {share:.2%} (target <= {SHARE_TARGET:.0%})"
    )
    print(
        f"  generation-bound step (train_s -> 0) = {model['generation_bound_step_s']:.2f} s: core share {share_gen:.2%}"
    )

    print("\n== weight sync on paper (control measured against stub engines on localhost)")
    tensors_per_bucket = max(1, round(args.tensors / math.ceil(args.params * 2 / args.bucket_bytes)))
    ctrl = control_overhead(args.engines, tensors_per_bucket, reps=args.reps)
    committed = _committed_sync_control()
    print(
        f"  control: {ctrl['per_bucket_s'] * 1e3:.2f} ms per bucket ({tensors_per_bucket} tensors, "
        f"{args.engines} engine(s)), {ctrl['per_sync_s'] * 1e3:.2f} ms per sync (six other HTTP steps); "
        f"committed weight_sync_bench 1 engine, sync - transfer: "
        f"{committed.get('sync_minus_transfer_s', float('nan')) * 1e3:.1f} ms"
    )
    paper = []
    for gb_s in sorted({args.link_gb_s, 25.0, 100.0}):
        paper.append(
            sync_on_paper(
                params=args.params,
                bytes_per_param=2,
                tensors=args.tensors,
                bucket_bytes=args.bucket_bytes,
                link_gb_s=gb_s,
                ctrl=ctrl,
            )
        )
        p = paper[-1]
        print(
            f"  {args.params / 1e9:.1f}B params bf16 ({p['bytes'] / 1e9:.0f} GB, {p['buckets']} buckets) over "
            f"{gb_s:g} GB/s to {args.engines} engine(s): transfer {p['transfer_s']:.2f} s + control "
            f"{p['control_s']:.2f} s = {p['sync_s']:.2f} s   (Miles, 30B MoE, NCCL broadcast: {MILES_30B_SYNC_S} s)"
        )
    main_paper = next(p for p in paper if p["link_GB_s"] == args.link_gb_s)
    return {
        "core_per_event_vs_inflight": curve_n,
        "core_per_event_vs_workers": curve_w,
        "step_model": model
        | {
            "source": "benchmarks/simulate.py --setup defaults: peak 4000 tok/s per engine, "
            "250 tokens x 2 turns, train 6 s, sync 0.3 s; 1,000 engines"
        },
        "core_s_per_step": at["core_s_per_step"],
        "core_step_share_ratio": share,
        "core_step_share_target": f"<= {SHARE_TARGET}",
        "core_generation_share_ratio": share_gen,
        "core_generation_share_target": f"<= {SHARE_TARGET}",
        "sync_control": ctrl,
        "sync_control_committed": committed,
        "sync_on_paper": paper,
        "sync_vs_miles_ratio": main_paper["sync_s"] / MILES_30B_SYNC_S,
        "sync_vs_miles_target": "<= 1.0",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 points per curve, 1 timed step, 5 repetitions")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--params", type=float, default=30.5e9, help="model parameters (default: a 30B MoE)")
    ap.add_argument(
        "--tensors",
        type=int,
        default=18_867,
        help="tensors in the model (Qwen3-30B-A3B: 48 layers x (128 experts x 3 + 9) + 3)",
    )
    ap.add_argument("--link-gb-s", type=float, default=50.0, help="broadcast bandwidth, GB/s (400 Gb/s InfiniBand)")
    ap.add_argument("--engines", type=int, default=1, help="engines the sync fans out to (Miles' example: one)")
    ap.add_argument("--bucket-bytes", type=int, default=512 * 1024 * 1024, help="sync.bucket_bytes")
    ap.add_argument("--write", action="store_true", help="write benchmarks/baselines/scale.json")
    harness.add_load_arg(ap)
    ap.add_argument(
        "--old-membership",
        choices=("ids", "owner"),
        default="ids",
        help="a core without is_inflight (measuring the old code): ask inflight_group_ids (the "
        "simulator's pattern) or owner (the server's)",
    )
    args = ap.parse_args()
    global OLD_MEMBERSHIP
    OLD_MEMBERSHIP = args.old_membership
    if args.reps < 5:
        ap.error("--reps: at least 5 repetitions")
    t_start = time.time()
    load0 = open("/proc/loadavg").read().split()[:3]
    by_cond = {}
    for cond in harness.conditions(args.load):
        with harness.under_condition(cond) as info:
            by_cond[cond] = _measure(args)
        by_cond[cond] = info | by_cond[cond]
    first = next(iter(by_cond))  # idle where it ran: the top level's figures, as before --load
    load1 = open("/proc/loadavg").read().split()[:3]
    out = {
        "benchmark": "scale",
        "command": " ".join(["python benchmarks/scale.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": load1},
        **{k: v for k, v in by_cond[first].items() if k not in ("background", "load_start", "load_end", "speed_start")},
        "top_level_condition": first,
        **by_cond,
        "miles_30b_sync_s": MILES_30B_SYNC_S,
        "wall_s": round(time.time() - t_start, 1),
    }
    if args.write:
        (BASELINES / "scale.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
