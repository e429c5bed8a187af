"""The multi-turn agent loop: token in, token out, against one engine per trajectory.

Contract
- Wires: a task (prompt, action parser, observation format, reward), a tokenizer, a retriever and
  an engine (``EngineHandle``: SGLang ``/generate`` through a client, with a semaphore bounding the
  generate calls in flight on that engine). The agent worker calls ``AgentLoop.run_group``; the
  end-to-end summary calls ``AgentLoop.evaluate``.
- Invariant: ``prompt_ids + response_ids`` is exactly the prompt tokenized once, then each turn's
  ``output_ids`` as the engine returned them (loss mask 1, their rollout log-probs and weight
  versions), then each tool observation tokenized (loss mask 0, log-prob 0.0, version -1), in
  order. Generated ids are decoded only to parse actions, never re-encoded. All turns of a
  trajectory go to the same engine (its prefix cache).
- Limits: ``agentloop.max_turns`` generate calls; ``max_tokens_per_turn`` per call;
  ``max_total_tokens`` for prompt + response: a generate call never asks for more than fits, and
  an observation that would leave no room for another generated token is not appended; either
  way the trajectory ends ``truncated`` with finish reason ``length``.
- Failures: a generate call that fails (connection, timeout, HTTP error, malformed reply) or a
  retrieval that fails after its retries makes the trajectory ``aborted`` with an error naming
  the URL; it is never scored. A group with an aborted trajectory is aborted (the broker retries
  it). A retriever outage (``HttpRetriever`` with ``agentloop.tool.max_outage_s``) instead holds every new
  turn until the retriever answers (``wait_available``), and past the outage budget raises
  ``RetrieverOutageError`` out of the group (the worker fails, naming the URL); a finished trajectory's
  ``extra["tool_errors"]`` counts its failed retrieval attempts. An engine-side ``abort`` finish (pause mode ``abort``) keeps the partial output and
  re-issues the rest of the turn, a bounded number of times.
- Routing replay (``routed_experts=True``: ``actor.moe_routing_replay``): every ``/generate`` asks for the routed
  experts of the positions not yet known (``routed_experts_start_len`` = the positions known so far), so each
  position's experts are those the engine used when it computed that position (a sampled token's were what
  sampled the next one; a tool observation's come from the next turn's prefill), and each reply carries only
  new rows. The trajectory's ``routed_experts`` holds them, one row per position; the last position (the engine
  never routes it: nothing follows it in any request) is -1. A reply without them aborts the trajectory.

    loop = AgentLoop(task=get_task("searchr1"), tokenizer=tok, retriever=retriever,
                     agent_cfg=cfg.agentloop, sampling=cfg.rollout.sampling)
    engine = EngineHandle(client, max_in_flight=32)
    group = await loop.run_group(group, engine, on_trajectory=lambda i, t: ...)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from asyncrl.agent.engine_handle import EngineHandle
from asyncrl.agent.tasks import Task
from asyncrl.agent.tools import Retriever, RetrieverError, RetrieverOutageError
from asyncrl.broker.types import Group, PromptItem, Trajectory
from asyncrl.config.schema import AgentLoopConfig, SamplingConfig
from asyncrl.engine.client import EngineError

log = logging.getLogger(__name__)

__all__ = ["AgentLoop", "EngineError", "EngineHandle", "TrajectoryBuilder", "TurnGate", "summarize_eval"]

# Consecutive engine-side aborts of one turn that returned no new token before the trajectory
# gives up (an engine stuck aborting would otherwise spin forever).
MAX_ABORTS_WITHOUT_PROGRESS = 3


# ---------------------------------------------------------------- gate (drain)


class TurnGate:
    """Holds new turns while closed (``pause_mode = "drain"``: no new generate calls start)."""

    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self._num_waiting = 0

    @property
    def num_waiting(self) -> int:
        """Turns held at the gate right now (observable, e.g. by a test waiting for a turn to reach it)."""
        return self._num_waiting

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        if not self._open.is_set():
            self._num_waiting += 1
            try:
                await self._open.wait()
            finally:
                self._num_waiting -= 1


# ---------------------------------------------------------------- the trajectory accumulator (pure)


@dataclass
class TrajectoryBuilder:
    """Keeps ids, masks, log-probs and versions aligned; knows the room left."""

    prompt_ids: list[int]
    max_total_tokens: int
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: Optional[list[np.ndarray]] = None
    """Routing replay: the routed experts of positions ``0 .. routed_len - 1``, one array per reply (None: off)."""
    routed_len: int = 0

    @property
    def room(self) -> int:
        return self.max_total_tokens - len(self.prompt_ids) - len(self.response_ids)

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        assert len(ids) == len(logprobs) == len(versions)
        self.response_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def add_tool(self, ids: Sequence[int]) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def add_routed(self, rows: np.ndarray) -> None:
        """The routed experts of the next ``len(rows)`` positions."""
        self.routed.append(rows)
        self.routed_len += len(rows)

    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def routed_experts(self) -> Optional[np.ndarray]:
        """One row per position (-1 where unknown: the last position), or None (off, or no row known)."""
        rows = [r for r in self.routed or () if r.size]
        if not rows:
            return None
        out = np.full((len(self.prompt_ids) + len(self.response_ids), rows[0].shape[1]), -1, np.int32)
        out[: self.routed_len] = np.concatenate(rows)
        return out

    def build(self, **fields: Any) -> Trajectory:
        gen_versions = [v for v in self.versions if v >= 0]
        return Trajectory(
            prompt_ids=list(self.prompt_ids),
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            rollout_logprobs=self.logprobs,
            weight_versions=self.versions,
            min_version=min(gen_versions, default=0),
            max_version=max(gen_versions, default=0),
            routed_experts=self.routed_experts(),
            **fields,
        )


# ---------------------------------------------------------------- the loop


@dataclass
class _Run:
    """One trajectory's running state (``AgentLoop.run_trajectory``)."""

    b: TrajectoryBuilder
    t_start: float = field(default_factory=time.perf_counter)
    stats: dict = field(default_factory=lambda: {"generate_s": 0.0, "tool_s": 0.0})
    tool: dict = field(default_factory=dict)
    """Failed retrieval attempts of this trajectory (``tool/errors``)."""
    turn_finishes: list[str] = field(default_factory=list)
    gen_texts: list[str] = field(default_factory=list)
    num_turns: int = 0
    num_tool_calls: int = 0
    num_retractions: int = 0
    finish_reason: str = ""
    truncated: bool = False


