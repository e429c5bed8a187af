"""The arith environment (``asyncrl.agent.envs.arith``) and its synthetic data and demonstrations
(``asyncrl.embedded.arith``): prompt, parsing, scoring, observation text, determinism, the held-out split, and the
embedded preparation choosing the data by environment. The calculator is the real tool."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from asyncrl.agent.data.loaders import load_prompts
from asyncrl.agent.envs import Parsed, Score, ToolCall, ToolResult, available_envs, get_env
from asyncrl.agent.envs import arith as a
from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.agent.tools.calculator import CalculatorTool
from asyncrl.broker.types import PromptItem
from asyncrl.config import load_config
from asyncrl.embedded import arith as data
from asyncrl.embedded import data_env
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.runner import prepare

ROOT = Path(__file__).resolve().parents[2]
ENV = a.ENV
QUESTION = "Mira packs 17 boxes of 23 pears and eats 4. How many pears are left?"


def _item(answer: str = "387") -> PromptItem:
    return PromptItem(0, QUESTION, [answer])


def _call(expression: str) -> str:
    return asyncio.run(CalculatorTool().call({"expression": expression}, timeout_s=1.0))


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    data.write_dataset(out, seed=5, num_problems=600, num_test=60)
    return out


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- the environment


def test_registry_finds_arith_with_the_calculator_and_an_accuracy():
    assert get_env("arith") is ENV and "arith" in available_envs()
    assert ENV.name == "arith" and tuple(ENV.tools) == ("calculator",) and ENV.reward_name == "accuracy"
    assert ENV.stop == ("</calc>", "</answer>")


def test_prompt_is_the_template_with_the_problem_last(tmp_path):
    text = ENV.prompt(PromptItem(0, f"  {QUESTION} ", ["387"]), tools=())
    assert text.startswith("Solve the word problem.") and "<calc> expression </calc>" in text
    assert text.endswith(f"Problem: {QUESTION}\n")
    tok = AgentTokenizer.from_pretrained(make_tiny_checkpoint(tmp_path / "tiny", num_hidden_layers=1))
    chat = ENV.prompt(_item(), tools=(), chat_template=True, tokenizer=tok)
    assert chat == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="chat_template"):
        ENV.prompt(_item(), tools=(), chat_template=True)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<calc> 17 * 23 - 4 </calc>", Parsed(calls=(ToolCall("calculator", {"expression": "17 * 23 - 4"}),))),
        ("<answer> 387 </answer>", Parsed(answer="387")),
        ("<calc> 1 + 1 </calc> so <answer> 2 </answer>", Parsed(answer="2")),  # the last complete action
        ("<answer> 2 </answer><calc> 3 * 4 </calc>", Parsed(calls=(ToolCall("calculator", {"expression": "3 * 4"}),))),
        ("<calc> 17 * 23", Parsed()),  # unclosed: invalid
        ("387", Parsed()),
    ],
)
def test_parse(text, expected):
    assert ENV.parse(text) == expected


def test_observation_of_a_value_and_of_an_error():
    call = ToolCall("calculator", {"expression": "17 * 23 - 4"})
    assert ENV.observe([ToolResult(call, output=_call("17 * 23 - 4"))]) == "\n<result> 387 </result>\n"
    bad = ENV.observe([ToolResult(call, error="cannot evaluate: names are not allowed ('x')")])
    assert bad == "\n<result> error: cannot evaluate: names are not allowed ('x') </result>\n"
    assert ENV.observation_tail() == " </result>\n"
    assert "<calc>" in ENV.invalid_observation(Parsed()) and "<answer>" in ENV.invalid_observation(Parsed())


@pytest.mark.parametrize(
    "generated, reward, called, answered",
    [
        ("<calc> 17 * 23 - 4 </calc><answer> 387 </answer>", 1.0, 1.0, 1.0),
        ("<answer> 387 </answer>", 1.0, 0.0, 1.0),  # right without the tool is still right
        ("<calc> 17 * 23 - 4 </calc><answer> 391 </answer>", 0.0, 1.0, 1.0),
        ("<answer> 387.0 </answer>", 0.0, 0.0, 1.0),  # an integer is asked for
        ("<answer> 387 pears </answer>", 0.0, 0.0, 1.0),
        ("<answer> 3 </answer> no, <answer> 387 </answer>", 1.0, 0.0, 1.0),  # the last answer counts
        ("<answer> 387 </answer> no, <answer> 3 </answer>", 0.0, 0.0, 1.0),
        ("<calc> 17 * 23 - 4 </calc>", 0.0, 1.0, 0.0),
        ("<answer> 387", 0.0, 0.0, 0.0),
        ("", 0.0, 0.0, 0.0),
    ],
)
def test_score(generated, reward, called, answered):
    assert ENV.score(_item(), generated) == Score(reward, {"called_calculator": called, "answered": answered})


def test_integers_with_signs_and_thousands_commas():
    assert ENV.score(_item("1606"), "<answer> 1,606 </answer>").reward == 1.0
    assert ENV.score(_item("-12"), "<answer> -12 </answer>").reward == 1.0
    assert ENV.score(_item("1606"), "<answer> 16,06 </answer>").reward == 0.0
    assert a.parse_int(" +42 ") == 42 and a.parse_int("4 2") is None and a.parse_int("") is None


# ---------------------------------------------------------------- data and demonstrations


def test_same_seed_same_bytes_other_seed_differs(arith_dir, tmp_path):
    again = data.write_dataset(tmp_path / "a", seed=5, num_problems=600, num_test=60)
    for path in again.values():
        assert (arith_dir / path.name).read_bytes() == path.read_bytes()
    other = data.write_dataset(tmp_path / "b", seed=6, num_problems=600, num_test=60)
    assert (arith_dir / "train.jsonl").read_bytes() != other["train"].read_bytes()


def test_rows_load_and_their_expressions_give_their_answers(arith_dir):
    train, test = _rows(arith_dir / "train.jsonl"), _rows(arith_dir / "test.jsonl")
    assert len(train) == 600 and len(test) == 60
    for split, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
            assert row["golden_answers"] == [_call(row["extra_info"]["expression"])]
            assert row["data_source"] == data.DATA_SOURCE
    assert {r["extra_info"]["template"] for r in train} == set(range(len(data.TEMPLATES)))
    items = load_prompts(arith_dir / "test.jsonl")
    assert [(it.prompt, it.answers) for it in items] == [(r["question"], r["golden_answers"]) for r in test]
    # every template multiplies two 2-digit numbers: nothing the tiny model computes itself
    assert all(int(r["golden_answers"][0]) >= 100 for r in train + test)


def test_the_held_out_split_shares_no_person_answer_or_expression_with_training(arith_dir):
    train, test = _rows(arith_dir / "train.jsonl"), _rows(arith_dir / "test.jsonl")
    names = re.compile(r"\b(" + "|".join(data.TRAIN_NAMES + data.TEST_NAMES) + r")\b")
    assert {n for r in train for n in names.findall(r["question"])} <= set(data.TRAIN_NAMES)
    assert {n for r in test for n in names.findall(r["question"])} <= set(data.TEST_NAMES)
    assert not {r["golden_answers"][0] for r in train} & {r["golden_answers"][0] for r in test}
    assert not {r["extra_info"]["expression"] for r in train} & {r["extra_info"]["expression"] for r in test}
    assert len({r["extra_info"]["expression"] for r in train}) == len(train)


def test_demos_call_the_calculator_as_the_agent_loop_would(arith_dir):
    """A correct demo's observation is ``ENV.observe`` of the real calculator's value for the call the demo's
    generated turn parses to; only ``correct_fraction`` of the demos call it, the rest guess wrong at once."""
    rows = _rows(arith_dir / "train.jsonl")
    demos = data.make_demos(rows, num_demos=400, seed=1, correct_fraction=0.3)
    assert demos == data.make_demos(rows, num_demos=400, seed=1, correct_fraction=0.3)
    by_kind = {k: [d for d in demos if d["kind"] == k] for k in ("correct", "guess")}
    assert 0.22 < len(by_kind["correct"]) / len(demos) < 0.38 and len(by_kind["guess"]) == 400 - len(by_kind["correct"])
    for d in by_kind["correct"]:
        call, obs, answer = d["segments"]
        assert (call["generated"], obs["generated"], answer["generated"]) == (True, False, True)
        parsed = ENV.parse(call["text"])
        value = _call(parsed.calls[0].arguments["expression"])
        assert obs["text"] == ENV.observe([ToolResult(parsed.calls[0], output=value)])
        assert ENV.parse(answer["text"]) == Parsed(answer=value) and d["reward"] == 1.0
        assert d["prompt"] == ENV.prompt(PromptItem(0, d["question"], d["answers"]), tools=())
    for d in by_kind["guess"]:
        assert [s["generated"] for s in d["segments"]] == [True]
        assert ENV.parse(d["segments"][0]["text"]).kind == "answer" and d["reward"] == 0.0


def test_preparation_makes_the_environments_data_and_records_it(tmp_path):
    """configs/arith.toml prepares arith problems (``env`` in every stage's recipe); configs/tiny.toml's recipes
    are unchanged (no ``env``), so Search-R1's cached stages stay valid."""
    small = ["prepare.num_entities=200", "prepare.num_layers=1", "prepare.sft_steps=2", "prepare.sft_batch_size=4"]
    cfg = load_config(ROOT / "configs/arith.toml", [f'prepare.dir="{tmp_path}"', *small])
    assert all(r["env"] == "arith" for r in prepare.recipes(cfg).values())
    tiny = load_config(ROOT / "configs/tiny.toml")
    assert all("env" not in r for r in prepare.recipes(tiny).values())
    out = prepare.prepare_if_needed(cfg)
    assert len(_rows(out["data"] / "train.jsonl")) == 200 and not (out["data"] / "corpus.jsonl").exists()
    assert (out["model_sft"] / "config.json").is_file()
    assert prepare.recipe_drift(out["data"], prepare.recipes(tiny)["data"]) is not None


def test_environments_without_data_of_their_own_train_on_the_search_qa():
    assert data_env("arith") == "arith" and data_env("searchr1") == "searchr1"
    assert data_env("my_pkg.my_env:ENV") == "searchr1" and data_env(None) == "searchr1"
