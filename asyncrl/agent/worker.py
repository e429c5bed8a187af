"""The agent worker: the body of the process beside an engine (on the engine's first rank).

Contract
- Wires: the broker (``AsyncWorkerConnection``: hello, heartbeats from a background task, events),
  one ``SGLangClient`` + ``EngineHandle`` per engine URL, the environment (``agentloop.task_name``), its tools
  (made at ``run``'s start: a tool server is asked for its list), the tokenizer, and an ``AgentLoop`` that runs
  groups; the tools are closed when the worker ends.
- Who calls whom: the broker issues ``Assignment``s; each becomes an asyncio task that runs the
  group's ``group_size`` trajectories concurrently on the least-loaded engine (all turns of a
  trajectory on that engine) and reports the finished group with its trajectories in one message
  (``send_group``; aborted when any trajectory is, with the first error and no data; groups finished in
  the same event-loop turn share a message). Under ``sample`` granularity (``welcome.per_trajectory``)
  each finished trajectory is also announced at once, data-less (``send_done``), to free its slot.
- Control: ``Control(hold=True)`` closes the turn gate (no new generate call starts; running ones
  finish) until ``hold=False``; ``Cancel`` cancels those groups (nothing is reported); ``Shutdown``
  cancels everything, says bye and returns.
- Invariant: at most ``max_requests_per_engine`` generate calls in flight per engine; a bug in a
  group task (any exception other than the engine/retriever failures the loop turns into aborted
  trajectories) stops the worker with that exception instead of hanging.
- Engine supervision (with an ``EngineWatch``, on the engine's first rank): a task probes the engine
  every ``rollout.health_check_interval_s`` (process alive + ``engine.liveness``: a paused engine is
  live); once it is dead or hung
  (``HealthTracker``) the worker cancels its groups (nothing is reported), says bye (the broker
  re-issues them: counted as re-issued, not dropped), restarts the engine (``rollout.max_restarts``),
  announces the restart (``EngineWatch.announce``), waits until the actor re-joined it to the
  weight-sync group and synced the current weights (``EngineWatch.synced``), and only then says
  hello again and takes work. A group aborted by a failing engine is not reported meanwhile.
- Retriever outage (``asyncrl.agent.tools.http_retriever``): new turns wait until the retriever answers;
  past ``agentloop.tool.max_outage_s`` the ``RetrieverOutageError`` (naming the URL) stops the worker.

    stats = run_worker(cfg, broker_address="tcp://10.0.0.1:5555", engine_urls=["http://127.0.0.1:31000"],
                       tokenizer_path="runs/tiny/model_sft", worker_id="engine0")
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from asyncrl.agent.envs import get_env, load_reward, make_tools, tool_specs
from asyncrl.agent.loop import AgentLoop, EngineHandle, TurnGate
from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.agent.tools import Retriever, RetrieverOutageError
from asyncrl.broker.types import Group
from asyncrl.broker.worker_client import Assignment, AsyncWorkerConnection, Cancel, Control, Shutdown
from asyncrl.config.schema import Config
from asyncrl.engine.client import SGLangClient
from asyncrl.engine.launch import EngineSupervisor
from asyncrl.engine.liveness import HealthTracker

log = logging.getLogger(__name__)

# How long one wait for a broker event lasts before the worker checks its group tasks again.
POLL_S = 0.2


@dataclass
class EngineWatch:
    """The worker's handle on its engine's supervision (see module contract)."""

    sup: EngineSupervisor
    interval_s: float
    probe_timeout_s: float
    unhealthy_after_s: float
    announce: Callable[[int], None]
    """Called with the restart count once a restarted engine is ready (the actor re-joins and syncs it)."""
    synced: Callable[[int], bool]
    """True once the actor synced the current weights into restart number ``n``."""
    sync_wait_s: float
    """How long to wait for that sync before failing, naming the engine."""

    @classmethod
    def from_config(
        cls, cfg: Config, sup: EngineSupervisor, *, announce: Callable[[int], None], synced: Callable[[int], bool]
    ) -> EngineWatch:
        r = cfg.rollout
        return cls(
            sup,
            r.health_check_interval_s,
            r.health_check_timeout_s,
            r.unhealthy_after_s,
            announce,
            synced,
            sync_wait_s=cfg.sync.join_timeout_s + cfg.sync.step_timeout_s,
        )

    async def healthy(self) -> bool:
        return self.sup.alive() and await asyncio.to_thread(self.sup.probe, self.probe_timeout_s)

    async def wait_fault(self) -> str:
        """Probe until the engine is dead or hung; returns the verdict."""
        tracker = HealthTracker(unhealthy_after_s=self.unhealthy_after_s)
        while True:
            await asyncio.sleep(self.interval_s)
            ok = await self.healthy()
            verdict = tracker.observe(
                alive=self.sup.alive(),
                ok=ok,
                t=time.monotonic(),
                exit_code=self.sup.exit_code(),
                why=self.sup.last_probe,
            )
            if verdict is not None:
                return verdict


def requests_per_engine(cfg: Config) -> int:
    return cfg.agentloop.max_requests_per_engine or cfg.rollout.max_running_requests


class AgentWorker:
    def __init__(
        self,
        cfg: Config,
        *,
        broker_address: str,
        engine_urls: Sequence[str],
        tokenizer_path: str,
        worker_id: str,
        retriever: Optional[Retriever] = None,
        connect_timeout_s: float = 60.0,
        watch: Optional[EngineWatch] = None,
    ):
        if not engine_urls:
            raise ValueError(f"agent worker {worker_id}: no engine URLs")
        self.cfg = cfg
        self.broker_address = broker_address
        self.engine_urls = list(engine_urls)
        self.worker_id = worker_id
        self.connect_timeout_s = connect_timeout_s
        task_name = cfg.agentloop.task_name
        if task_name is None:
            log.warning("agentloop.task_name is unset; using 'searchr1'")
            task_name = "searchr1"
        self.env = get_env(task_name)
        self.reward = load_reward(cfg.agentloop.reward_path) if cfg.agentloop.reward_path else None
        self.tokenizer = AgentTokenizer.from_pretrained(tokenizer_path)
        self.retriever = retriever
        self.tools: dict = {}
        self.gate = TurnGate()
        self.loop: Optional[AgentLoop] = None
        """Made at ``run``'s start, with the tools."""
        self.version = 0
        self.watch = watch
        self._watch_task: Optional[asyncio.Task] = None
        self.tasks: dict[int, asyncio.Task] = {}
        """The running group tasks by group id (a task leaves this map when it ends: ``_group_ended``)."""
        self._failures: list[tuple[int, BaseException]] = []
        """Group tasks that ended with an exception, not yet raised (``_raise_task_failures``)."""
        self.stats = {
            "groups_done": 0,
            "groups_aborted": 0,
            "groups_cancelled": 0,
            "trajectories_done": 0,
            "trajectories_aborted": 0,
            "engine_restarts": 0,
            "groups_held_for_restart": 0,
        }

    # -- lifecycle
    async def run(self) -> dict:
        clients = [SGLangClient.from_config(url, self.cfg.rollout) for url in self.engine_urls]
        per_engine = requests_per_engine(self.cfg)
        self.engines = [EngineHandle(c, max_in_flight=per_engine, url=c.url) for c in clients]
        try:
            self.tools = await make_tools(tool_specs(self.cfg, self.env), self.cfg, retriever=self.retriever)
            self.loop = AgentLoop(
                env=self.env,
                tokenizer=self.tokenizer,
                tools=self.tools,
                reward=self.reward,
                agent_cfg=self.cfg.agentloop,
                sampling=self.cfg.rollout.sampling,
                gate=self.gate,
                rid_prefix=self.worker_id,
                routed_experts=self.cfg.actor.moe_routing_replay,
            )
            await self._connect()
            self._start_watch()
            await self._event_loop()
            await self.conn.close(say_bye=True)
        finally:
            if self._watch_task is not None:
                self._watch_task.cancel()
            await self._cancel_all()
            for c in clients:
                await c.close()
            for tool in self.tools.values():
                await tool.close()
        return dict(self.stats)

    async def _connect(self) -> None:
        per_engine = requests_per_engine(self.cfg)
        self.conn = AsyncWorkerConnection(
            self.broker_address,
            worker_id=self.worker_id,
            capacity=per_engine * len(self.engines),
            heartbeat_interval_s=self.cfg.agentloop.heartbeat_interval_s,
        )
        welcome = await self.conn.connect(timeout_s=self.connect_timeout_s)
        self.version = welcome.version
        self._set_hold(welcome.hold)
        log.info(
            "worker %s connected to %s (%d engines, %d requests each)",
            self.worker_id,
            self.broker_address,
            len(self.engines),
            per_engine,
        )

    def _start_watch(self) -> None:
        if self.watch is not None:
            self._watch_task = asyncio.create_task(self.watch.wait_fault(), name="engine-watch")

    async def _check_engine(self) -> None:
        """Between events: a fault the watch found is handled here (the event loop owns the connection)."""
        t = self._watch_task
        if t is None or not t.done():
            return
        await self._recover_engine(t.result())  # a failed watch task raises here
        self._start_watch()

    async def _recover_engine(self, verdict: str) -> None:
        """Re-issue this worker's groups, restart the engine, wait for the actor's sync, take work again."""
        w = self.watch
        log.warning(
            "worker %s: engine %s is %s; its %d in-flight groups go back to the broker",
            self.worker_id,
            w.sup.url,
            verdict,
            len(self.tasks),
        )
        await self._cancel_all()
        await self.conn.close(say_bye=True)  # the broker re-issues the groups (counted as re-issued)
        while verdict is not None:
            w.sup.relaunch(verdict)  # on this (the main) thread: the child's death signal follows its spawner
            await asyncio.to_thread(w.sup.wait_ready)
            self.stats["engine_restarts"] += 1
            w.announce(w.sup.restarts)
            verdict = await self._wait_synced(w.sup.restarts)
        log.info(
            "worker %s: engine %s restarted (%d) and synced; taking work again",
            self.worker_id,
            w.sup.url,
            w.sup.restarts,
        )
        await self._connect()

    async def _wait_synced(self, n: int) -> Optional[str]:
        """Wait until the actor synced restart ``n``; None then, or a verdict if the engine died meanwhile."""
        w = self.watch
        deadline = time.monotonic() + w.sync_wait_s
        while not w.synced(n):
            if not w.sup.alive():
                return f"dead: the process exited with code {w.sup.exit_code()} before its weight sync"
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"agent worker {self.worker_id}: the actor did not sync restarted engine "
                    f"{w.sup.url} (restart {n}) within {w.sync_wait_s:g} s "
                    f"(sync.join_timeout_s + sync.step_timeout_s)"
                )
            await asyncio.sleep(POLL_S)
        return None

    async def _event_loop(self) -> None:
        while True:
            self._raise_task_failures()
            await self._check_engine()
            ev = await self.conn.recv(timeout_s=POLL_S)
            if ev is None:
                continue
            if isinstance(ev, Assignment):
                self._start_group(ev)
            elif isinstance(ev, Control):
                self.version = ev.version
                self._set_hold(ev.hold)
            elif isinstance(ev, Cancel):
                for gid in ev.group_ids:
                    t = self.tasks.pop(gid, None)
                    if t is not None:
                        t.cancel()
                        self.stats["groups_cancelled"] += 1
            elif isinstance(ev, Shutdown):
                log.info("worker %s: shutdown from the broker", self.worker_id)
                return

    def _set_hold(self, hold: bool) -> None:
        if hold:
            self.gate.hold()
        else:
            self.gate.release()

    def _group_ended(self, gid: int, t: asyncio.Task) -> None:
        """A group task's done callback: it leaves ``tasks``; its exception, if any, waits to be raised."""
        if self.tasks.get(gid) is t:
            del self.tasks[gid]
        if not t.cancelled() and t.exception() is not None:
            self._failures.append((gid, t.exception()))

    def _raise_task_failures(self) -> None:
        """Raise the first group task failure (O(1) per event: the done callbacks collect them)."""
        if self._failures:
            gid, exc = self._failures[0]
            if isinstance(exc, RetrieverOutageError):  # the run fails naming the retriever
                raise exc
            raise RuntimeError(f"agent worker {self.worker_id}: group {gid} failed") from exc

    async def _cancel_all(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.tasks.clear()

    # -- groups
    def _start_group(self, a: Assignment) -> None:
        if a.group_id in self.tasks:
            log.warning("worker %s: group %d issued twice; ignoring the second", self.worker_id, a.group_id)
            return
        t = asyncio.create_task(self._run_group(a), name=f"group-{a.group_id}")
        self.tasks[a.group_id] = t
        t.add_done_callback(functools.partial(self._group_ended, a.group_id))

    def pick_engine(self) -> EngineHandle:
        return min(self.engines, key=lambda e: e.load / e.max_in_flight)

    async def _run_group(self, a: Assignment) -> None:
        t0 = time.perf_counter()
        engine = self.pick_engine()
        group = Group(group_id=a.group_id, item=a.item, epoch=a.epoch, issued_version=a.version)

        def report(index, traj):
            self.stats["trajectories_done"] += 1
            self.stats["trajectories_aborted"] += int(traj.aborted)
            if self.conn.welcome.per_trajectory:  # ``sample`` granularity: the broker frees this slot now
                self.conn.send_done(a.group_id, index)

        group = await self.loop.run_group(group, engine, group_size=a.group_size, on_trajectory=report)
        error = next((t.error for t in group.trajectories if t.aborted), "")
        if group.aborted and self.watch is not None and not await self.watch.healthy():
            await self._hold_for_restart(a.group_id, error)
        trajs = None if group.aborted else group.trajectories  # an aborted group is never trained: no data
        await self.conn.send_group(a.group_id, trajs, aborted=group.aborted, error=error)
        self.stats["groups_done"] += 1
        self.stats["groups_aborted"] += int(group.aborted)
        log.debug("group %d done in %.2fs (aborted=%s)", a.group_id, time.perf_counter() - t0, group.aborted)

    async def _hold_for_restart(self, group_id: int, error: str) -> None:
        """The engine failed under this group: keep it unreported, so that the restart (which cancels this
        task) re-issues it; if no restart comes within the hang verdict's time, report it aborted after all."""
        w = self.watch
        self.stats["groups_held_for_restart"] += 1
        log.warning(
            "group %d aborted while engine %s is unhealthy (%s); holding it for the restart", group_id, w.sup.url, error
        )
        await asyncio.sleep(w.unhealthy_after_s + 2 * (w.interval_s + w.probe_timeout_s))


def run_worker(
    cfg: Config,
    *,
    broker_address: str,
    engine_urls: list[str],
    tokenizer_path: str,
    worker_id: str,
    retriever: Optional[Retriever] = None,
    watch: Optional[EngineWatch] = None,
) -> dict:
    """Run the agent worker until the broker says shutdown; returns its counters."""
    worker = AgentWorker(
        cfg,
        broker_address=broker_address,
        engine_urls=engine_urls,
        tokenizer_path=tokenizer_path,
        worker_id=worker_id,
        retriever=retriever,
        watch=watch,
    )
    return asyncio.run(worker.run())
