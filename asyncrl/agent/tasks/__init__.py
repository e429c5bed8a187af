"""Agent tasks: a small registry, so a second task is one file.

A task turns a question into a prompt, parses the action out of one turn's generated text,
formats the tool's observation and the invalid-action message, and scores the generated text.
It is pure (no I/O): the agent loop calls it between engine and retriever calls.

    task = get_task("searchr1")
    text = task.build_prompt("What is the capital of Zorvania", chat_template=False)
    action = task.parse_action(" <search> capital of Zorvania </search>")   # Action("search", ...)

Lookup: ``get_task(name)`` returns a registered task, else imports ``asyncrl.agent.tasks.<name>``
and returns its module-level ``TASK``, else, for ``"package.module:attr"``, that attribute.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Protocol


@dataclass(frozen=True)
class Action:
    kind: Literal["search", "answer", "invalid"]
    """``search``/``answer`` when a complete tag pair was found, else ``invalid``."""
    content: str = ""
    """The stripped text between the tags (empty for ``invalid``)."""


class Task(Protocol):
    name: str
    stop: tuple[str, ...]
    """Stop strings of a generate call (besides EOS)."""
    invalid_action_message: str

    def build_prompt(self, question: str, *, chat_template: bool = False, tokenizer: Any = None) -> str: ...

    def parse_action(self, generated_text: str) -> Action: ...

    def format_observation(self, docs: Sequence[dict]) -> str: ...

    def reward(self, generated_text: str, answers: Sequence[str]) -> float: ...


_REGISTRY: dict[str, Task] = {}


def register_task(task: Task, *, name: Optional[str] = None) -> Task:
    """Register ``task`` under ``name`` (default ``task.name``); returns it."""
    _REGISTRY[name or task.name] = task
    return task


def get_task(name: str) -> Task:
    """The task called ``name`` (see the module docstring for the lookup order)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module_name, attr = name.split(":", 1)
        return getattr(importlib.import_module(module_name), attr)
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise ValueError(f"agentloop.task_name: unknown task {name!r}; known: {sorted(available_tasks())}") from None
    task = getattr(module, "TASK", None)
    if task is None:
        raise ValueError(f"agentloop.task_name: module {module.__name__} defines no TASK")
    return register_task(task, name=name)


def available_tasks() -> list[str]:
    found = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    return sorted(found | set(_REGISTRY))
