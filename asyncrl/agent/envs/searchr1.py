"""The Search-R1 environment: prompt template, action parser, observation format, exact-match reward.

Texts and rules as in the Search-R1 repository (see shared/notes/search-r1.md):
- prompt: the base template with the question (``?`` appended when missing) and a trailing
  newline; instruct models get it as the single user message of the chat template, with the
  generation prompt;
- action: the last complete ``<search>...</search>`` / ``<answer>...</answer>`` of one turn's
  generated text (content stripped); no complete pair -> invalid action;
- observation: ``\\n\\n<information>Doc 1(Title: t) text\\nDoc 2(...)...</information>\\n\\n``
  where a document's title is the first line of its ``contents`` and its text the rest;
- reward: 1.0 when the last complete ``<answer>`` of the *generated* text, normalized (lowercase,
  no punctuation, no a/an/the, single spaces), equals a normalized gold answer, else 0.0. Only
  generated text is ever scored, so the example ``<answer> Beijing </answer>`` of the prompt
  cannot count.

``ENV`` (``SearchR1Env``) is this on the environment interface (``asyncrl.agent.envs.base``): the ``search`` tool,
``TagFormat`` with Search-R1's tags and texts, ``reward_name = "accuracy"``. A custom reward is a subclass that
overrides ``reward(generated_text, answers)``, or ``agentloop.reward_path``.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.agent.envs.base import Environment, Parsed, Score, ToolCall, ToolResult
from asyncrl.agent.envs.formats import TagFormat, result_text


@dataclass(frozen=True)
class Action:
    kind: Literal["search", "answer", "invalid"]
    """``search``/``answer`` when a complete tag pair was found, else ``invalid``."""
    content: str = ""
    """The stripped text between the tags (empty for ``invalid``)."""


PROMPT_TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)
"""Search-R1's base template, verbatim (its typo "as your want" included: token parity matters)."""

INVALID_ACTION_MESSAGE = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

STOP = ("</search>", "</answer>")

# The innermost tag pair: the content may not contain another opening tag, so
# "<search> a <search> b </search>" yields "b" (the last complete action).
_ACTION_RE = re.compile(r"<(search|answer)>((?:(?!<(?:search|answer)>).)*?)</\1>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_question(question: str) -> str:
    question = question.strip()
    if question and not question.endswith("?"):
        question += "?"
    return question


def build_prompt(question: str, *, chat_template: bool = False, tokenizer: Any = None) -> str:
    """The full prompt text. ``chat_template`` needs a tokenizer with ``apply_chat_template``."""
    content = PROMPT_TEMPLATE.format(question=normalize_question(question))
    if not chat_template:
        return content
    if tokenizer is None:
        raise ValueError("agentloop.chat_template = true needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def parse_action(generated_text: str) -> Action:
    """The last complete search/answer action of one turn's generated text."""
    matches = list(_ACTION_RE.finditer(generated_text))
    last = matches[-1] if matches else None
    if last is None:
        return Action("invalid")
    return Action(last.group(1), last.group(2).strip())  # type: ignore[arg-type]


def format_passages(docs: Sequence[dict]) -> str:
    """``Doc i(Title: t) text`` lines, as Search-R1's ``_passages2string``."""
    lines = []
    for i, doc in enumerate(docs):
        contents = doc["contents"]
        title, _, text = contents.partition("\n")
        lines.append(f"Doc {i + 1}(Title: {title}) {text}\n")
    return "".join(lines)


OBSERVATION_HEAD = "\n\n<information>"
OBSERVATION_TAIL = "</information>\n\n"


def format_observation(docs: Sequence[dict]) -> str:
    """The information block appended after a search (loss mask 0)."""
    return f"{OBSERVATION_HEAD}{format_passages(docs).strip()}{OBSERVATION_TAIL}"


def normalize_answer(text: str) -> str:
    """Search-R1 / SQuAD normalization: lowercase, strip punctuation, drop articles, collapse spaces."""
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def extract_answer(generated_text: str) -> str | None:
    """The stripped content of the last complete ``<answer>`` pair, or None."""
    matches = list(_ANSWER_RE.finditer(generated_text))
    last = matches[-1] if matches else None
    return None if last is None else last.group(1).strip()


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    pred = normalize_answer(prediction)
    if not pred:  # an empty answer never matches
        return False
    return any(pred == normalize_answer(gold) for gold in answers)


def compute_reward(generated_text: str, answers: Sequence[str]) -> float:
    """1.0 for an exact match of the generated text's last answer with any gold answer, else 0.0."""
    answer = extract_answer(generated_text)
    if answer is None:
        return 0.0
    return 1.0 if exact_match(answer, answers) else 0.0


class SearchR1Env(Environment):
    name = "searchr1"
    tools = ("search",)
    reward_name = "accuracy"
    format = TagFormat(
        calls={"search": ("search", "query")},
        answer_tag="answer",
        result_open=OBSERVATION_HEAD,
        result_close=OBSERVATION_TAIL,
        invalid=INVALID_ACTION_MESSAGE,
    )
    stop = STOP
    invalid_action_message = INVALID_ACTION_MESSAGE

    def prompt(self, item, *, tools=(), chat_template: bool = False, tokenizer: Any = None) -> str:
        return self.build_prompt(item.prompt, chat_template=chat_template, tokenizer=tokenizer)

    def parse(self, generated_text: str) -> Parsed:
        action = self.parse_action(generated_text)
        if action.kind == "answer":
            return Parsed(answer=action.content)
        if action.kind == "search":
            return Parsed(calls=(ToolCall("search", {"query": action.content}),))
        return Parsed()

    def observe(self, results: Sequence[ToolResult], **_) -> str:
        """The information block of the search's documents (an error, e.g. a call of another tool, in its place)."""
        return "".join(
            self.format_observation(r.output) if r.ok else f"{OBSERVATION_HEAD}{result_text(r)}{OBSERVATION_TAIL}"
            for r in results
        )

    def observation_tail(self) -> str:
        return OBSERVATION_TAIL

    def invalid_observation(self, parsed: Parsed) -> str:
        return self.invalid_action_message

    def score(self, item, generated_text: str) -> Score:
        return Score(float(self.reward(generated_text, item.answers)))

    # Search-R1's own API, kept for subclasses and tests
    def build_prompt(self, question: str, *, chat_template: bool = False, tokenizer: Any = None) -> str:
        return build_prompt(question, chat_template=chat_template, tokenizer=tokenizer)

    def parse_action(self, generated_text: str) -> Action:
        return parse_action(generated_text)

    def format_observation(self, docs: Sequence[dict]) -> str:
        return format_observation(docs)

    def reward(self, generated_text: str, answers: Sequence[str]) -> float:
        return compute_reward(generated_text, answers)


SearchR1Task = SearchR1Env
"""The name custom Search-R1 rewards subclassed before environments existed."""

ENV = SearchR1Env()
TASK = ENV
