"""Periodic evaluation during training: Miles' eval backends, the snapshot pipeline and the dispatcher.

Contract
- Backend (``select_backend``): ``shared`` when neither ``eval.eval_num_gpus`` nor
  ``eval.eval_function_path`` is set; ``external`` with ``eval.eval_function_path = "module:Class"``
  (a ``CheckpointEvalFn`` subclass); ``fleet`` with ``eval.eval_num_gpus = N`` (engines of their own on
  the ``eval`` placement devices, ``asyncrl.eval.fleet``). Evals run on every
  ``eval.eval_interval``-th step.
- Shared engines (``evaluate_on_engines``): actor rank 0 tells the broker ``hold_issuing`` (no new
  prompts; in-flight groups finish and buffer, nothing is aborted, turns go on), evaluates every
  dataset greedily on the rollout engines, then ``release_issuing``. Blocking: the point lands at its
  step. Metrics ``eval/<name>/{accuracy,response_len,num_turns,...}`` and ``eval/time_seconds``.
- Shared engines and fleet evaluate the first ``eval.max_samples`` prompts of each dataset (0 = all; the
  before/after eval too). The evaluator checks its tool URL when built (``check_retriever``, role named);
  a trajectory whose tool failed, or all of them aborted, make the eval raise ``EvalError`` naming the
  cause (never a lower accuracy).
- Fleet: exactly as external (same snapshot sources, dispatcher, lag/overflow/GC semantics), with the
  built-in job ``FleetEval`` in place of the user's function: every fleet engine loads the snapshot
  (``/update_weights_from_disk``), then the datasets are evaluated greedily against the fleet; metrics
  as the shared engines' plus ``eval/fleet/*``. Training never pauses for it.
- External: the trainer owns dispatch, logging and garbage collection. At an eval step the snapshot
  is either a fresh HF export into ``eval.eval_hf_dir/step_XXXXXX`` (collective over every actor
  rank, the one part the training loop waits for: ``eval/export_time_seconds``) or, with
  ``eval_hf_dir`` unset and ``runner.save_hf``, the periodic checkpoint's ``hf_export``.
  ``EvalDispatcher`` (``asyncrl.eval.dispatch``) runs ``evaluate_checkpoint`` on ONE background thread (evals are serialized);
  ``eval.eval_max_in_flight`` bounds the snapshots submitted and not yet finished. A due point with no
  free slot waits (``backpressure``, at most ``eval.eval_wait_timeout_s``) or is skipped (``skip``:
  counted in ``eval/skipped``, reason logged). ``EvalSkip(reason)`` is a skipped point; any other
  exception is logged with its traceback and counted in ``eval/errors``; training goes on. Results
  are logged at their eval step with ``eval/lag_steps`` = the step at which they were logged minus
  it.
- Skipped points (Miles' names), logged at the step they would have landed on with value 1:
  ``eval/skipped_busy`` (no slot under ``skip``), ``eval/skipped_export_failed`` (the fresh export raised;
  training goes on), ``eval/skipped_ckpt_missing`` (the snapshot has no completion marker: ``snapshot.json``
  of a fresh export, the checkpoint's ``meta.json`` of a reused ``hf_export``), ``eval/skipped_crashed``
  (the eval raised anything else), ``eval/skipped_<reason>`` (``EvalSkip(reason)``, reason made a metric name).
- Every point that ran logs ``eval/step`` and, per dataset, ``eval/<name>/weight_version/mean`` and
  ``eval/<name>/weight_version/mixed_version_ratio``: the snapshot's recorded weight version for the
  checkpoint backends (external, fleet), the versions the shared engines stamped on the eval's tokens. Snapshots the pipeline exported are retired on every outcome and at most
  ``eval.eval_keep_snapshots`` retired ones stay on disk; periodic checkpoints are never deleted.
- At the end of the run ``close`` waits (bounded) for pending evals so their points are logged.

    disp = EvalDispatcher(fn, max_in_flight=2, overflow_policy="backpressure", keep_snapshots=2)
    if disp.admit(step): disp.submit(step, export_snapshot(actor, root, step))
    for out in disp.poll(): writer.log(outcome_metrics(out, logged_at=current_step), out.step)
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from asyncrl.actor.checkpoint import CheckpointManager
from asyncrl.agent.data.loaders import load_prompts
from asyncrl.agent.envs import get_env, load_reward, make_tools, tool_specs
from asyncrl.agent.loop import AgentLoop, EngineHandle, summarize_eval
from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.agent.tools import check_retriever, make_retriever
from asyncrl.config.validate import resolve_hook as import_path
from asyncrl.engine.client import SGLangClient
from asyncrl.eval.dispatch import SNAPSHOT_META, EvalDispatcher, EvalOutcome, outcome_metrics
from asyncrl.eval.dispatch import EvalSkip as EvalSkip  # the eval function's API: raised to skip a point

log = logging.getLogger("asyncrl.eval")


@dataclass(frozen=True)
class EvalInput:
    """What an eval function gets with the snapshot path."""

    step: int
    """The training step (= weight version) whose weights the snapshot holds."""
    datasets: dict[str, str]
    """Dataset name -> prompts path (``eval.eval_prompt_data``, else ``{"test": data.test_path}``)."""
    cfg: Any
    """The run's resolved ``asyncrl.config.Config`` (the real training settings)."""


