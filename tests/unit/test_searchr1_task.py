"""The Search-R1 task: template, parser, observation format, normalization and reward."""

import pytest

from asyncrl.agent.envs import available_envs, get_env
from asyncrl.agent.envs import searchr1 as s
from asyncrl.agent.envs.searchr1 import Action


def test_registry_finds_searchr1_and_rejects_unknown():
    assert get_env("searchr1") is s.TASK
    assert "searchr1" in available_envs()
    with pytest.raises(ValueError, match="agentloop.task_name"):
        get_env("no_such_task")
    assert get_env("asyncrl.agent.envs.searchr1:TASK") is s.TASK


def test_base_prompt_is_search_r1_template():
    text = s.build_prompt("  What is the capital of Zorvania ")
    assert text.startswith("Answer the given question. You must conduct reasoning inside <think> and </think> first")
    assert "You can search as many times as your want. " in text
    assert text.endswith("For example, <answer> Beijing </answer>. Question: What is the capital of Zorvania?\n")
    # no second "?" when one is there already
    assert s.build_prompt("Who?").endswith("Question: Who?\n")


class _ChatTok:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return (
            "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            + "<|im_start|>assistant\n"
        )


def test_chat_prompt_wraps_the_template_as_one_user_message():
    text = s.build_prompt("Where was Tarin Velo born", chat_template=True, tokenizer=_ChatTok())
    assert (
        text
        == "<|im_start|>user\n" + s.build_prompt("Where was Tarin Velo born") + "<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="chat_template"):
        s.build_prompt("q", chat_template=True)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think> hmm </think>\n<search> capital of Zorvania </search>", Action("search", "capital of Zorvania")),
        ("<answer> Quelport </answer>", Action("answer", "Quelport")),
        # the last complete action wins
        ("<search> a </search> then <answer> b </answer>", Action("answer", "b")),
        ("<answer> a </answer><search> b </search>", Action("search", "b")),
        # a nested opening tag: the innermost complete pair
        ("<search> a <search> b </search>", Action("search", "b")),
        # unclosed or mismatched tags are no action
        ("<search> capital of Zorvania", Action("invalid")),
        ("<answer> Quelport </search>", Action("invalid")),
        ("I think it is Quelport.", Action("invalid")),
        ("", Action("invalid")),
        # an unclosed later tag does not hide an earlier complete one
        ("<search> x </search> <answer> y", Action("search", "x")),
        ("<answer>\n multi\nline </answer>", Action("answer", "multi\nline")),
        ("<answer></answer>", Action("answer", "")),
    ],
)
def test_parse_action(text, expected):
    assert s.parse_action(text) == expected


def test_information_block_format():
    docs = [
        {"id": "0", "contents": "Zorvania\nThe capital of Zorvania is Quelport."},
        {"id": "7", "contents": '"Two Lines"\nfirst\nsecond'},
        {"id": "9", "contents": "Only a title"},
    ]
    obs = s.format_observation(docs)
    assert obs == (
        "\n\n<information>Doc 1(Title: Zorvania) The capital of Zorvania is Quelport.\n"
        'Doc 2(Title: "Two Lines") first\nsecond\n'
        "Doc 3(Title: Only a title)</information>\n\n"
    )
    assert s.format_observation([]) == "\n\n<information></information>\n\n"


def test_invalid_action_message_is_search_r1s():
    assert s.INVALID_ACTION_MESSAGE == (
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
        "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
        "Let me try again.\n"
    )


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("The Quelport!", "quelport"),
        ("  an   Apple, a day ", "apple day"),
        ("Saint-Jean", "saintjean"),
        ("theatre", "theatre"),  # articles only as whole words
        ("A", ""),
    ],
)
def test_normalize_answer(raw, norm):
    assert s.normalize_answer(raw) == norm


def test_reward_exact_match_from_generated_text_only():
    gold = ["Quelport", "Port of Quel"]
    assert s.compute_reward("<search> q </search> ... <answer> the quelport. </answer>", gold) == 1.0
    assert s.compute_reward("<answer>port of quel</answer>", gold) == 1.0
    assert s.compute_reward("<answer> Quelport City </answer>", gold) == 0.0
    # the prompt's example answer never counts: the prompt is not part of the scored text
    prompt = s.build_prompt("What is the capital of Zorvania")
    assert s.compute_reward(prompt, ["Beijing"]) == 1.0  # (what scoring the prompt would do)
    assert s.TASK.reward(" I do not know.", ["Beijing"]) == 0.0
    # several answer tags: the last complete one counts
    assert s.compute_reward("<answer> Quelport </answer> <answer> Brask </answer>", gold) == 0.0
    assert s.compute_reward("<answer> Brask </answer> <answer> Quelport </answer>", gold) == 1.0
    # unclosed tags
    assert s.compute_reward("<answer> Quelport", gold) == 0.0
    assert s.compute_reward("<answer> Brask </answer> <answer> Quelport", gold) == 0.0
    # empty answers never match, even an empty or article-only gold
    assert s.compute_reward("<answer>  </answer>", gold) == 0.0
    assert s.compute_reward("<answer> the </answer>", ["a"]) == 0.0
    assert s.compute_reward("<answer>x</answer>", []) == 0.0
