"""An event-driven simulator of the async loop around the broker core, fast enough for 1,000 engines.

It drives ``asyncrl.broker.core.BrokerCore`` (the class the broker process runs) with a simulated
clock; only the engines, the agent workers' multi-turn trajectories, the tools and the trainer are
modelled:
- an engine runs up to ``max_running`` requests (more wait in its queue, FIFO) and shares its token
  rate among them (processor sharing): ``T(r) = peak_tok_s x r / (r + c_half)``, the curve fitted to
  the CPU engine's measured tokens/s at concurrency 1..64 (``benchmarks/engine_curve.py``; within
  about 10% at every level), or a measured table (``EngineModel``); a weight sync pauses every
  engine for ``sync_s``;
- a trajectory has 1..``max_turns`` turns, lognormal tokens per turn, and a tool call between turns
  (uniform latency, plus a share ``tool_tail_p`` of slow calls with lognormal latency, the long tail);
- the trainer asks for a batch, trains ``train_s``, syncs, and asks again (``runner.async_mode``).
Engines are pooled behind at most ``MAX_WORKERS`` broker workers (each pool routes to its
least-loaded engine). A 1,000-engine generation-bound run takes about 0.5 s of CPU a step (3.7 s
for 8 steps, measured): its cost is the events themselves (about two engine events per turn, each a heap operation), not the core's per-event work.
The engines report their figures (running, queued, generated tokens/s) every ``report_s`` as the
actor's scraper does, through ``BrokerCore.engine_figures``.

    r = simulate(SimConfig(engines=8, batch=16, inflight="auto"), Workload())
    r.throughput_groups_s, r.mean_staleness(), r.limits      # per-step in-flight limits

As a sizing tool (the trainer's TOML plus measured speeds):

    python -m asyncrl.simulate configs/tiny.toml --engine-tok-s 900 --train-s 1.2 --quick
    python -m asyncrl.simulate configs/tiny.toml --engine-curve benchmarks/baselines/engine_curve.json --train-s 1.2
"""

from asyncrl.simulate.cli import EngineArgs, from_config, main
from asyncrl.simulate.engine_model import EngineModel, curve_fit_report, fit_saturation, load_curve, saturation_tok_s
from asyncrl.simulate.loop import MAX_WORKERS, SimConfig, SimResult, Workload, simulate, sweep

__all__ = [
    "MAX_WORKERS",
    "EngineArgs",
    "EngineModel",
    "SimConfig",
    "SimResult",
    "Workload",
    "curve_fit_report",
    "fit_saturation",
    "from_config",
    "load_curve",
    "main",
    "saturation_tok_s",
    "simulate",
    "sweep",
]