class CheckpointEvalFn:
    """Base class of an external eval backend (``eval.eval_function_path = "module:Class"``).

    Built once per run as ``Class(cfg)`` on actor rank 0; ``evaluate_checkpoint`` is called on a
    background thread, one snapshot at a time, with a directory that loads as a HF checkpoint
    (``model.safetensors`` + config + tokenizer). Return ``{name: value}`` (logged as ``eval/<name>``
    at ``input.step``); raise ``EvalSkip(reason)`` to skip the point. Do not keep the directory: it is
    deleted once retired.
    """

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> dict[str, float]:  # noqa: A002
        raise NotImplementedError

    def close(self) -> None:
        """Called once at the end of the run (release servers, files)."""


def load_eval_fn(path: str, cfg: Any) -> CheckpointEvalFn:
    cls = import_path(path, "eval.eval_function_path")
    if not (isinstance(cls, type) and issubclass(cls, CheckpointEvalFn)):
        raise ValueError(
            f"eval.eval_function_path: {path!r} is not a CheckpointEvalFn subclass "
            f"(asyncrl.eval.backends.CheckpointEvalFn)"
        )
    return cls(cfg)


def select_backend(cfg: Any) -> Optional[Literal["shared", "external", "fleet"]]:
    """Which backend runs the periodic eval (None: no ``eval.eval_interval``)."""
    e = cfg.eval
    if e.eval_interval is None:
        return None
    if e.eval_function_path:
        return "external"
    if e.eval_num_gpus:
        return "fleet"
    return "shared"


def eval_datasets(cfg: Any) -> dict[str, str]:
    """``eval.eval_prompt_data``, else the held-out ``data.test_path`` as ``test`` (empty: nothing to evaluate)."""
    if cfg.eval.eval_prompt_data:
        return dict(cfg.eval.eval_prompt_data)
    return {"test": cfg.data.test_path} if cfg.data.test_path else {}


def is_eval_step(step: int, interval: Optional[int]) -> bool:
    return bool(interval) and step % interval == 0


