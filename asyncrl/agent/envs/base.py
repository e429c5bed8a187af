"""The environment interface: what an agentic task tells the agent loop, and nothing else (pure: no I/O).

Contract
- An ``Environment`` turns a dataset row (``PromptItem``: ``prompt``, ``answers``, ``extra``) into prompt text
  (``prompt``), reads each generated turn (``parse`` -> ``Parsed``: tool calls, a final answer, or neither, which
  is an invalid turn), shows tool results (``observe``, appended with loss mask 0) and scores the episode
  (``score`` -> a float or a ``Score`` with named metrics, which reach TensorBoard as ``env/<name>``). The tool-call
  syntax is its ``format`` (``asyncrl.agent.envs.formats``: Search-R1-style tags, or the ``<tool_call>`` JSON of
  Qwen chat models), so most environments only write ``prompt`` and ``score``.
- Tools: ``tools`` names what the environment uses: built-in names (``search``, ``python``, ``calculator``),
  ``http:<url>`` (every tool a tool server lists), ``module:attr`` or ``Tool`` objects; ``agentloop.tools`` in the
  config replaces the list. The agent loop resolves them (``asyncrl.agent.envs.registry.make_tools``) and runs
  every call of a turn concurrently, each with its deadline. A call's failure (``ToolError``, a timeout, any
  exception) becomes a ``ToolResult`` with ``error`` set: the policy sees it, ``tool/<name>/errors`` counts it;
  ``ToolUnavailable`` (infrastructure, e.g. a retriever past its retries) aborts the trajectory instead.
- ``reward_name``: what the mean of the reward is called in eval metrics and the run summary (``accuracy`` only
  when the reward is 0/1 correctness, as Search-R1's exact match; else ``mean_reward``).
- The agent loop's invariant is the environment's too: generated ids are never re-encoded; only ``prompt`` and
  ``observe`` text is tokenized.

    class MyEnv(Environment):
        name = "my_env"
        tools = ("python",)
        format = TagFormat(calls={"python": ("python", "code")})
        def prompt(self, item, *, tools, chat_template=False, tokenizer=None): return f"Solve: {item.prompt}\\n"
        def score(self, item, generated_text): return Score(float(...), {"used_python": ...})
    ENV = MyEnv()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from asyncrl.agent.tools.base import Tool
    from asyncrl.broker.types import PromptItem


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Parsed:
    """One turn's generated text as the environment reads it: tool ``calls``, a final ``answer``, or neither (an
    invalid turn: the environment's invalid-turn message follows). An answer ends the episode."""

    calls: tuple[ToolCall, ...] = ()
    answer: Optional[str] = None
    error: str = ""
    """Why nothing usable was found (a malformed call), shown to the policy by ``invalid_observation``."""

    @property
    def kind(self) -> str:
        return "answer" if self.answer is not None else "tool" if self.calls else "invalid"


@dataclass(frozen=True)
class ToolResult:
    """A call's outcome: ``output`` (whatever the tool returned) or ``error`` (what the policy is told)."""

    call: ToolCall
    output: Any = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Score:
    """An episode's reward and the environment's own metrics (``env/<name>`` in TensorBoard, means over the
    batch's trajectories)."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)


def as_score(value: Any, *, where: str) -> Score:
    """A ``score`` or reward function's return value as a ``Score`` (a number, or a ``Score``); ``where`` names the
    function in the error."""
    if isinstance(value, Score):
        bad = [k for k, v in value.metrics.items() if not isinstance(k, str) or not isinstance(v, (int, float))]
        if bad:
            raise TypeError(f"{where}: Score.metrics must map names to numbers; bad entries: {bad[:3]}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: returned {type(value).__name__}, expected a number or a Score")
    return Score(float(value))


class Environment:
    """Subclass it: set ``name`` (and ``tools``, ``format``, ``reward_name`` as needed), write ``prompt`` and
    ``score``. Everything else has a default that follows ``format``."""

    name: str = ""
    tools: Sequence[Any] = ()
    """Tool specs (module docstring); ``agentloop.tools`` replaces them."""
    format: Any
    """How calls are written and results shown (``TagFormat`` or ``QwenFormat``)."""
    reward_name: str = "mean_reward"

    def prompt(self, item: PromptItem, *, tools: Sequence[Tool], chat_template: bool = False, tokenizer=None) -> str:
        raise NotImplementedError(f"environment {self.name!r}: prompt() is not written")

    def score(self, item: PromptItem, generated_text: str) -> Score | float:
        """The episode's reward from all generated text of the trajectory (tool observations excluded)."""
        raise NotImplementedError(f"environment {self.name!r}: score() is not written")

    # -- defaults that follow the format
    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings of a generate call (besides EOS)."""
        return self.format.stop

    def parse(self, generated_text: str) -> Parsed:
        return self.format.parse(generated_text)

    def observe(
        self, results: Sequence[ToolResult], *, turn_end: str = "", chat_template: bool = False, tokenizer=None
    ) -> str:
        """The text appended after a tool turn (loss mask 0). ``turn_end``: the end-of-turn token's text when the
        turn ended with it (a chat template's tool messages follow it), else empty."""
        return self.format.render(results, turn_end=turn_end, chat_template=chat_template, tokenizer=tokenizer)

    def observation_tail(self) -> str:
        """The text an observation ends with, kept when it is cut to ``agentloop.tool.max_obs_tokens``."""
        return self.format.result_tail

    def invalid_observation(self, parsed: Parsed) -> str:
        """The text appended after a turn with neither a call nor an answer."""
        return self.format.invalid_message(parsed)
