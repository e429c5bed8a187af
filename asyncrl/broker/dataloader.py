"""The broker's dataloader: endless epochs over a fixed list of prompts, seeded shuffle, resumable.

Pure: no I/O (reading Search-R1 parquet/JSONL into ``PromptItem`` lives in ``asyncrl.agent.data``).
Epoch ``e`` visits every prompt exactly once, in the order ``permutation(seed, e)`` (identity when
``shuffle`` is off), so a prompt dropped in epoch ``e`` comes back in epoch ``e + 1``.

    dl = Dataloader(items, seed=1234, shuffle=True)
    item, epoch = dl.next()
    state = dl.state_dict(); dl2 = Dataloader(items, seed=1234); dl2.load_state_dict(state)

``drop_long_prompts`` applies ``data.max_prompt_tokens`` before the dataloader sees the prompts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from asyncrl.broker.types import PromptItem


class Dataloader:
    def __init__(self, items: list[PromptItem], *, seed: int, shuffle: bool = True):
        if not items:
            raise ValueError("data.train_path: the dataset has no prompts; the broker needs at least one")
        self.items = list(items)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.items)

    def _epoch_order(self, epoch: int) -> list[int]:
        n = len(self.items)
        if not self.shuffle:
            return list(range(n))
        return np.random.default_rng([self.seed, epoch]).permutation(n).tolist()

    def next(self) -> tuple[PromptItem, int]:
        """The next prompt and its epoch; rolls over into the next epoch at the end of one."""
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        item = self.items[self._order[self.position]]
        self.position += 1
        return item, self.epoch

    def remaining_in_epoch(self) -> list[int]:
        """Dataset positions (``PromptItem`` list indices) not yet read in the current epoch."""
        return [int(i) for i in self._order[self.position :]]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.items),
        }

    def check_state(self, state: dict) -> None:
        """Raise ``ValueError`` unless ``load_state_dict(state)`` would succeed (nothing changes here)."""
        if state["num_prompts"] != len(self.items):
            raise ValueError(
                f"data.train_path: the checkpoint's dataloader saw {state['num_prompts']} prompts but the dataset "
                f"now has {len(self.items)}; resume with the same training data"
            )
        for k in ("epoch", "position", "seed"):
            if type(state[k]) is not int or state[k] < 0:
                raise ValueError(f"broker state: dataloader.{k} must be an integer >= 0, got {state[k]!r:.80}")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


def drop_long_prompts(
    items: list[PromptItem], count_tokens: Callable[[PromptItem], int], max_tokens: int
) -> tuple[list[PromptItem], list[tuple[int, int]]]:
    """``data.max_prompt_tokens``: the prompts of at most ``max_tokens`` tokens, and ``(index, tokens)`` of each
    one skipped. Every prompt longer than that is skipped (an empty result is an error naming the key)."""
    kept, skipped = [], []
    for it in items:
        n = count_tokens(it)
        if n > max_tokens:
            skipped.append((it.index, n))
        else:
            kept.append(it)
    if items and not kept:
        raise ValueError(
            f"data.max_prompt_tokens: all {len(items)} prompts are longer than {max_tokens} tokens "
            f"(shortest {min(n for _, n in skipped)}); raise it"
        )
    return kept, skipped