# ------------------------------------------------------------------------------------------- shared engines
class EngineEvaluator:
    """Greedy eval of several datasets on the rollout engines (tokenizer, retriever and prompts built once)."""

    def __init__(self, cfg: Any, engine_urls: list[str], *, tokenizer_path: str, role: str = "actor rank 0 (eval)"):
        self.cfg, self.engine_urls = cfg, engine_urls
        self.tokenizer = AgentTokenizer.from_pretrained(tokenizer_path)
        self.env = get_env(cfg.agentloop.task_name)
        self.reward = load_reward(cfg.agentloop.reward_path) if cfg.agentloop.reward_path else None
        self.specs = tool_specs(cfg, self.env)
        self.retriever = None
        if "search" in self.specs:
            self.retriever = make_retriever(cfg.agentloop.tool)
            check_retriever(cfg.agentloop.tool, role=role)  # an unreachable tool URL fails here, not as accuracy 0
        self._items: dict[str, list] = {}

    def items(self, name: str, path: str) -> list:
        """The dataset's prompts, the first ``eval.max_samples`` of them (0 = all)."""
        if name not in self._items:
            items = load_prompts(path)
            n = self.cfg.eval.max_samples
            self._items[name] = items[:n] if n else items
        return self._items[name]

    def evaluate(self, datasets: dict[str, str]) -> dict[str, dict]:
        """``{name: summary}``; a summary has accuracy (mean greedy reward), response_len, num_turns, ..."""
        cfg = self.cfg

        async def run() -> dict[str, dict]:
            clients = [SGLangClient.from_config(u, cfg.rollout) for u in self.engine_urls]
            tools: dict = {}
            try:
                tools = await make_tools(self.specs, cfg, retriever=self.retriever)
                loop = AgentLoop(
                    env=self.env,
                    tokenizer=self.tokenizer,
                    tools=tools,
                    reward=self.reward,
                    agent_cfg=cfg.agentloop,
                    sampling=cfg.rollout.sampling,
                    rid_prefix="eval",
                )
                handles = [
                    EngineHandle(c, max_in_flight=cfg.agentloop.max_requests_per_engine, url=u)
                    for c, u in zip(clients, self.engine_urls)
                ]
                out = {}
                for name, path in datasets.items():
                    items = self.items(name, path)
                    trajs = await asyncio.gather(
                        *(
                            loop.run_trajectory(it, handles[k % len(handles)], greedy=True, rid=f"{name}{k}")
                            for k, it in enumerate(items)
                        )
                    )
                    raise_tool_failures(trajs, name)
                    summary = summarize_eval(trajs, reward_name=self.env.reward_name)
                    done = [t for t in trajs if not t.aborted]
                    summary["response_len"] = sum(len(t.response_ids) for t in done) / len(done) if done else 0.0
                    summary.update(weight_version_summary(done))
                    out[name] = summary
                return out
            finally:
                for c in clients:
                    await c.close()
                for t in tools.values():  # the search tool's retriever serves the next eval too
                    if t.name != "search":
                        await t.close()

        return asyncio.run(run())


class EvalError(RuntimeError):
    """The eval could not measure what it reports (a tool or every engine call failed); names the cause."""


def weight_version_summary(trajs: list) -> dict[str, float]:
    """Mean weight version of the trajectories' tokens, and the share of trajectories generated under more
    than one version (Miles' ``weight_version/mean`` and ``mixed_version_ratio``)."""
    if not trajs:
        return {}
    gen = [[v for v in t.weight_versions if v >= 0] for t in trajs]  # tool tokens carry -1: not generated
    means = [sum(g) / len(g) if g else float(t.min_version) for g, t in zip(gen, trajs)]
    mixed = sum(t.min_version != t.max_version for t in trajs)
    return {"weight_version_mean": sum(means) / len(means), "mixed_version_ratio": mixed / len(trajs)}


def raise_tool_failures(trajs: list, dataset: str) -> None:
    """An eval whose tool failed, or whose every trajectory aborted, is an error (naming the URL), never a
    lower accuracy: aborted trajectories are left out of the accuracy, and a dead retriever aborts them all."""
    tool = [t for t in trajs if t.aborted and t.extra.get("error_kind") == "tool"]
    if tool:
        raise EvalError(
            f"eval of {dataset!r}: {len(tool)} of {len(trajs)} trajectories lost their tool: "
            f"{tool[0].error} (agentloop.tool)"
        )
    if trajs and all(t.aborted for t in trajs):
        raise EvalError(f"eval of {dataset!r}: all {len(trajs)} trajectories aborted: {trajs[0].error}")


def engine_eval_metrics(results: dict[str, dict]) -> dict[str, float]:
    """``{name: summary}`` -> ``eval/<name>/<reward name>`` (``accuracy`` for Search-R1, else ``mean_reward`` or the
    environment's own), ``response_len``, ``num_turns``, ``num_tool_calls``, ..., ``env/<metric>``."""
    keys = {
        "response_len": "response_len",
        "mean_turns": "num_turns",
        "mean_tool_calls": "num_tool_calls",
        "answer_rate": "answer_rate",
        "num_prompts": "num_prompts",
        "num_aborted": "num_aborted",
        "weight_version_mean": "weight_version/mean",
        "mixed_version_ratio": "weight_version/mixed_version_ratio",
    }
    out = {}
    for name, summary in results.items():
        reward = summary.get("reward_name", "accuracy")
        for src, dst in {reward: reward, **keys}.items():
            if src in summary:
                out[f"eval/{name}/{dst}"] = float(summary[src])
        out.update((f"eval/{name}/{k}", float(v)) for k, v in summary.items() if k.startswith("env/"))
    return out


