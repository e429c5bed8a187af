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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from asyncrl.agent.tasks import Task
from asyncrl.agent.tools import Retriever, RetrieverError, RetrieverOutageError
from asyncrl.broker.types import Group, PromptItem, Trajectory
from asyncrl.config.schema import AgentLoopConfig, SamplingConfig
from asyncrl.engine.client import EngineError, GenerateResult
from asyncrl.engine.client import parse_generate_response as parse_reply

log = logging.getLogger(__name__)

# Consecutive engine-side aborts of one turn that returned no new token before the trajectory
# gives up (an engine stuck aborting would otherwise spin forever).
MAX_ABORTS_WITHOUT_PROGRESS = 3


# ---------------------------------------------------------------- one generate call, parsed


@dataclass
class GenOutput:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    """Weight version of each output token."""
    finish_type: str
    """``stop``, ``length`` or ``abort``."""
    finish_matched: Any = None
    """For ``stop``: the stop string (str) or token id (int, e.g. EOS)."""
    num_retractions: int = 0
    cached_tokens: int = 0


def parse_version(value: Any, url: str) -> int:
    """SGLang weight versions are strings; ours are integers (``default`` = 0)."""
    if isinstance(value, int):
        return value
    if value is None or value == "default":
        return 0
    try:
        return int(str(value))
    except ValueError:
        raise EngineError(
            url, "/generate", f"weight version {value!r} is not an integer; launch engines with --weight-version 0"
        ) from None


def token_versions(meta: dict, num_tokens: int, url: str) -> list[int]:
    """Per-output-token versions from ``weight_versions`` spans, else ``weight_version``.

    A span ``{"version", "start", "end"}`` covers output tokens ``start <= j < end``; tokens no
    span covers get ``weight_version``.
    """
    default = parse_version(meta.get("weight_version"), url)
    versions = [default] * num_tokens
    for span in meta.get("weight_versions") or ():
        v = parse_version(span.get("version"), url)
        start, end = max(0, int(span.get("start", 0))), min(num_tokens, int(span.get("end", num_tokens)))
        for j in range(start, end):
            versions[j] = v
    return versions


def gen_output(result: GenerateResult, url: str) -> GenOutput:
    """The engine client's typed answer as the loop uses it: log-probs required (``return_logprob``), the
    weight version of each output token as an integer."""
    if result.output_logprobs is None:
        raise EngineError(url, "/generate", "/generate reply has no output_token_logprobs (return_logprob)")
    finish = result.finish_reason
    return GenOutput(
        output_ids=result.output_ids,
        logprobs=result.output_logprobs,
        versions=token_versions(result.meta_info, len(result.output_ids), url),
        finish_type=str(finish.get("type", "")),
        finish_matched=finish.get("matched"),
        num_retractions=result.num_retractions,
        cached_tokens=result.cached_tokens,
    )


def parse_generate_response(resp: dict, url: str) -> GenOutput:
    """A raw ``/generate`` reply (``EngineHandle``'s ``generate_raw``) through the engine client's parser."""
    return gen_output(parse_reply(resp, url), url)


class EngineHandle:
    """One engine as the loop sees it: ``generate`` with at most ``max_in_flight`` calls at once.

    ``client`` is the engine's ``asyncrl.engine.client.SGLangClient`` (its typed answer is used as is);
    ``generate_raw`` (tests, other transports) replaces its ``generate`` by a coroutine ``(input_ids,
    sampling_params, rid) -> raw /generate JSON``, parsed by the same client parser. Any failure (client error,
    timeout, HTTP status, malformed reply) is ``asyncrl.engine.client.EngineError`` naming the URL.
    """

    def __init__(
        self,
        client: Any,
        *,
        max_in_flight: int,
        url: Optional[str] = None,
        generate_raw: Optional[Callable[..., Awaitable[dict]]] = None,
    ):
        self.client = client
        self.url = url or getattr(client, "url", None) or getattr(client, "base_url", "?")
        self.max_in_flight = max_in_flight
        self._sem = asyncio.Semaphore(max_in_flight)
        self._generate_raw = generate_raw
        self.in_flight = 0
        """Generate calls in flight now."""
        self.load = 0
        """Trajectories assigned now (for least-loaded placement of groups)."""

    async def _call(self, input_ids, sampling_params, rid) -> GenerateResult:
        if self._generate_raw is not None:
            return parse_reply(await self._generate_raw(input_ids, sampling_params, rid), self.url)
        return await self.client.generate(input_ids, sampling_params, rid=rid, return_logprob=True)

    async def generate(self, input_ids: list[int], sampling_params: dict, *, rid: str) -> GenOutput:
        async with self._sem:
            self.in_flight += 1
            try:
                result = await self._call(input_ids, sampling_params, rid)
            except EngineError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, RuntimeError) as exc:
                raise EngineError(self.url, "/generate", f"generate failed: {type(exc).__name__}: {exc}") from exc
            finally:
                self.in_flight -= 1
        return gen_output(result, self.url)


