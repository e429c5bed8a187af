"""Weight sync on paper: seconds for one sync of a model, by topology (funnel vs sharded) and send (full vs delta).

A link-bandwidth model, not a measurement. It answers "what would the sync cost at this size, with this many
engines, on these links", printed next to the published figures it should be read against (each with where it
comes from), so a claim about the sync at scale has its arithmetic on the page.

Contract (all pure functions of ``SyncSetup``; no clocks, no sockets):
  * ``wire_bytes``: ``params x wire_bytes_per_param``: what one full replica weighs on the wire.
  * ``sent_bytes``: what one sync puts on the wire per replica. ``full``: ``wire_bytes``. ``delta`` at density
    ``d`` (fraction of elements that changed): the cheaper of index+value (``params x d x (elt + 4)``, an int32
    index per changed element) and bitmask+value (``params / 8 + params x d x elt``), never more than full (a
    tensor whose delta would not pay is sent whole).
  * ``gather_s``: ``funnel`` only: every actor rank's shard is gathered to rank 0 over the gather link, full
    tensors (the delta is taken at rank 0, after the gather): ``wire_bytes x (N - 1) / N / gather_gb_s``.
    ``sharded``: 0 (each rank sends its own shard).
  * ``transfer_s``: a pipelined (ring/tree) broadcast sends each byte once per sender NIC whatever the engine
    count, so the time is the slower end: sender side ``sent / (senders x link)`` (funnel: 1 sender, rank 0's
    NIC; sharded: ``actor_ranks`` senders, one NIC each), receiver side ``sent / (engine_nics x link)`` (every
    engine replica takes the whole model through its own ``engine_nics`` NICs, in parallel with the others).
  * ``control_s``: the fixed cost of a sync (pause, begin, the engines' HTTP-to-scheduler hops, end, continue),
    MEASURED by ``benchmarks/weight_sync_bench.py``: ``overhead_s`` (median sync - median bare broadcast) of the
    least-loaded run in ``benchmarks/baselines/weight_sync_bench.json`` that has it (idle), for 1 and 2 CPU engines, taken
    linearly in the engine count beyond (the control calls to engines run concurrently; the measured slope is
    the per-engine share). ``--control-ms`` overrides it.
  * ``sync_s = gather_s + transfer_s + control_s``. Not modelled: format conversion and quantisation (BF16 ->
    FP8), the delta's encode/decode and checksum compute, congestion, NCCL setup; each anchor's gap to its row
    is read as what those cost there.

    python benchmarks/sync_model.py                          # the anchors' setups, each beside its published figure
    python benchmarks/sync_model.py --params 1e12 --engines 16 --link-gb-s 50 --actor-ranks 256 --density 0.03

The last stdout line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

BASELINE = Path(__file__).resolve().parent / "baselines" / "weight_sync_bench.json"
INDEX_BYTES = 4  # an int32 element index per changed element (index+value delta)


@dataclass(frozen=True)
class SyncSetup:
    params: float  # parameters in the model
    wire_bytes_per_param: float = 2.0  # bf16 on the wire
    engines: int = 1  # engine replicas, each receiving the whole model
    engine_nics: int = 1  # NICs per engine replica (its TP ranks' NICs, one each)
    actor_ranks: int = 8  # actor ranks that own a shard (TP x PP x EP)
    link_gb_s: float = 50.0  # one NIC's bandwidth, GB/s (400 Gb/s IB = 50 GB/s)
    gather_gb_s: float = 50.0  # the gather link to rank 0, GB/s (NVLink within a node is faster; across nodes a NIC)
    topology: str = "funnel"  # "funnel": gather to rank 0, broadcast from it; "sharded": every rank sends its shard
    density: float | None = None  # None: full send; else the fraction of elements changed (delta send)
    control_s: float = 0.0  # the fixed cost of a sync (measured; ``measured_control``)

    def __post_init__(self):
        if self.topology not in ("funnel", "sharded"):
            raise ValueError(f"topology={self.topology!r}: expected 'funnel' or 'sharded'")
        if self.density is not None and not 0.0 <= self.density <= 1.0:
            raise ValueError(f"density={self.density}: expected a fraction in [0, 1]")
        for k in ("params", "wire_bytes_per_param", "link_gb_s", "gather_gb_s"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k}={getattr(self, k)}: must be > 0")
        for k in ("engines", "engine_nics", "actor_ranks"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)}: must be >= 1")


def wire_bytes(s: SyncSetup) -> float:
    return s.params * s.wire_bytes_per_param


def sent_bytes(s: SyncSetup) -> float:
    full = wire_bytes(s)
    if s.density is None:
        return full
    index_value = s.params * s.density * (s.wire_bytes_per_param + INDEX_BYTES)
    bitmask_value = s.params / 8 + s.params * s.density * s.wire_bytes_per_param
    return min(full, index_value, bitmask_value)


def gather_s(s: SyncSetup) -> float:
    if s.topology == "sharded":
        return 0.0
    return wire_bytes(s) * (s.actor_ranks - 1) / s.actor_ranks / (s.gather_gb_s * 1e9)


def transfer_s(s: SyncSetup) -> float:
    senders = 1 if s.topology == "funnel" else s.actor_ranks
    sent = sent_bytes(s)
    return max(sent / (senders * s.link_gb_s * 1e9), sent / (s.engine_nics * s.link_gb_s * 1e9))


def sync_time(s: SyncSetup) -> dict[str, float]:
    """The parts and the total, in seconds, and the bytes through actor rank 0."""
    g, t = gather_s(s), transfer_s(s)
    senders = 1 if s.topology == "funnel" else s.actor_ranks
    return {
        "wire_bytes": wire_bytes(s),
        "sent_bytes": sent_bytes(s),
        "rank0_bytes": sent_bytes(s) / senders + (wire_bytes(s) * (s.actor_ranks - 1) / s.actor_ranks if g else 0.0),
        "gather_s": g,
        "transfer_s": t,
        "control_s": s.control_s,
        "sync_s": g + t + s.control_s,
    }


def control_from_runs(doc: dict[str, Any]) -> dict[str, Any]:
    """From a ``weight_sync_bench`` baseline document: of the runs with ``overhead_s`` for 1 and 2 engines (their
    ``idle`` condition where they have one), the one whose machine was least loaded at its start (the overhead is a
    difference of two medians, and load inflates it: 7 ms at load 0.4, 28 ms at load 5.6, measured) ->
    ``{"at1_s", "per_engine_s", "date", "command", "load_1m"}`` (slope clamped at 0: a noisy pair must not give a
    negative cost). A missing figure names the key."""
    found = []
    for i, run in enumerate(doc.get("runs") or [doc.get("latest", {})]):
        cond = run.get("idle", run)  # the idle condition where a run has one (harness --load)
        res = cond.get("results", {})
        if all("overhead_s" in res.get(f"engines{n}", {}) for n in (1, 2)):
            load = cond.get("load_start", run.get("load_start", {})).get("1m", float("inf"))
            found.append((load, -i, run, res))
    if not found:
        raise ValueError(f"{BASELINE.name}: no run has results.engines1.overhead_s and results.engines2.overhead_s")
    load, _, run, res = min(found, key=lambda f: f[:2])  # least loaded; the latest of equals
    at1, at2 = res["engines1"]["overhead_s"], res["engines2"]["overhead_s"]
    return {
        "at1_s": at1,
        "per_engine_s": max(0.0, at2 - at1),
        "date": run["date"],
        "command": run["command"],
        "load_1m": load,
    }


def control_for(engines: int, ctl: dict[str, Any]) -> float:
    return ctl["at1_s"] + (engines - 1) * ctl["per_engine_s"]


# The published figures the model is read against: (name, setup, published seconds, what they compare, source).
# Each figure is as issue 45 quotes it; the source names the original. Sizes: Kimi-K2 1.04T params, Qwen3-8B 8.2B,
# Qwen3-235B-A22B 235B (their model cards).
ANCHORS: list[tuple[str, SyncSetup, str, str]] = [
    (
        "our funnel, 1T bf16, one 50 GB/s NIC",
        SyncSetup(params=1e12, engines=16, engine_nics=8, actor_ranks=256, gather_gb_s=450.0),
        "~40 s",
        "issue 45's own arithmetic (2 TB / 50 GB/s)",
    ),
    (
        "Perplexity P2P RDMA, Kimi-K2 1T, 256 bf16 -> 128 fp8 GPUs",
        SyncSetup(params=1.04e12, engines=1, engine_nics=128, actor_ranks=256, topology="sharded"),
        "1.3 s",
        "Perplexity research blog, 'Weight transfer for RL post-training in under 2 seconds' (2025), as issue 45 "
        "quotes it; the model sends bf16 (2 B/param) where they write fp8 (1 B) on the receiver side",
    ),
    (
        "SGLang/Miles P2P, Kimi-K2 (vs one NCCL broadcast 53 s)",
        SyncSetup(params=1.04e12, engines=1, engine_nics=8, actor_ranks=64, topology="sharded"),
        "7.2 s (broadcast: 53 s)",
        "SGLang/Miles P2P weight update write-up, as issue 45 quotes it (engine and actor counts not given there: "
        "the row assumes 8 engine NICs, 64 actor ranks)",
    ),
    (
        "verl delta_sharded, Qwen3-8B (vs full 38.6 s)",
        SyncSetup(params=8.2e9, engines=1, engine_nics=1, actor_ranks=8, topology="sharded", density=0.03),
        "2.24 s (full: 38.6 s)",
        "verl delta_sharded weight sync, as issue 45 quotes it; density 3% from Miles/slime's '~3% per step at RL "
        "learning rates' (verl's own density not quoted)",
    ),
    (
        "verl delta_sharded, Qwen3-235B (vs full 246-266 s)",
        SyncSetup(params=235e9, engines=1, engine_nics=8, actor_ranks=64, topology="sharded", density=0.03),
        "11-15 s (full: 246-266 s)",
        "verl delta_sharded weight sync, as issue 45 quotes it; density as above",
    ),
    (
        "a 30B-A3B MoE (61 GB bf16), 2 engines, funnel, 25 GB/s",
        SyncSetup(params=30.5e9, engines=2, engine_nics=1, actor_ranks=8, link_gb_s=25.0, gather_gb_s=450.0),
        "(size only: 61 GB)",
        "issue 45 (Qwen3-30B-A3B's bf16 checkpoint size)",
    ),
]


def table(rows: list[tuple[str, SyncSetup, str, str]], ctl: dict[str, Any]) -> list[dict[str, Any]]:
    """Each anchor's setup with the measured control cost at its engine count, in four variants (funnel/sharded x
    full/delta at the anchor's density, 3% where it has none)."""
    out = []
    for name, setup, published, source in rows:
        setup = replace(setup, control_s=control_for(setup.engines, ctl))
        density = setup.density if setup.density is not None else 0.03
        variants = {
            f"{topo}_{send}": sync_time(replace(setup, topology=topo, density=None if send == "full" else density))
            for topo in ("funnel", "sharded")
            for send in ("full", "delta")
        }
        out.append({"name": name, "setup": asdict(setup), "published": published, "source": source, **variants})
    return out


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"{'setup':58s} {'funnel full':>12s} {'funnel delta':>12s} {'sharded full':>12s} {'sharded delta':>13s}")
    for r in rows:
        cells = [f"{r[k]['sync_s']:11.3g}s" for k in ("funnel_full", "funnel_delta", "sharded_full")]
        print(f"{r['name'][:58]:58s} {' '.join(cells)} {r['sharded_delta']['sync_s']:12.3g}s")
        print(f"{'':4s}published: {r['published']}; source: {r['source']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, help="one setup: parameters (else the anchors' table)")
    ap.add_argument("--wire-bytes-per-param", type=float, default=2.0)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--engine-nics", type=int, default=1)
    ap.add_argument("--actor-ranks", type=int, default=8)
    ap.add_argument("--link-gb-s", type=float, default=50.0)
    ap.add_argument("--gather-gb-s", type=float, default=50.0)
    ap.add_argument("--density", type=float, default=0.03, help="the delta variants' density")
    ap.add_argument("--control-ms", type=float, help="override the measured control cost (per sync, any engines)")
    a = ap.parse_args(argv)
    ctl = control_from_runs(json.loads(BASELINE.read_text()))
    if a.control_ms is not None:
        ctl = {
            "at1_s": a.control_ms / 1e3,
            "per_engine_s": 0.0,
            "date": None,
            "command": "--control-ms",
            "load_1m": None,
        }
    print(
        f"control cost: {ctl['at1_s'] * 1e3:.2f} ms at 1 engine + {ctl['per_engine_s'] * 1e3:.2f} ms per further "
        f"engine (overhead_s, median sync - median bare, of {BASELINE.name} run {ctl['date']} at load {ctl['load_1m']}: {ctl['command']})"
    )
    if a.params:
        setup = SyncSetup(
            params=a.params,
            wire_bytes_per_param=a.wire_bytes_per_param,
            engines=a.engines,
            engine_nics=a.engine_nics,
            actor_ranks=a.actor_ranks,
            link_gb_s=a.link_gb_s,
            gather_gb_s=a.gather_gb_s,
            density=a.density,
        )
        rows = table([("--params setup", setup, "-", "command line")], ctl)
    else:
        rows = table(ANCHORS, ctl)
    _print(rows)
    print(json.dumps({"benchmark": "sync_model", "control": ctl, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
