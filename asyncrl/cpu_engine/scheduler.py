"""The CPU engine's scheduler: continuous batching, sampling, stop rules, pause modes, prefix reuse.

Contract
- One engine thread owns all state and calls ``run(stop_event)``; other threads only use the
  thread-safe ``submit(req)`` (new request; duplicate in-flight rid -> ``RequestError``) and
  ``call(fn)`` (run ``fn(scheduler)`` on the engine thread between two model steps; returns a
  ``concurrent.futures.Future``). Every control action (pause, abort, weight load) goes through
  ``call``, so it never overlaps a forward pass.
- Invariant: running request i owns KV row i (rows 0..n-1; a finished request's row is refilled
  by moving the last one down); its KV holds every token but the last sampled one
  (``kv_len == len(input_ids) + len(output_ids) - 1``). Prefill, continuation after a prefix hit,
  re-prefill after a retract and decode are all one operation: feed ``tokens[kv_len:]``, sample.
- Pause modes (SGLang's): ``abort`` finishes running and queued requests now (finish_reason
  abort, partial output); ``retract`` frees running requests' KV and puts them back at the head
  of the queue with their tokens (they finish after ``resume``, ``num_retractions`` + 1);
  ``in_place`` just stops stepping (KV kept). Requests submitted while paused wait for ``resume``.
- ``weight_versions`` of a request: runs ``{"version", "start", "end"}`` over output token indices,
  split whenever ``weight_version`` changed between two of its tokens.
- ``enable_return_routed_experts`` (SGLang's flag; a mixture-of-experts model): the KV pool keeps every cached
  token's routing (prefix-cache entries too), and a request that asked (``routed_experts_start``) takes, when it
  finishes with its KV row, the routing of positions ``[start, len(tokens) - 1)`` (SGLang's
  ``_maybe_collect_routed_experts``: every token the model ran, prompt and output, but the last one sampled).
- Each finished request is delivered once, as SGLang's ``/generate`` JSON, through its
  ``deliver`` callback (called on the engine thread); ``after_step``, when given, runs on the engine thread
  after each step (the engine hands that step's answers to its event loop in one wake-up).

    sched = Scheduler(model, decode_fn, max_running_requests=8, seed=0, weight_version="default")
    threading.Thread(target=sched.run, args=(stop_event,), daemon=True).start()
    sched.submit(Request(rid="a", input_ids=[1, 2, 3], params=parse_sampling_params({}), deliver=print))
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from asyncrl.cpu_engine.kv_pool import KVPool
from asyncrl.cpu_engine.model import CausalLM
from asyncrl.cpu_engine.prefix_cache import MIN_PREFIX_TOKENS, PrefixCache
from asyncrl.cpu_engine.request import ABORTED, Request, response
from asyncrl.cpu_engine.sampler import sample
from asyncrl.cpu_engine.sampling_params import RequestError
from asyncrl.engine.client import ENGINE_PAUSE_MODES as PAUSE_MODES

# Padded prefill tokens per forward (rows x longest feed): bounds the padding waste and the
# attention-mask memory of one prefill batch.
PREFILL_TOKEN_BUDGET = 2048
IDLE_WAIT_S = 0.2  # the longest an idle engine thread waits before it looks at its stop event again


@dataclass
class Counters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    retractions: int = 0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    """(monotonic time, tokens generated in that step), for the generation throughput gauge."""


def _wants_prompt_logprobs(r: Request) -> bool:
    """The request asked for its prompt's log-probs and has not had them yet (its feed needs every position)."""
    return r.return_logprob and r.logprob_start_len >= 0 and r.input_logprobs is None


def check_submittable(req: Request, context_length: int) -> None:
    """What a request must be for ``Scheduler.submit`` (besides a rid not in flight): ``RequestError`` if not."""
    if not req.input_ids:
        raise RequestError("input_ids is empty")
    if len(req.input_ids) >= context_length:
        raise RequestError(f"input_ids has {len(req.input_ids)} tokens; the context length is {context_length}")


def duplicate_rid(rid: str) -> RequestError:
    return RequestError(f"Duplicate request ID detected: {rid}")  # SGLang 0.5.23's text


