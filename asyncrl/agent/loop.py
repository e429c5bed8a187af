"""The multi-turn agent loop: token in, token out, against one engine per trajectory.

Contract
- Wires: an environment (``asyncrl.agent.envs``: prompt, turn parser, observation text, score), its tools
  (``{name: Tool}``), a tokenizer and an engine (``EngineHandle``: SGLang ``/generate`` through a client, with a semaphore bounding the
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
- Tools: every call of a turn runs concurrently, each under its deadline (the tool's ``timeout_s`` + 5 s, or
  ``agentloop.tool_timeout_s``; the ``search`` tool bounds itself). A call that raises ``ToolError`` or anything
  else, that times out, or that names an unknown tool gives an error result: the policy sees it in the observation
  and ``tool/<name>/errors`` counts it (``extra["metrics"]``, with ``tool/<name>/calls`` and the environment's
  ``env/<name>`` metrics, as JSON: the record's ``metrics`` field).
- Failures: a generate call that fails (connection, timeout, HTTP error, malformed reply) or a
  tool that raises ``ToolUnavailable`` (a retrieval that fails after its retries) makes the trajectory ``aborted``
  with an error naming the URL; it is never scored. A group with an aborted trajectory is aborted (the broker retries
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

    loop = AgentLoop(env=get_env("searchr1"), tokenizer=tok, tools={"search": SearchTool(retriever, 3)},
                     agent_cfg=cfg.agentloop, sampling=cfg.rollout.sampling)
    engine = EngineHandle(client, max_in_flight=32)
    group = await loop.run_group(group, engine, on_trajectory=lambda i, t: ...)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from asyncrl.agent.engine_handle import EngineHandle
from asyncrl.agent.envs.base import Environment, Score, ToolCall, ToolResult, as_score
from asyncrl.agent.tools.base import Retriever, RetrieverOutageError, ToolError, ToolUnavailable
from asyncrl.agent.tools.search import SearchTool, call_stats
from asyncrl.agent.trajectory import TrajectoryBuilder, TurnGate, summarize_eval, trajectory_metrics
from asyncrl.broker.types import Group, PromptItem, Trajectory
from asyncrl.config.schema import AgentLoopConfig, SamplingConfig
from asyncrl.engine.client import EngineError

log = logging.getLogger(__name__)

__all__ = [
    "AgentLoop",
    "EngineError",
    "EngineHandle",
    "TrajectoryBuilder",
    "TurnGate",
    "summarize_eval",
    "trajectory_metrics",
]

# Consecutive engine-side aborts of one turn that returned no new token before the trajectory
# gives up (an engine stuck aborting would otherwise spin forever).
MAX_ABORTS_WITHOUT_PROGRESS = 3
TOOL_GRACE_S = 5.0
"""Added to a tool's own ``timeout_s`` for the loop's deadline (the tool reports its own timeout first)."""


# ---------------------------------------------------------------- the loop


@dataclass
class _Run:
    """One trajectory's running state (``AgentLoop.run_trajectory``)."""

    b: TrajectoryBuilder
    t_start: float = field(default_factory=time.perf_counter)
    stats: dict = field(default_factory=lambda: {"generate_s": 0.0, "tool_s": 0.0})
    tool: dict = field(default_factory=dict)
    """Failed retrieval attempts of this trajectory (``tool/errors``)."""
    metrics: dict = field(default_factory=dict)
    """``tool/<name>/calls`` and ``tool/<name>/errors`` of this trajectory."""
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
        env: Environment,
        tokenizer: Any,
        agent_cfg: AgentLoopConfig,
        sampling: SamplingConfig,
        tools: Optional[dict[str, Any]] = None,
        retriever: Optional[Retriever] = None,
        reward: Optional[Callable[[PromptItem, str], Score]] = None,
        gate: Optional[TurnGate] = None,
        rid_prefix: str = "agent",
        routed_experts: bool = False,
    ):
        """``tools``: ``{name: Tool}`` (``asyncrl.agent.envs.make_tools``); ``retriever``: a Search-R1 retriever,
        served as the ``search`` tool (``agentloop.tool.topk``). ``reward``: replaces ``env.score``
        (``agentloop.reward_path``)."""
        self.env = env
        self.tokenizer = tokenizer
        self.cfg = agent_cfg
        self.tools: dict[str, Any] = dict(tools or {})
        if retriever is not None:
            self.retriever = retriever
        self.reward = reward
        self.sampling = sampling
        self.gate = gate or TurnGate()
        self.rid_prefix = rid_prefix
        self.routed_experts = routed_experts
        self._rids = itertools.count()
        self._encoded: dict[str, list[int]] = {}
        self._eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._encode_prompt = tokenizer.prefix_encoder(self._template_head())

    @property
    def retriever(self) -> Optional[Retriever]:
        """The ``search`` tool's retriever (None without one)."""
        tool = self.tools.get("search")
        return getattr(tool, "retriever", None)

    @retriever.setter
    def retriever(self, retriever: Retriever) -> None:
        self.tools["search"] = SearchTool(retriever, self.cfg.tool.topk)

    def _template_head(self) -> str:
        """The text every prompt of this environment starts with (the template before the question): the common
        start of two prompts built from different questions."""
        a, b = (self._prompt_text(PromptItem(-1, q, [])) for q in ("a", "b"))
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[:n]

    def _prompt_text(self, item: PromptItem) -> str:
        return self.env.prompt(
            item, tools=list(self.tools.values()), chat_template=self.cfg.chat_template, tokenizer=self.tokenizer
        )

    # -- pieces
    def prompt_ids(self, item: PromptItem) -> list[int]:
        """``tokenizer.encode`` of the prompt text; the template's fixed head is tokenized once
        (``AgentTokenizer.prefix_encoder``: the same ids)."""
        return self._encode_prompt(self._prompt_text(item))

    def sampling_params(self, max_new_tokens: int, *, greedy: bool = False) -> dict:
        params: dict[str, Any] = {
            "max_new_tokens": int(max_new_tokens),
            "temperature": 0.0 if greedy else float(self.sampling.temperature),
            "top_p": 1.0 if greedy else float(self.sampling.top_p),
            "stop": list(self.env.stop),
        }
        if self.sampling.top_k > 0 and not greedy:
            params["top_k"] = int(self.sampling.top_k)
        return params

    def _encode(self, text: str) -> list[int]:
        """Tokenized text, cached for texts that repeat (invalid-turn messages, observation tails)."""
        ids = self._encoded.get(text)
        if ids is None:
            ids = self.tokenizer.encode(text)
            if len(self._encoded) < 64:
                self._encoded[text] = ids
        return list(ids)

    def observation_ids(self, text: str) -> list[int]:
        """An observation's text, tokenized, cut to ``max_obs_tokens`` keeping its closing text
        (``env.observation_tail()``)."""
        ids = self.tokenizer.encode(text)
        limit = self.cfg.tool.max_obs_tokens
        if len(ids) <= limit:
            return ids
        tail_text = self.env.observation_tail()
        tail = self._encode(tail_text) if tail_text and text.endswith(tail_text) else []
        if tail and len(tail) < limit:
            return self.tokenizer.encode(text[: len(text) - len(tail_text)])[: limit - len(tail)] + tail
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
        token = call_stats().set(run.tool)
        try:
            await self._turns(run, engine, greedy=greedy, rid=rid)
        except EngineError as exc:
            return self._aborted(run, str(exc))
        except RetrieverOutageError:  # fatal: the worker stops and the run fails naming the URL
            raise
        except ToolUnavailable as exc:  # marked: an eval must fail on it, not count it as a wrong answer
            return self._aborted(run, str(exc), kind="tool")
        finally:
            call_stats().reset(token)
        run.stats["total_s"] = time.perf_counter() - run.t_start
        score = self._score(item, "".join(run.gen_texts))
        metrics = dict(run.metrics)
        metrics.update((f"env/{k}", float(v)) for k, v in score.metrics.items())
        return run.b.build(
            reward=float(score.reward),
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
                "metrics": json.dumps(metrics, separators=(",", ":")) if metrics else "",
            },
        )

    def _score(self, item: PromptItem, text: str) -> Score:
        if self.reward is not None:
            return self.reward(item, text)
        return as_score(self.env.score(item, text), where=f"environment {self.env.name!r}: score()")

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
            parsed = self.env.parse(text)
            finish = self._turn_finish(parsed.kind, finish_type, matched, max_new, last=turn == self.cfg.max_turns - 1)
            if finish is not None:
                run.finish_reason, run.truncated = finish
                return
            if parsed.kind == "tool":
                t0 = time.perf_counter()
                results = await self._call_tools(parsed.calls, run)
                run.stats["tool_s"] += time.perf_counter() - t0
                run.num_tool_calls += len(results)
                turn_end = self.tokenizer.decode([matched]) if finish_type == "stop" and matched in self._eos else ""
                obs = self.observation_ids(
                    self.env.observe(
                        results, turn_end=turn_end, chat_template=self.cfg.chat_template, tokenizer=self.tokenizer
                    )
                )
            else:
                obs = self._encode(self.env.invalid_observation(parsed))
            if len(obs) + 1 > b.room:
                run.finish_reason, run.truncated = "length", True
                return
            b.add_tool(obs)

    async def _call_tools(self, calls: Sequence[ToolCall], run: _Run) -> list[ToolResult]:
        """Every call of the turn, concurrently; each result or error (module docstring), in call order."""
        if len(calls) == 1:
            return [await self._call_tool(calls[0], run)]
        return list(await asyncio.gather(*(self._call_tool(c, run) for c in calls)))

    async def _call_tool(self, call: ToolCall, run: _Run) -> ToolResult:
        tool = self.tools.get(call.name)
        name = call.name if tool is not None else "unknown"
        m = run.metrics
        m[f"tool/{name}/calls"] = m.get(f"tool/{name}/calls", 0) + 1
        if tool is None:
            error = f"unknown tool {call.name!r}; tools: {', '.join(self.tools) or 'none'}"
        else:
            own = getattr(tool, "timeout_s", None)
            deadline = (
                None if isinstance(tool, SearchTool) else (own + TOOL_GRACE_S if own else self.cfg.tool_timeout_s)
            )
            try:
                coro = tool.call(dict(call.arguments), timeout_s=own or self.cfg.tool_timeout_s)
                output = await (asyncio.wait_for(coro, deadline) if deadline else coro)
                return ToolResult(call, output)
            except (ToolUnavailable, asyncio.CancelledError):
                raise
            except asyncio.TimeoutError:
                error = f"{call.name} timed out after {deadline:g} s"
            except ToolError as e:
                error = str(e) or type(e).__name__
            except Exception as e:  # a tool's bug is the episode's error, never the worker's
                error = f"{call.name} raised {type(e).__name__}: {e}"
                log.warning("tool %s raised %s: %s", call.name, type(e).__name__, e)
        m[f"tool/{name}/errors"] = m.get(f"tool/{name}/errors", 0) + 1
        return ToolResult(call, error=error)

    def _turn_finish(
        self, action_kind: str, finish_type: str, matched: Any, max_new: int, *, last: bool
    ) -> Optional[tuple[str, bool]]:
        """(finish reason, truncated) when the trajectory ends after this turn, else None (a tool turn follows)."""
        if action_kind == "answer":
            return "answer", False
        if (
            action_kind != "tool"
            and finish_type == "stop"
            and isinstance(matched, int)
            and (matched in self._eos or not self._eos)
        ):
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
            for tool in self.tools.values():  # an outage holds new turns (no sample biased to non-searchers)
                wait = getattr(tool, "wait_available", None)
                if wait is not None:
                    await wait()
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
        """Greedy, one trajectory per prompt, spread over ``engines`` -> the mean reward (named by the
        environment's ``reward_name``) and counts."""
        if not engines:
            raise ValueError("evaluate: no engines")

        async def one(k: int, item: PromptItem) -> Trajectory:
            return await self.run_trajectory(item, engines[k % len(engines)], greedy=True, rid=f"eval{k}")

        trajs = await asyncio.gather(*(one(k, it) for k, it in enumerate(items)))
        return summarize_eval(trajs, reward_name=getattr(self.env, "reward_name", "mean_reward"))
