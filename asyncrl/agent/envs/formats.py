"""Tool-call formats: how a turn's calls are written, parsed and answered (pure: no I/O).

Contract
- ``TagFormat(calls={tag: (tool, argument)}, answer_tag="answer")``: Search-R1's style. A turn's action is the
  *last complete* ``<tag>...</tag>`` pair of a call tag or the answer tag (the content stripped; an opening tag
  inside the content starts a new pair, so ``<search> a <search> b </search>`` is ``b``); one call per turn, the
  content being the tool's single ``argument``. Stop strings: every closing tag. Results: ``result_open`` +
  output + ``result_close`` (``\\n\\n<result>`` ... ``</result>\\n\\n`` unless set), an error as ``error: <message>``.
- ``QwenFormat(answer_tag=None)``: the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of
  Qwen2.5/Qwen3 chat models (Hermes style), several per turn. ``arguments`` may be an object or a JSON string of
  one. A malformed block makes the turn invalid, naming what is wrong. A turn without a call is the final answer
  (with ``answer_tag`` set, only a complete ``<answer>`` pair is). No stop strings: the model's EOS ends a turn.
  Results: one ``<tool_response>`` block per call, in call order; under ``agentloop.chat_template`` each is a
  ``tool`` message rendered by the tokenizer's own chat template (``chat_tool_turn``), so the observation is
  exactly what the template would put between the assistant's turn and the next one.
- ``tool_schemas(tools)``: OpenAI-style function schemas, what chat templates take as ``tools=``;
  ``describe_tools(tools)``: the same as plain text, for prompts of base models; ``chat_prompt(tokenizer, content,
  tools=...)``: a chat model's prompt with the tools rendered by its own template.

    fmt = QwenFormat()
    fmt.parse('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    # Parsed(calls=(ToolCall("python", {"code": "print(1)"}),))
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from asyncrl.agent.envs.base import Parsed, ToolCall, ToolResult

__all__ = [
    "QwenFormat",
    "TagFormat",
    "ToolCallFormat",
    "chat_prompt",
    "chat_tool_turn",
    "describe_tools",
    "result_text",
    "tool_schemas",
]


def result_text(result: ToolResult) -> str:
    """A result as observation text: the output (``str`` of a non-string), or ``error: <message>``."""
    if result.error is not None:
        return f"error: {result.error}"
    out = result.output
    return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)


class ToolCallFormat:
    """The interface both formats implement (module docstring)."""

    stop: tuple[str, ...] = ()
    result_tail: str = ""

    def parse(self, generated_text: str) -> Parsed:
        raise NotImplementedError

    def render(
        self, results: Sequence[ToolResult], *, turn_end: str = "", chat_template: bool = False, tokenizer=None
    ) -> str:
        raise NotImplementedError

    def invalid_message(self, parsed: Parsed) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class TagFormat(ToolCallFormat):
    calls: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Call tag -> (tool name, the argument its content fills)."""
    answer_tag: str = "answer"
    result_open: str = "\n\n<result>"
    result_close: str = "</result>\n\n"
    invalid: Optional[str] = None
    """The invalid-turn message (default: one naming every tag)."""

    def __post_init__(self):
        tags = [*self.calls, self.answer_tag]
        bad = [t for t in tags if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", t)]
        if bad or len(set(tags)) != len(tags):
            raise ValueError(f"TagFormat: tags must be distinct names, got {tags}")
        alt = "|".join(re.escape(t) for t in sorted(tags, key=len, reverse=True))
        object.__setattr__(self, "_re", re.compile(rf"<({alt})>((?:(?!<(?:{alt})>).)*?)</\1>", re.DOTALL))

    @property
    def stop(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(f"</{t}>" for t in (*self.calls, self.answer_tag))

    @property
    def result_tail(self) -> str:  # type: ignore[override]
        return self.result_close

    def parse(self, generated_text: str) -> Parsed:
        last = None
        for last in self._re.finditer(generated_text):  # noqa: B007  (the last match is the action)
            pass
        if last is None:
            return Parsed()
        tag, content = last.group(1), last.group(2).strip()
        if tag == self.answer_tag:
            return Parsed(answer=content)
        tool, arg = self.calls[tag]
        return Parsed(calls=(ToolCall(tool, {arg: content}),))

    def render(
        self, results: Sequence[ToolResult], *, turn_end: str = "", chat_template: bool = False, tokenizer=None
    ) -> str:
        return "".join(f"{self.result_open}{result_text(r)}{self.result_close}" for r in results)

    def invalid_message(self, parsed: Parsed) -> str:
        if self.invalid is not None:
            return self.invalid
        how = " ".join(
            f"If I want to call {tool}, I should put the {arg} between <{tag}> and </{tag}>."
            for tag, (tool, arg) in self.calls.items()
        )
        return (
            f"\nMy previous action is invalid. {how} If I want to give the final answer, I should put the answer "
            f"between <{self.answer_tag}> and </{self.answer_tag}>. Let me try again.\n"
        )


_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class QwenFormat(ToolCallFormat):
    answer_tag: Optional[str] = None
    """None: a turn without a call is the answer (its text); else only a complete ``<answer_tag>`` pair is."""

    @property
    def stop(self) -> tuple[str, ...]:  # type: ignore[override]
        return (f"</{self.answer_tag}>",) if self.answer_tag else ()

    @property
    def result_tail(self) -> str:  # type: ignore[override]
        return "</tool_response>"

    def parse(self, generated_text: str) -> Parsed:
        blocks = _CALL_RE.findall(generated_text)
        calls = []
        for i, block in enumerate(blocks):
            call, why = _read_call(block)
            if call is None:
                return Parsed(error=f"tool call {i + 1} is malformed: {why}")
            calls.append(call)
        if calls:
            return Parsed(calls=tuple(calls))
        if "<tool_call>" in generated_text:
            return Parsed(error="a <tool_call> block is not closed with </tool_call>")
        if self.answer_tag is None:
            return Parsed(answer=generated_text.strip())
        found = re.findall(rf"<{self.answer_tag}>(.*?)</{self.answer_tag}>", generated_text, re.DOTALL)
        return Parsed(answer=found[-1].strip()) if found else Parsed()

    def render(
        self, results: Sequence[ToolResult], *, turn_end: str = "", chat_template: bool = False, tokenizer=None
    ) -> str:
        if chat_template:
            return chat_tool_turn(tokenizer, [result_text(r) for r in results], turn_end)
        body = "".join(f"\n<tool_response>\n{result_text(r)}\n</tool_response>" for r in results)
        return body + "\n"

    def invalid_message(self, parsed: Parsed) -> str:
        why = parsed.error or f"no tool call and no <{self.answer_tag}> pair"
        return (
            f'\nMy previous turn is invalid ({why}). A tool call is <tool_call>{{"name": <tool name>, '
            f'"arguments": <JSON object>}}</tool_call>. Let me try again.\n'
        )


def _read_call(block: str) -> tuple[Optional[ToolCall], str]:
    try:
        obj = json.loads(block)
    except ValueError as e:
        return None, f"not JSON ({e.msg} at character {e.pos})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, 'no "name" string'
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None, f'"arguments" of {name} is a string that is not a JSON object'
    if not isinstance(args, dict):
        return None, f'"arguments" of {name} must be an object, got {type(args).__name__}'
    return ToolCall(name, args), ""


def tool_schemas(tools: Sequence[Any]) -> list[dict]:
    """``[{"type": "function", "function": {"name", "description", "parameters"}}]``: a chat template's ``tools``."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


def describe_tools(tools: Sequence[Any]) -> str:
    """The tools as plain text (for prompts that do not go through a chat template)."""
    return "\n".join(json.dumps(s["function"], ensure_ascii=False) for s in tool_schemas(tools))


def chat_prompt(tokenizer, content: str, *, tools: Sequence[Any] = (), system: Optional[str] = None) -> str:
    """``content`` as the user message (after ``system`` when given), the tools rendered by the tokenizer's chat
    template (``tools=``, as HF's), and the generation prompt."""
    if tokenizer is None:
        raise ValueError("agentloop.chat_template = true needs a tokenizer with a chat template")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    schemas = tool_schemas(tools) or None
    return tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False)


_SENTINEL = "\u2063ASSISTANT\u2063"


def chat_tool_turn(tokenizer, contents: Sequence[str], turn_end: str = "") -> str:
    """What the tokenizer's chat template puts after an assistant turn that made calls: the tool messages
    (``contents``, one per call) and the next assistant header. ``turn_end``: the text of the end-of-turn token the
    turn ended with (e.g. ``<|im_end|>``), already in the trajectory, so not repeated."""
    if tokenizer is None:
        raise ValueError("agentloop.chat_template = true needs a tokenizer with a chat template")
    head = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    full = tokenizer.apply_chat_template(
        head + [{"role": "tool", "content": c} for c in contents], add_generation_prompt=True, tokenize=False
    )
    at = full.find(_SENTINEL)
    if at < 0:
        raise ValueError("the chat template does not render an assistant message's content")
    suffix = full[at + len(_SENTINEL) :]
    return suffix[len(turn_end) :] if turn_end and suffix.startswith(turn_end) else suffix