class Scheduler:
    def __init__(
        self,
        model: CausalLM,
        decode: Callable[[list[int], bool], str],
        *,
        max_running_requests: int,
        seed: int = 0,
        weight_version: str = "default",
        prefix_cache_tokens: int = 32768,
        context_length: Optional[int] = None,
        after_step: Optional[Callable[[], None]] = None,
        poll_inbox: Optional[Callable[[float], None]] = None,
        enable_return_routed_experts: bool = False,
    ):
        self.model = model
        self.decode = decode
        self.max_running = max_running_requests
        self.weight_version = weight_version
        self.context_length = context_length or model.spec.max_position_embeddings
        self.kv = KVPool(model.spec, max_running_requests, routing=enable_return_routed_experts)
        self.prefix = PrefixCache(prefix_cache_tokens)
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_ids = set(model.spec.eos_token_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.paused: Optional[str] = None
        self.counters = Counters()
        self._cond = threading.Condition()
        self._inbox: list[Request] = []
        self._calls: list[tuple[Callable[[Scheduler], Any], cf.Future]] = []
        self._live: set[str] = set()  # rids submitted and not yet delivered (guarded by _cond)
        self.after_step = after_step
        """Called on the engine thread after each step (and each round of control calls): the engine hands the
        answers its requests' ``deliver`` callbacks queued to its HTTP process at once."""
        self.poll_inbox = poll_inbox
        """When given, the engine thread's own receive (``scheduler_process``: its ZeroMQ socket, read between two
        steps as SGLang's scheduler does): ``poll_inbox(0)`` before each step takes what arrived (through
        ``submit`` and ``call``) and ``poll_inbox(timeout_s)`` replaces the idle wait; whoever calls ``submit``
        or ``call`` from another thread then wakes that poll itself."""

    # ---- thread-safe entry points ------------------------------------------------------
    def submit(self, req: Request) -> None:
        check_submittable(req, self.context_length)
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(req.params.sampling_seed)
        with self._cond:
            if req.rid in self._live:
                raise duplicate_rid(req.rid)
            self._live.add(req.rid)
            self._inbox.append(req)
            self._cond.notify()

    def call(self, fn: Callable[[Scheduler], Any]) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._cond:
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    # ---- engine thread ---------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        # inference mode for the whole engine thread (steps and calls alike): less per-op bookkeeping than
        # no_grad, and every tensor the thread makes (KV rows, the standby bank) is only ever written on it
        with torch.inference_mode():
            while not stop.is_set():
                if self.poll_inbox is not None:
                    self.poll_inbox(0.0)
                self._drain()
                busy = self.paused is None and bool(self.running or self.waiting)
                if busy:
                    self.step()
                if self.after_step is not None:
                    self.after_step()
                if busy:
                    continue
                if self.poll_inbox is not None:
                    self.poll_inbox(IDLE_WAIT_S)
                    continue
                with self._cond:
                    if not self._inbox and not self._calls:
                        self._cond.wait(timeout=IDLE_WAIT_S)

    def _drain(self) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
        self.waiting.extend(inbox)
        for fn, fut in calls:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                out, err = fn(self), None
            except BaseException as e:  # handed to the caller, which reports it
                out, err = None, e
            if self.after_step is not None:  # the answers of requests the call finished go out before its own
                self.after_step()
            if err is None:
                fut.set_result(out)
            else:
                fut.set_exception(err)

    def step(self) -> None:
        """One scheduling step: ONE forward for the running requests' decode and the first chunk of admitted
        requests' prefill (a mixed batch, as SGLang's mixed chunked prefill), then any further prefill chunks."""
        admit: list[Request] = []
        while self.waiting and len(self.running) + len(admit) < self.max_running:
            admit.append(self.waiting.popleft())
        chunks = self._admit(admit) if admit else []
        first = self.running[: len(self.running) - len(admit)] + (chunks[0] if chunks else [])
        if first:
            self._extend(first, row0=0)
        for chunk in chunks[1:]:
            self._extend(chunk, row0=chunk[0].row)
        self._compact()

    def _admit(self, reqs: list[Request]) -> list[list[Request]]:
        """Give the admitted requests rows after the running ones (KV of a prefix hit written in) and cut them
        into prefill chunks of contiguous rows under the padded-token budget, shortest feeds first."""
        hits: dict[int, tuple[torch.Tensor, ...]] = {}
        for r in reqs:
            toks = r.tokens()
            r.kv_len = 0
            if r.logprob_start_len < 0 and not r.retracted:
                hit, kv = self.prefix.lookup(toks, len(toks) - 1)
                if hit >= MIN_PREFIX_TOKENS and kv is not None:
                    r.kv_len = hit
                    r.cached_tokens = hit
                    hits[id(r)] = kv
            if not r.retracted:
                self.counters.prompt_tokens += len(r.input_ids)
                self.counters.cached_tokens += r.cached_tokens
        reqs.sort(key=lambda r: len(r.tokens()) - r.kv_len)
        start = len(self.running)
        for i, r in enumerate(reqs):
            r.row = start + i
            self.running.append(r)
            if r.kv_len:
                self.kv.write_row(r.row, hits[id(r)], r.kv_len)
        chunks, i = [], 0
        while i < len(reqs):
            j = i + 1
            while j < len(reqs) and (j + 1 - i) * (len(reqs[j].tokens()) - reqs[j].kv_len) <= PREFILL_TOKEN_BUDGET:
                j += 1
            chunks.append(reqs[i:j])
            i = j
        return chunks

    def _extend(self, batch: list[Request], *, row0: int) -> None:
        """Feed every request its tokens[kv_len:] (one packed forward), sample one token each, apply stop rules."""
        feeds = [r.feed() for r in batch]
        n_list = [len(f) for f in feeds]
        toks = torch.tensor(list(itertools.chain.from_iterable(feeds)), dtype=torch.long)
        n_B = torch.tensor(n_list)
        past_B = torch.tensor([r.kv_len for r in batch])
        # every position's hidden state only for a request that wants its prompt's log-probs
        need_all = any(_wants_prompt_logprobs(r) for r in batch)
        hidden = self.model.forward(toks, past_B, n_B, self.kv, row0=row0, last_only=not need_all)
        if need_all and len(toks) > len(batch):
            logits = self.model.logits(hidden[torch.cumsum(n_B, 0) - 1])
        else:
            logits = self.model.logits(hidden)
        off = 0
        for r, n in zip(batch, n_list):
            if _wants_prompt_logprobs(r):
                self._input_logprobs(r, hidden[off : off + len(r.input_ids)])
            r.kv_len += n
            off += n
        now = time.monotonic()
        live = [b for b, r in enumerate(batch) if len(r.output_ids) < r.params.max_new_tokens]
        for r in batch:
            if r.params.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
        if not live:
            return
        if len(live) < len(batch):
            logits = logits[live]
        tokens, logprobs = sample(logits, [batch[b] for b in live], generator=self.generator, eos_ids=self.eos_ids)
        self.counters.generation_tokens += len(live)
        self.counters.recent.append((now, len(live)))
        for b, tok, lp in zip(live, tokens, logprobs):
            self._append(batch[b], tok, lp)

    def _input_logprobs(self, r: Request, hidden_PH: torch.Tensor) -> None:
        logits = self.model.logits(hidden_PH).float()
        if not r.params.greedy:
            logits = logits / r.params.temperature
        lp = torch.log_softmax(logits, dim=-1)
        ids = torch.tensor(r.input_ids)
        vals = lp[:-1].gather(1, ids[1:, None])[:, 0].tolist()
        full: list[Optional[float]] = [None] + vals
        r.input_logprobs = full[r.logprob_start_len :]

    def _append(self, r: Request, tok: int, lp: float) -> None:
        idx = len(r.output_ids)
        r.output_ids.append(tok)
        r.output_logprobs.append(lp)
        wv = r.weight_versions
        if wv and wv[-1]["version"] == self.weight_version and wv[-1]["end"] == idx:
            wv[-1]["end"] = idx + 1
        else:
            wv.append({"version": self.weight_version, "start": idx, "end": idx + 1})
        p = r.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            if len(r.output_ids) >= p.min_new_tokens:
                self._finish(r, {"type": "stop", "matched": tok})
                return
        if p.stop and len(r.output_ids) >= p.min_new_tokens:
            window = max(len(s) for s in p.stop) + 4
            tail = self.decode(r.output_ids[-window:], p.skip_special_tokens)
            for s in p.stop:
                if s in tail:
                    r.stop_text = s
                    self._finish(r, {"type": "stop", "matched": s})
                    return
        if len(r.output_ids) >= p.max_new_tokens:
            self._finish(r, {"type": "length", "length": p.max_new_tokens})
        elif len(r.input_ids) + len(r.output_ids) >= self.context_length:
            self._finish(r, {"type": "length", "length": len(r.output_ids)})

    # ---- finishing -------------------------------------------------------------------------
    def _finish(self, r: Request, reason: dict) -> None:
        """Mark finished and deliver; the KV row is released by ``_compact``."""
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        if reason["type"] == "abort":
            self.counters.aborted_requests += 1
        else:
            self.counters.finished_requests += 1
        if r.row >= 0 and r.routed_experts_start is not None and self.kv.routed is not None:
            end = len(r.input_ids) + len(r.output_ids) - 1
            r.routed_experts = self.kv.routed[r.row, min(r.routed_experts_start, end) : end].clone()
        if r.row >= 0 and r.kv_len >= MIN_PREFIX_TOKENS and reason["type"] != "abort":
            self.prefix.insert(tuple(r.tokens()[: r.kv_len]), *self.kv.read_row(r.row, r.kv_len))
        try:
            r.deliver(self.response(r))
        finally:
            with self._cond:
                self._live.discard(r.rid)

    def _compact(self) -> None:
        keep = [r for r in self.running if r.finish_reason is None]
        if len(keep) == len(self.running):
            return
        n = len(keep)
        # fill each hole below n with a request from a row >= n: one KV move per hole
        holes = sorted(r.row for r in self.running if r.finish_reason is not None and r.row < n)
        movers = sorted((r for r in keep if r.row >= n), key=lambda r: r.row)
        for hole, r in zip(holes, movers):
            self.kv.move_row(r.row, hole, r.kv_len)
            r.row = hole
        for r in self.running:
            if r.finish_reason is not None:
                r.row = -1
        self.running = sorted(keep, key=lambda r: r.row)
        assert [r.row for r in self.running] == list(range(n))

    def response(self, r: Request) -> dict:
        return response(r, decode=self.decode, weight_version=self.weight_version)

    def abort(self, rid: Optional[str] = None, *, abort_all: bool = False) -> int:
        """Abort matching requests (rid prefix match, as SGLang); returns how many."""

        def hit(r: Request) -> bool:
            return abort_all or (rid is not None and rid != "" and r.rid.startswith(rid))

        n = 0
        for r in list(self.running):
            if hit(r):
                self._finish(r, dict(ABORTED))
                n += 1
        still = collections.deque()
        for r in self.waiting:
            if hit(r):
                self._finish(r, {"type": "abort", "message": "Abort in waiting queue"})
                n += 1
            else:
                still.append(r)
        self.waiting = still
        self._compact()
        return n

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode={mode!r} is not one of {list(PAUSE_MODES)}")
        self._drain_requests_only()
        if mode == "abort":
            self.abort(abort_all=True)
        elif mode == "retract":
            for r in self.running:
                r.kv_len = 0
                r.row = -1
                r.retracted = True
                r.num_retractions += 1
                self.counters.retractions += 1
            self.waiting.extendleft(reversed(self.running))
            self.running = []
        self.paused = mode

    def _drain_requests_only(self) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        self.waiting.extend(inbox)

    def resume(self) -> None:
        self.paused = None

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests run or, unless paused, wait (as SGLang's
        ``is_fully_idle(ignore_waiting=paused)``)."""
        if self.running or (self.paused is None and self.waiting):
            return False
        self.prefix.clear()
        return True

    def metrics(self) -> dict[str, float]:
        c = self.counters
        now = time.monotonic()
        recent = [(t, n) for t, n in c.recent if now - t < 10.0]
        span = (now - recent[0][0]) if len(recent) > 1 else 0.0
        used = sum(r.kv_len for r in self.running)
        return {
            "num_running_reqs": len(self.running),
            "num_queue_reqs": len(self.waiting),
            "num_paused_reqs": len(self.running) if self.paused == "in_place" else 0,
            "num_retracted_reqs": sum(1 for r in self.waiting if r.retracted),
            "token_usage": used / max(1, self.kv.max_rows * self.kv.capacity),
            "cache_hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "gen_throughput": sum(n for _, n in recent[1:]) / span if span > 0 else 0.0,
            "prompt_tokens_total": c.prompt_tokens,
            "generation_tokens_total": c.generation_tokens,
            "cached_tokens_total": c.cached_tokens,
            "num_requests_total": c.finished_requests + c.aborted_requests,
            "num_aborted_requests_total": c.aborted_requests,
            "num_retractions_total": c.retractions,
        }
