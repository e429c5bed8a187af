"""The ``arith`` environment's synthetic data: arithmetic word problems and warm-start demonstrations.

    python -m asyncrl.embedded.arith --out DIR --seed S [--num-problems N] [--num-test M]

writes into DIR
- ``train.jsonl`` / ``test.jsonl``: rows ``{"id", "question", "golden_answers": ["387"], "data_source",
  "extra_info": {"split", "index", "expression", "template"}}`` (``asyncrl.agent.data.loaders.load_prompts`` reads
  them; ``asyncrl.agent.envs.arith`` scores them);
- ``tokenizer_text.txt``: text to train a tokenizer on (prompts and demonstrations).

Problems come from ``TEMPLATES`` (2-3 numbers, ``+ - *``), e.g. "Mira packs 17 boxes of 23 pears and eats 4. How
many pears are left?" -> ``17 * 23 - 4`` -> ``387``; every template has a product of two 2-digit numbers, which a
tiny model cannot compute: it has to call the calculator and copy the value.

The held-out split: test problems are about held-out people (``TEST_NAMES``, never in a training problem) and no
test answer is a training answer (so no test expression is a training one either); the templates are shared. What
the policy learns is to turn a problem into its expression and copy the calculator's value, and that is what the
split measures: a memorised training answer is never right on it. (Held-out *templates* would measure whether a
3-layer model trained for minutes understands unseen phrasings, which it cannot, not tool use.) The same seed
gives byte-identical files.

``make_demos(rows, ...)`` builds demonstration trajectories for the supervised warm start, in the shape of
``asyncrl.embedded.synth.make_sft_demos``: a ``correct_fraction`` of them call the calculator with the right
expression and copy its value (the observation text is ``ENV.observe``'s, the value the calculator tool's own);
the rest answer a made-up number at once, so RL has room to improve.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.agent.envs.arith import ENV, build_prompt, compute_reward
from asyncrl.agent.envs.base import Parsed, ToolCall, ToolResult
from asyncrl.agent.tools.calculator import evaluate, format_number

DATA_SOURCE = "synth_arith"


@dataclass(frozen=True)
class Template:
    text: str
    """The problem, with ``{name}``, ``{item}`` and the numbers ``{a}``, ``{b}``, ``{c}``."""
    expression: str
    """The calculator expression that solves it, over the same numbers."""
    ranges: tuple[tuple[int, int], ...]
    """Inclusive ranges of ``a``, ``b`` (and ``c``)."""


TEMPLATES = (
    Template(
        "{name} packs {a} boxes of {b} {item} and eats {c}. How many {item} are left?",
        "{a} * {b} - {c}",
        ((12, 99), (12, 99), (2, 30)),
    ),
    Template(
        "{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} have?",
        "{a} * {b}",
        ((12, 99), (12, 99)),
    ),
    Template(
        "{name} has {a} {item} and buys {b} packs of {c} {item}. How many {item} does {name} have now?",
        "{a} + {b} * {c}",
        ((100, 999), (12, 99), (12, 99)),
    ),
    Template(
        "{name} stacks {a} rows of {b} {item} and then {c} more rows. How many {item} are there?",
        "({a} + {c}) * {b}",
        ((12, 60), (12, 99), (2, 30)),
    ),
    Template(
        "{name} sells {a} crates of {b} {item} and gives away {c} crates. How many {item} were sold or given?",
        "{a} * {b} + {c} * {b}",
        ((12, 60), (12, 99), (2, 30)),
    ),
)

TRAIN_NAMES = (
    "Mira", "Tom", "Ana", "Ben", "Lina", "Omar", "Sara", "Paul", "Nina", "Leo",
    "Ivy", "Ravi", "Kate", "Hugo", "Eva", "Sam", "Rosa", "Jon", "Maya", "Dan",
)  # fmt: skip
TEST_NAMES = ("Zoe", "Karl", "Una", "Finn", "Pia", "Abel")
ITEMS = ("pears", "apples", "coins", "stamps", "cards", "marbles", "eggs", "pencils", "books", "shells")
NUM_TOKENIZER_DEMOS = 400  # enough demonstrations that the BPE learns the tags and result blocks as the loop sees them


def make_problem(rng: random.Random, *, names: Sequence[str]) -> dict:
    """One problem: ``{question, answer, expression, template}`` (the answer an int, as the calculator gives it)."""
    k = rng.randrange(len(TEMPLATES))
    t = TEMPLATES[k]
    nums = {key: rng.randint(lo, hi) for key, (lo, hi) in zip("abc", t.ranges)}
    expression = t.expression.format(**nums)
    answer = evaluate(expression)
    assert isinstance(answer, int) and answer > 0, (expression, answer)
    question = t.text.format(name=rng.choice(names), item=rng.choice(ITEMS), **nums)
    return {"question": question, "answer": answer, "expression": expression, "template": k}


def make_problems(*, seed: int, num_train: int, num_test: int) -> tuple[list[dict], list[dict]]:
    """Test problems (held-out names, distinct answers), then training problems (train names, distinct
    expressions, no test answer)."""
    rng = random.Random(seed)
    test: list[dict] = []
    test_answers: set[int] = set()
    while len(test) < num_test:
        p = make_problem(rng, names=TEST_NAMES)
        if p["answer"] not in test_answers:
            test_answers.add(p["answer"])
            test.append(p)
    train: list[dict] = []
    seen: set[str] = set()
    for _ in range(100 * num_train):
        if len(train) == num_train:
            break
        p = make_problem(rng, names=TRAIN_NAMES)
        if p["answer"] not in test_answers and p["expression"] not in seen:
            seen.add(p["expression"])
            train.append(p)
    if len(train) < num_train:
        raise ValueError(f"arith data: only {len(train)} distinct training problems, {num_train} asked for")
    return train, test


def to_row(p: dict, *, split: str, index: int) -> dict:
    return {
        "id": f"{split}_{index}",
        "question": p["question"],
        "golden_answers": [str(p["answer"])],
        "data_source": DATA_SOURCE,
        "extra_info": {"split": split, "index": index, "expression": p["expression"], "template": p["template"]},
    }


# ---------------------------------------------------------------- demonstrations


def calc_turn(expression: str) -> list[dict]:
    """The generated call and the observation the agent loop appends after it (``ENV.observe`` of the calculator
    tool's value)."""
    call = ToolCall("calculator", {"expression": expression})
    observation = ENV.observe([ToolResult(call, output=format_number(evaluate(expression)))])
    return [{"text": f"<calc> {expression} </calc>", "generated": True}, {"text": observation, "generated": False}]


def make_demos(
    rows: Sequence[dict],
    *,
    num_demos: int,
    seed: int,
    correct_fraction: float = 0.5,
    chat_template: bool = False,
    tokenizer: Any = None,
) -> list[dict]:
    """Demonstration trajectories over ``rows`` (``train.jsonl`` rows): ``correct`` ones call the calculator with the
    row's expression and answer its value; ``guess`` ones answer at once with another row's answer. Each demo:
    ``{"kind", "question", "answers", "prompt", "segments": [{"text", "generated"}], "reward"}``, the segments as
    the agent loop sees them (``generated``: the policy's turns; the others: observations, loss off)."""
    if not rows:
        raise ValueError("make_demos: no rows")
    rng = random.Random(seed)
    demos = []
    for _ in range(num_demos):
        row = rows[rng.randrange(len(rows))]
        answers = list(row["golden_answers"])
        if rng.random() < correct_fraction:
            expression = row["extra_info"]["expression"]
            kind, segments, final = "correct", calc_turn(expression), format_number(evaluate(expression))
        else:
            kind, segments = "guess", []
            final = _wrong_answer(rng, rows, answers)
        segments.append({"text": f"<answer> {final} </answer>", "generated": True})
        generated = "".join(s["text"] for s in segments if s["generated"])
        demos.append(
            {
                "kind": kind,
                "question": row["question"],
                "answers": answers,
                "prompt": build_prompt(row["question"], chat_template=chat_template, tokenizer=tokenizer),
                "segments": segments,
                "reward": compute_reward(generated, answers),
            }
        )
    return demos


def _wrong_answer(rng: random.Random, rows: Sequence[dict], answers: list[str]) -> str:
    """Another row's answer, not one of ``answers``."""
    for _ in range(100):
        cand = rows[rng.randrange(len(rows))]["golden_answers"][0]
        if cand not in answers:
            return cand
    raise ValueError("make_demos: no wrong answer among the rows (every row has the same answer?)")


def warm_start_demos(cfg, *, data_dir: Path, num_demos: int) -> list[dict]:
    """The warm start's demonstrations (``asyncrl.embedded.warm_start``): ``prepare.sft_correct_fraction`` of them
    call the calculator."""
    from asyncrl.agent.data.loaders import load_rows

    return make_demos(
        load_rows(Path(data_dir) / "train.jsonl"),
        num_demos=num_demos,
        seed=cfg.prepare.seed + 1,
        correct_fraction=cfg.prepare.sft_correct_fraction,
    )


# ---------------------------------------------------------------- files


def write_dataset(out_dir: str | Path, *, seed: int, num_problems: int = 2000, num_test: int = 100) -> dict[str, Path]:
    """Write ``train.jsonl`` (``num_problems`` rows), ``test.jsonl`` (``num_test``) and ``tokenizer_text.txt``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_p, test_p = make_problems(seed=seed, num_train=num_problems, num_test=num_test)
    train = [to_row(p, split="train", index=i) for i, p in enumerate(train_p)]
    test = [to_row(p, split="test", index=i) for i, p in enumerate(test_p)]
    paths = {"train": out / "train.jsonl", "test": out / "test.jsonl", "tokenizer_text": out / "tokenizer_text.txt"}
    for key, rows in (("train", train), ("test", test)):
        with paths[key].open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
    demos = make_demos(train, num_demos=NUM_TOKENIZER_DEMOS, seed=seed)
    lines = [build_prompt(r["question"]) for r in train + test]
    lines += [d["prompt"] + "".join(s["text"] for s in d["segments"]) for d in demos]
    lines += [ENV.invalid_observation(Parsed()).strip()] * 50  # tool text the policy reads after an invalid turn
    paths["tokenizer_text"].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


def prepare_data(cfg, out_dir: Path) -> dict[str, Path]:
    """``prepare_if_needed``'s data stage: ``prepare.num_entities`` training problems, ``prepare.seed``."""
    return write_dataset(out_dir, seed=cfg.prepare.seed, num_problems=cfg.prepare.num_entities)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.embedded.arith", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-problems", type=int, default=2000, help="training problems")
    ap.add_argument("--num-test", type=int, default=100, help="held-out problems")
    args = ap.parse_args(argv)
    paths = write_dataset(args.out, seed=args.seed, num_problems=args.num_problems, num_test=args.num_test)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