def evaluate_on_engines(broker: Any, evaluator: EngineEvaluator, datasets: dict[str, str]) -> dict[str, float]:
    """The blocking shared-engine eval: the broker stops issuing new prompts meanwhile (always released)."""
    t0 = time.perf_counter()
    broker.hold_issuing()
    try:
        results = evaluator.evaluate(datasets)
    finally:
        broker.release_issuing()
    m = engine_eval_metrics(results)
    m["eval/time_seconds"] = time.perf_counter() - t0
    return m


# ------------------------------------------------------------------------------------------- the runner's side
class PeriodicEval:
    """What the step loop calls, on EVERY actor rank (the fresh export is collective).

    ``after_step(step)`` (after the step's weight sync and checkpoint) returns the metrics to add to the
    step's record (shared: the eval itself; external: ``eval/export_time_seconds`` and overflow skips);
    ``late_points(step)`` / ``finish(last_step)`` return ``[(eval_step, metrics)]`` of external/fleet points that
    finished since, each to be logged at its own eval step. Non-leader ranks get empty results.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        actor: Any,
        is_leader: bool,
        broker: Any = None,
        engine_evaluator: Optional[EngineEvaluator] = None,
        checkpoints: Optional[CheckpointManager] = None,
        bcast: Callable[[Any], Any] = lambda x: x,
        fleet_eval: Optional[Callable[[str, int], dict]] = None,
        leader_phase: Optional[Callable[..., Any]] = None,
    ):
        """``leader_phase(name, fn, timeout_s=...)`` runs ``fn`` on the leader while the other actor ranks wait
        outside any collective (``asyncrl.trainer.leader_phases.LeaderPhases.run``; default: ``fn`` on the leader).
        ``fleet_eval``: the leader's ``(snapshot_dir, step) -> metrics`` for the ``fleet`` backend
        (``asyncrl.eval.fleet.FleetEval``)."""
        self.cfg, self.actor, self.is_leader, self.broker = cfg, actor, is_leader, broker
        self._phase = leader_phase or (lambda name, fn, timeout_s=None: fn() if is_leader else None)
        self.backend = select_backend(cfg)
        self.interval = cfg.eval.eval_interval
        self.datasets = eval_datasets(cfg)
        self.engine_evaluator = engine_evaluator
        self.checkpoints = checkpoints
        self._bcast = bcast
        self.fn: Optional[CheckpointEvalFn] = None
        self.dispatcher: Optional[EvalDispatcher] = None
        if self.backend == "shared" and is_leader:
            assert engine_evaluator is not None and broker is not None
        if self.backend in ("external", "fleet") and is_leader:
            e = cfg.eval
            if self.backend == "fleet":
                assert fleet_eval is not None, "the fleet backend needs its FleetEval"
                evaluate: Callable[[str, int], dict] = fleet_eval
            else:
                self.fn = load_eval_fn(e.eval_function_path, cfg)
                evaluate = self._evaluate
            self.dispatcher = EvalDispatcher(
                evaluate,
                max_in_flight=e.eval_max_in_flight,
                overflow_policy=e.eval_overflow_policy,
                keep_snapshots=e.eval_keep_snapshots,
                wait_timeout_s=e.eval_wait_timeout_s,
            )

    def _evaluate(self, checkpoint_dir: str, step: int) -> dict:
        assert self.fn is not None
        return self.fn.evaluate_checkpoint(checkpoint_dir, EvalInput(step, dict(self.datasets), self.cfg))

    def after_step(self, step: int) -> dict[str, float]:
        if not is_eval_step(step, self.interval):
            return {}
        if self.backend == "shared":
            return self._phase(f"eval at step {step} on the shared engines", lambda: self._shared(step)) or {}
        return self._external(step)

    def _shared(self, step: int) -> dict[str, float]:
        m = evaluate_on_engines(self.broker, self.engine_evaluator, self.datasets)
        m["eval/lag_steps"] = 0.0
        m["eval/step"] = float(step)
        log.info(
            "eval at step %d on the shared engines: %s",
            step,
            {k: round(v, 4) for k, v in m.items() if k.endswith(("/accuracy", "/mean_reward"))},
        )
        return m

    def _external(self, step: int) -> dict[str, float]:
        e, disp = self.cfg.eval, self.dispatcher
        # every rank: export or not; the leader may wait for a slot (backpressure) while the others wait outside
        # any collective
        admitted = self._bcast(
            self._phase(f"eval slot for step {step}", lambda: disp.admit(step), timeout_s=e.eval_wait_timeout_s)
        )
        if not admitted:
            return {"eval/skipped": float(disp.num_skipped), "eval/skipped_busy": 1.0} if self.is_leader else {}
        if e.eval_hf_dir:
            t0 = time.perf_counter()
            try:
                d = export_snapshot(self.actor, e.eval_hf_dir, step, is_leader=self.is_leader)
            except Exception:  # noqa: BLE001 - a failed export is a skipped point, never the end of the run
                log.error(
                    "eval point of step %d skipped: the snapshot export into %s raised; training goes on:\n%s",
                    step,
                    e.eval_hf_dir,
                    traceback.format_exc(),
                )
                if not self.is_leader:
                    return {}
                disp.num_skipped += 1
                return {"eval/skipped": float(disp.num_skipped), "eval/skipped_export_failed": 1.0}
            m = {"eval/export_time_seconds": time.perf_counter() - t0}
            owned = True
        else:
            assert self.checkpoints is not None, "reusing the checkpoints' hf_export needs the checkpoint manager"
            d, m, owned = self.checkpoints.hf_export(step), {}, False
        if self.is_leader:
            disp.submit(step, d, owned=owned)
            return m
        return {}

    def late_points(self, logged_at: int) -> list[tuple[int, dict[str, float]]]:
        if self.dispatcher is None:
            return []
        return self._points(self.dispatcher.poll(), logged_at)

    def _points(self, outcomes: list[EvalOutcome], logged_at: int) -> list[tuple[int, dict[str, float]]]:
        disp = self.dispatcher
        out = []
        for o in outcomes:
            m = outcome_metrics(
                o,
                logged_at=logged_at,
                num_skipped=disp.num_skipped,
                num_errors=disp.num_errors,
                datasets=list(self.datasets),
            )
            log.info(
                "eval point of step %d (%s, logged at step %d): %s%s",
                o.step,
                o.status,
                logged_at,
                {k: round(v, 4) for k, v in o.metrics.items()},
                f" ({o.reason})" if o.reason else "",
            )
            out.append((o.step, m))
        return out

    def finish(self, last_step: int) -> list[tuple[int, dict[str, float]]]:
        """Wait (bounded by ``eval.eval_wait_timeout_s``) for pending external evals; their points."""
        if self.dispatcher is None:
            return []
        try:
            return self._points(self.dispatcher.close(), last_step)
        finally:
            if self.fn is not None:
                self.fn.close()


# ------------------------------------------------------------------------------------------- snapshots
def snapshot_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def export_snapshot(actor: Any, root: str | Path, step: int, *, is_leader: bool) -> Path:
    """A fresh HF export of the actor's weights into ``root/step_XXXXXX`` (collective: every actor rank
    calls it). Rank 0 writes ``snapshot.json`` last, so a directory without it is incomplete."""
    d = snapshot_dir(root, step)
    cleanup_error: Optional[OSError] = None
    if is_leader and d.exists():  # a left-over of an interrupted run at the same step
        try:
            shutil.rmtree(d)
        except OSError as e:  # raised after the collective: the other ranks must not wait in it alone
            cleanup_error = e
    actor.export_hf(d)
    if cleanup_error is not None:
        raise cleanup_error
    if is_leader:
        (d / SNAPSHOT_META).write_text(json.dumps({"step": step, "weight_version": int(actor.version)}) + "\n")
    return d