# ---------------------------------------------------------------- gate (drain)


class TurnGate:
    """Holds new turns while closed (``pause_mode = "drain"``: no new generate calls start)."""

    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self._num_waiting = 0

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

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

    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

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
            **fields,
        )


# ---------------------------------------------------------------- the loop


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
    ):
        self.task = task
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.cfg = agent_cfg
        self.sampling = sampling
        self.gate = gate or TurnGate()
        self.rid_prefix = rid_prefix
        self._rids = itertools.count()
        self._invalid_ids = tokenizer.encode(task.invalid_action_message)
        self._obs_tail_ids = tokenizer.encode(getattr(task, "observation_tail", ""))
        self._eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())

    # -- pieces
    def prompt_ids(self, item: PromptItem) -> list[int]:
        text = self.task.build_prompt(item.prompt, chat_template=self.cfg.chat_template, tokenizer=self.tokenizer)
        return self.tokenizer.encode(text)

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
        t_start = time.perf_counter()
        b = TrajectoryBuilder(
            list(prompt_ids if prompt_ids is not None else self.prompt_ids(item)), self.cfg.max_total_tokens
        )
        stats = {"generate_s": 0.0, "tool_s": 0.0}
        tool: dict = {}  # failed retrieval attempts of this trajectory (``tool/errors``)
        turn_finishes: list[str] = []
        gen_texts: list[str] = []
        num_turns = num_tool_calls = num_retractions = 0
        finish_reason, truncated = "", False
        try:
            for turn in range(self.cfg.max_turns):
                if b.room <= 0:
                    finish_reason, truncated = "length", True
                    break
                max_new = min(self.cfg.max_tokens_per_turn, b.room)
                ids, finish_type, matched, retractions = await self._generate_turn(
                    b, engine, max_new, greedy=greedy, rid=f"{rid}-t{turn}", stats=stats
                )
                num_turns += 1
                num_retractions += retractions
                turn_finishes.append(finish_type)
                text = self.tokenizer.decode(ids)
                gen_texts.append(text)
                action = self.task.parse_action(text)
                if action.kind == "answer":
                    finish_reason = "answer"
                    break
                if finish_type == "stop" and isinstance(matched, int) and (matched in self._eos or not self._eos):
                    finish_reason = "eos"
                    break
                if finish_type == "length" and max_new < self.cfg.max_tokens_per_turn:
                    finish_reason, truncated = "length", True  # the total limit, not the per-turn one
                    break
                if turn == self.cfg.max_turns - 1:
                    finish_reason = "max_turns"
                    break
                if action.kind == "search":
                    t0 = time.perf_counter()
                    docs = (await self.retriever.retrieve([action.content], self.cfg.tool.topk, stats=tool))[0]
                    stats["tool_s"] += time.perf_counter() - t0
                    num_tool_calls += 1
                    obs = self.observation_ids(docs)
                else:
                    obs = self._invalid_ids
                if len(obs) + 1 > b.room:
                    finish_reason, truncated = "length", True
                    break
                b.add_tool(obs)
        except EngineError as exc:
            return self._aborted(b, str(exc), stats, t_start, num_turns, num_tool_calls, num_retractions, turn_finishes)
        except RetrieverOutageError:  # fatal: the worker stops and the run fails naming the URL
            raise
        except RetrieverError as exc:  # marked: an eval must fail on it, not count it as a wrong answer
            return self._aborted(
                b, str(exc), stats, t_start, num_turns, num_tool_calls, num_retractions, turn_finishes, kind="tool"
            )
        reward = float(self.task.reward("".join(gen_texts), item.answers))
        stats["total_s"] = time.perf_counter() - t_start
        return b.build(
            reward=reward,
            num_turns=num_turns,
            num_tool_calls=num_tool_calls,
            num_retractions=num_retractions,
            finish_reason=finish_reason,
            truncated=truncated,
            timings=stats,
            extra={
                "turn_finish_reasons": turn_finishes,
                "engine": engine.url,
                "tool_errors": tool.get("tool_errors", 0),
            },
        )

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
            )
            stats["generate_s"] += time.perf_counter() - t0
            attempt += 1
            b.add_generated(out.output_ids, out.logprobs, out.versions)
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

    def _aborted(
        self, b, error, stats, t_start, num_turns, num_tool_calls, num_retractions, turn_finishes, kind: str = "engine"
    ):
        """An aborted trajectory; ``extra["error_kind"]`` says whether the ``engine`` or the ``tool`` failed."""
        stats["total_s"] = time.perf_counter() - t_start
        log.warning("trajectory aborted: %s", error)
        return b.build(
            reward=0.0,
            num_turns=num_turns,
            num_tool_calls=num_tool_calls,
            num_retractions=num_retractions,
            finish_reason="abort",
            aborted=True,
            error=error,
            timings=stats,
            extra={"turn_finish_reasons": turn_finishes, "error_kind": kind},
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

        trajs = await asyncio.gather(*(one(i) for i in range(group_size)))
        group.trajectories = list(trajs)
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
