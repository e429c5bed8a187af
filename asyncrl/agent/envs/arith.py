"""The arithmetic environment: word problems the policy solves by calling the calculator (pure: no I/O).

Contract
- Data: rows with ``question`` (a word problem) and ``golden_answers`` (the integer, as a string), e.g. the
  synthetic ones of ``asyncrl.embedded.arith`` ("Mira packs 17 boxes of 23 pears and eats 4. How many pears are
  left?" -> ``["387"]``).
- Prompt: ``PROMPT_TEMPLATE`` (instructions, then ``Problem: {question}\\n``); with ``agentloop.chat_template`` the
  single user message of the tokenizer's chat template, with the generation prompt.
- Turns (``TagFormat``): ``<calc> 17 * 23 - 4 </calc>`` calls the ``calculator`` tool with that ``expression``; its
  value comes back as ``\\n<result> 387 </result>\\n`` (an error as ``error: <message>`` in the same place);
  ``<answer> 387 </answer>`` ends the episode. The spaces inside the tags are deliberate: a number then reads the
  same (`` 387``) in the problem, the expression, the result and the answer, so copying it is copying tokens.
- Reward (``reward_name = "accuracy"``): 1.0 iff the last complete ``<answer>`` of the generated text is the right
  integer (``parse_int``: optional sign, digits, thousands commas; ``387.0`` or ``387 pears`` are wrong), else 0.0.
  Metrics (``env/called_calculator``, ``env/answered``): whether the generated text holds a complete ``<calc>``
  pair, and a complete ``<answer>`` pair (0 or 1 each).

    env = get_env("arith")
    env.score(PromptItem(0, "Mira packs 17 boxes of 23 pears and eats 4. ...", ["387"]),
              "<calc> 17 * 23 - 4 </calc><answer> 387 </answer>")   # Score(1.0, {"called_calculator": 1.0, ...})
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Optional

from asyncrl.agent.envs.base import Environment, Score
from asyncrl.agent.envs.formats import TagFormat

PROMPT_TEMPLATE = (
    "Solve the word problem. You cannot do arithmetic in your head: call the calculator by <calc> expression "
    "</calc> and it returns the value between <result> and </result>. Then give the final answer, a whole number, "
    "inside <answer> and </answer>, for example <answer> 42 </answer>. Problem: {question}\n"
)

RESULT_OPEN = "\n<result> "
RESULT_CLOSE = " </result>\n"

_ANSWER_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
_CALC_RE = re.compile(r"<calc>((?:(?!<calc>).)*?)</calc>", re.DOTALL)
_INT_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+|[-+]?\d+")


def build_prompt(question: str, *, chat_template: bool = False, tokenizer: Any = None) -> str:
    """The full prompt text. ``chat_template`` needs a tokenizer with ``apply_chat_template``."""
    content = PROMPT_TEMPLATE.format(question=question.strip())
    if not chat_template:
        return content
    if tokenizer is None:
        raise ValueError("agentloop.chat_template = true needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def parse_int(text: str) -> Optional[int]:
    """The integer ``text`` spells (surrounding spaces allowed), else None."""
    s = text.strip()
    return int(s.replace(",", "")) if _INT_RE.fullmatch(s) else None


def extract_answer(generated_text: str) -> Optional[str]:
    """The stripped content of the last complete ``<answer>`` pair, or None."""
    found = _ANSWER_RE.findall(generated_text)
    return found[-1].strip() if found else None


def compute_reward(generated_text: str, answers: Sequence[str]) -> float:
    answer = extract_answer(generated_text)
    value = parse_int(answer) if answer is not None else None
    if value is None:
        return 0.0
    return 1.0 if any(parse_int(str(a)) == value for a in answers) else 0.0


class ArithEnv(Environment):
    name = "arith"
    tools = ("calculator",)
    reward_name = "accuracy"
    format = TagFormat(
        calls={"calc": ("calculator", "expression")},
        answer_tag="answer",
        result_open=RESULT_OPEN,
        result_close=RESULT_CLOSE,
    )

    def prompt(self, item, *, tools=(), chat_template: bool = False, tokenizer: Any = None) -> str:
        return build_prompt(item.prompt, chat_template=chat_template, tokenizer=tokenizer)

    def score(self, item, generated_text: str) -> Score:
        metrics = {
            "called_calculator": float(_CALC_RE.search(generated_text) is not None),
            "answered": float(extract_answer(generated_text) is not None),
        }
        return Score(compute_reward(generated_text, item.answers), metrics)


ENV = ArithEnv()
