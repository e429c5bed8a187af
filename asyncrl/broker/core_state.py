"""The broker core's checkpoint: its state, and checking a state before ``load_state_dict`` restores it (pure).

A checkpoint's broker state (``BrokerCore.state_dict``) is checked whole before anything changes, so a bad
state raises ``ValueError`` naming the field and leaves the running core as it was.

    validate_state(core.state_dict(), group_size=4)   # None, or ValueError("broker state: ...")
"""

from __future__ import annotations

from collections import Counter, deque


class Checkpointing:
    """``state_dict`` / ``load_state_dict`` of ``BrokerCore`` (a mixin: the state is the core's)."""

    def state_dict(self) -> dict:
        """Dataloader position, version, queued prompts, in-flight prompts (re-issued on resume), the
        buffered groups (``Group`` objects; the protocol encodes them) and the lifetime counters."""
        return {
            "counters": {k: int(v) for k, v in self.counters.items()},
            "version": self.version,
            "next_group_id": self._next_group_id,
            "dataloader": self.dataloader.state_dict(),
            "queued": [(it, e) for it, e in self._retry],
            "inflight": [(g.item, g.epoch) for g in sorted(self._inflight.groups.values(), key=lambda g: g.group_id)],
            "buffered": self.buffer.groups(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore after ``validate_state`` (a bad state, dataloader part included, raises ``ValueError`` naming the field
        and changes nothing); groups now in flight are cancelled (see ``take_cancelled``), the checkpoint's in-flight
        prompts are issued first and count as re-issued, so ``issued == trained + dropped + held + reissued``
        holds across the resume. A state without counters (older checkpoints) starts them from its groups."""
        validate_state(state, group_size=self.s.group_size)
        self.dataloader.check_state(state["dataloader"])
        counters = state.get("counters")
        if counters is None:
            counters = {"issued": len(state["inflight"]) + len(state["buffered"])}
        self._advance()
        self._cancelled += self._inflight.cancel_all()
        self.version = int(state["version"])
        self._next_group_id = max(self._next_group_id, int(state["next_group_id"]))
        self.dataloader.load_state_dict(state["dataloader"])
        self._retry = deque(list(state["inflight"]) + list(state["queued"]))
        self.buffer.restore(list(state["buffered"]))
        self.counters = Counter({k: int(v) for k, v in counters.items()})
        self.counters["reissued"] += len(state["inflight"])
        self._batch = None
        self._admit()


_ACCOUNTED = ("issued", "trained", "dropped", "reissued")


def validate_state(state: dict, *, group_size: int) -> None:
    """Check a broker state before anything is restored: ``ValueError`` naming the field when the version,
    the group ids, the buffered groups or the counters are out of range, or when the counters break
    ``issued == trained + dropped + held + reissued`` (held = the state's in-flight + buffered groups)."""
    for key in ("version", "next_group_id"):
        v = state.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"broker state: {key} must be an integer >= 0, got {v!r}")
    buffered = state["buffered"]
    ids = [g.group_id for g in buffered]
    if len(set(ids)) != len(ids):
        raise ValueError("broker state: buffered group ids are not unique")
    for g in buffered:
        if not 0 <= g.group_id < state["next_group_id"]:
            raise ValueError(
                f"broker state: buffered group {g.group_id} is not below next_group_id {state['next_group_id']}"
            )
        if len(g.trajectories) != group_size:
            raise ValueError(
                f"broker state: buffered group {g.group_id} has {len(g.trajectories)} trajectories, "
                f"expected rollout.n_samples_per_prompt = {group_size}"
            )
    counters = state.get("counters")
    if counters is None:
        return
    if not isinstance(counters, dict):
        raise ValueError(f"broker state: counters must be a map, got {type(counters).__name__}")
    for k, v in counters.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"broker state: counters.{k} must be an integer >= 0, got {v!r}")
    issued, trained, dropped, reissued = (counters.get(k, 0) for k in _ACCOUNTED)
    held = len(state["inflight"]) + len(buffered)
    if issued != trained + dropped + held + reissued:
        raise ValueError(
            f"broker state: counters break issued == trained + dropped + held + reissued "
            f"({issued} != {trained} + {dropped} + {held} + {reissued})"
        )