class AgentLoop:
    def __init__(
        self,
        *,
        task: Task,
        tokenizer: Any,
        retriever: Retriever,
        agent_cfg: AgentLoopConfig,
        sampling: SamplingConfig,
        gate: Optional[TurnGate] = None,
        rid_prefix: str = "agent",
        routed_experts: bool = False,
    ):
        self.task = task
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.cfg = agent_cfg
        self.sampling = sampling
        self.gate = gate or TurnGate()
        self.rid_prefix = rid_prefix
        self.routed_experts = routed_experts
        self._rids = itertools.count()
        self._invalid_ids = tokenizer.encode(task.invalid_action_message)
        self._obs_tail_ids = tokenizer.encode(getattr(task, "observation_tail", ""))
        self._eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._encode_prompt = tokenizer.prefix_encoder(self._template_head())

    def _template_head(self) -> str:
        """The text every prompt of this task starts with (the template before the question): the common start
        of two prompts built from different questions."""
        a, b = (self._prompt_text(q) for q in ("a", "b"))
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[:n]

    def _prompt_text(self, question: str) -> str:
        return self.task.build_prompt(question, chat_template=self.cfg.chat_template, tokenizer=self.tokenizer)

    # -- pieces
    def prompt_ids(self, item: PromptItem) -> list[int]:
        """``tokenizer.encode`` of the prompt text; the template's fixed head is tokenized once
        (``AgentTokenizer.prefix_encoder``: the same ids)."""
        return self._encode_prompt(self._prompt_text(item.prompt))

    def sampling_params(self, max_new_tokens: int, *, greedy: bool = False) -> dict:
        params: dict[str, Any] = {
            "max_new_tokens": int(max_new_tokens),
            "temperature": 0.0 if greedy else float(self.sampling.temperature),
            "top_p": 1.0 if greedy else float(self.sampling.top_p),
            "stop": list(self.task.stop),
        }
        if self.sampling.top_k > 0 and not greedy:
            params["top_k"] = int(self.sampling.top_k)
        return params

    def observation_ids(self, docs: Sequence[dict]) -> list[int]:
        """The information block, tokenized, cut to ``max_obs_tokens`` keeping its closing tag."""
        ids = self.tokenizer.encode(self.task.format_observation(docs))
        limit = self.cfg.tool.max_obs_tokens
        if len(ids) <= limit:
            return ids
        tail = self._obs_tail_ids if len(self._obs_tail_ids) < limit else []
        if tail:
            text = self.task.format_observation(docs)
            head_text = text[: len(text) - len(self.task.observation_tail)]
            return self.tokenizer.encode(head_text)[: limit - len(tail)] + tail
        return ids[:limit]

    def _new_rid(self, prefix: str) -> str:
        return f"{self.rid_prefix}-{prefix}-{next(self._rids)}"

    # -- one trajectory
    async def run_trajectory(
        self,
        item: PromptItem,
        engine: EngineHandle,
        *,
        prompt_ids: Optional[list[int]] = None,
        greedy: bool = False,
        rid: str = "t",
    ) -> Trajectory:
        run = _Run(
            TrajectoryBuilder(
                list(prompt_ids if prompt_ids is not None else self.prompt_ids(item)),
                self.cfg.max_total_tokens,
                routed=[] if self.routed_experts else None,
            )
        )
        try:
            await self._turns(run, engine, greedy=greedy, rid=rid)
        except EngineError as exc:
            return self._aborted(run, str(exc))
        except RetrieverOutageError:  # fatal: the worker stops and the run fails naming the URL
            raise
        except RetrieverError as exc:  # marked: an eval must fail on it, not count it as a wrong answer
            return self._aborted(run, str(exc), kind="tool")
        run.stats["total_s"] = time.perf_counter() - run.t_start
        return run.b.build(
            reward=float(self.task.reward("".join(run.gen_texts), item.answers)),
            num_turns=run.num_turns,
            num_tool_calls=run.num_tool_calls,
            num_retractions=run.num_retractions,
            finish_reason=run.finish_reason,
            truncated=run.truncated,
            timings=run.stats,
            extra={
                "turn_finish_reasons": run.turn_finishes,
                "engine": engine.url,
                "tool_errors": run.tool.get("tool_errors", 0),
            },
        )

    async def _turns(self, run: _Run, engine: EngineHandle, *, greedy: bool, rid: str) -> None:
        """Generate, parse, call the tool, append its observation, until a finish (set on ``run``)."""
        b = run.b
        for turn in range(self.cfg.max_turns):
            if b.room <= 0:
                run.finish_reason, run.truncated = "length", True
                return
            max_new = min(self.cfg.max_tokens_per_turn, b.room)
            ids, finish_type, matched, retractions = await self._generate_turn(
                b, engine, max_new, greedy=greedy, rid=f"{rid}-t{turn}", stats=run.stats
            )
            run.num_turns += 1
            run.num_retractions += retractions
            run.turn_finishes.append(finish_type)
            text = self.tokenizer.decode(ids)
            run.gen_texts.append(text)
            action = self.task.parse_action(text)
            finish = self._turn_finish(action.kind, finish_type, matched, max_new, last=turn == self.cfg.max_turns - 1)
            if finish is not None:
                run.finish_reason, run.truncated = finish
                return
            if action.kind == "search":
                t0 = time.perf_counter()
                docs = (await self.retriever.retrieve([action.content], self.cfg.tool.topk, stats=run.tool))[0]
                run.stats["tool_s"] += time.perf_counter() - t0
                run.num_tool_calls += 1
                obs = self.observation_ids(docs)
            else:
                obs = self._invalid_ids
            if len(obs) + 1 > b.room:
                run.finish_reason, run.truncated = "length", True
                return
            b.add_tool(obs)

    def _turn_finish(
        self, action_kind: str, finish_type: str, matched: Any, max_new: int, *, last: bool
    ) -> Optional[tuple[str, bool]]:
        """(finish reason, truncated) when the trajectory ends after this turn, else None (a tool turn follows)."""
        if action_kind == "answer":
            return "answer", False
        if finish_type == "stop" and isinstance(matched, int) and (matched in self._eos or not self._eos):
            return "eos", False
        if finish_type == "length" and max_new < self.cfg.max_tokens_per_turn:
            return "length", True  # the total limit, not the per-turn one
        if last:
            return "max_turns", False
        return None

    async def _generate_turn(
        self, b: TrajectoryBuilder, engine: EngineHandle, max_new: int, *, greedy: bool, rid: str, stats: dict
    ) -> tuple[list[int], str, Any, int]:
        """One turn: generate (re-issuing after engine-side aborts) and append the output."""
        turn_ids: list[int] = []
        retractions = 0
        aborts_without_progress = 0
        attempt = 0
        while True:
            await self.gate.wait_open()
            await self.retriever.wait_available()  # an outage holds new turns (no sample biased to non-searchers)
            t0 = time.perf_counter()
            out = await engine.generate(
                b.input_ids(),
                self.sampling_params(max_new - len(turn_ids), greedy=greedy),
                rid=self._new_rid(f"{rid}-{attempt}"),
                routed_from=b.routed_len if b.routed is not None else None,
            )
            stats["generate_s"] += time.perf_counter() - t0
            attempt += 1
            b.add_generated(out.output_ids, out.logprobs, out.versions)
            if out.routed_experts is not None:
                b.add_routed(out.routed_experts)
            turn_ids.extend(out.output_ids)
            retractions += out.num_retractions
            if out.finish_type != "abort":
                return turn_ids, out.finish_type, out.finish_matched, retractions
            aborts_without_progress = 0 if out.output_ids else aborts_without_progress + 1
            if aborts_without_progress >= MAX_ABORTS_WITHOUT_PROGRESS or len(turn_ids) >= max_new:
                if len(turn_ids) >= max_new:
                    return turn_ids, "length", None, retractions
                raise EngineError(
                    engine.url, "/generate", f"request aborted {aborts_without_progress} times without progress"
                )
            log.info(
                "engine %s aborted request %s after %d tokens; re-issuing the rest of the turn",
                engine.url,
                rid,
                len(turn_ids),
            )

    def _aborted(self, run: _Run, error: str, kind: str = "engine") -> Trajectory:
        """An aborted trajectory; ``extra["error_kind"]`` says whether the ``engine`` or the ``tool`` failed."""
        run.stats["total_s"] = time.perf_counter() - run.t_start
        log.warning("trajectory aborted: %s", error)
        return run.b.build(
            reward=0.0,
            num_turns=run.num_turns,
            num_tool_calls=run.num_tool_calls,
            num_retractions=run.num_retractions,
            finish_reason="abort",
            aborted=True,
            error=error,
            timings=run.stats,
            extra={"turn_finish_reasons": run.turn_finishes, "error_kind": kind},
        )

    # -- groups
    async def run_group(
        self,
        group: Group,
        engine: EngineHandle,
        *,
        group_size: int,
        on_trajectory: Optional[Callable[[int, Trajectory], Any]] = None,
    ) -> Group:
        """Run ``group_size`` trajectories of ``group.item`` concurrently on ``engine``.

        ``on_trajectory(index, trajectory)`` is called as each finishes (it may be a coroutine
        function). The returned group holds the trajectories in index order; it is aborted when
        any of them is.
        """
        prompt_ids = self.prompt_ids(group.item)
        engine.load += group_size

        async def one(i: int) -> Trajectory:
            try:
                traj = await self.run_trajectory(
                    group.item, engine, prompt_ids=prompt_ids, rid=f"g{group.group_id}-s{i}"
                )
            finally:
                engine.load -= 1
            if on_trajectory is not None:
                res = on_trajectory(i, traj)
                if asyncio.iscoroutine(res):
                    await res
            return traj

        # Trajectory 0 runs in the caller's task; the others in one task each (all concurrent: the tasks start
        # at the caller's first await). One task fewer per group than a gather of all, and no gather future.
        others = [asyncio.ensure_future(one(i)) for i in range(1, group_size)]
        try:
            trajs = [await one(0)] if group_size > 0 else []
            for t in others:
                trajs.append(await t)
        except BaseException:  # an error or a cancellation: the group's other trajectories stop with it
            for t in others:
                t.cancel()
            raise
        group.trajectories = trajs
        group.aborted = any(t.aborted for t in trajs)
        return group

    # -- evaluation
    async def evaluate(self, items: Sequence[PromptItem], engines: Sequence[EngineHandle]) -> dict:
        """Greedy, one trajectory per prompt, spread over ``engines`` -> accuracy and counts."""
        if not engines:
            raise ValueError("evaluate: no engines")

        async def one(k: int, item: PromptItem) -> Trajectory:
            return await self.run_trajectory(item, engines[k % len(engines)], greedy=True, rid=f"eval{k}")

        trajs = await asyncio.gather(*(one(k, it) for k, it in enumerate(items)))
        return summarize_eval(trajs)


def summarize_eval(trajs: Sequence[Trajectory]) -> dict:
    done = [t for t in trajs if not t.aborted]
    n = len(done)
    return {
        "accuracy": sum(t.reward for t in done) / n if n else 0.0,
        "num_prompts": len(trajs),
        "num_aborted": len(trajs) - n,
        "mean_turns": sum(t.num_turns for t in done) / n if n else 0.0,
        "mean_tool_calls": sum(t.num_tool_calls for t in done) / n if n else 0.0,
        "answer_rate": sum(t.finish_reason == "answer" for t in done) / n if n else 0.0,
        "errors": sorted({t.error for t in trajs if t.aborted})[:5],
    }
