"""``AgentTokenizer.prefix_encoder``: a prompt template's fixed head tokenized once gives exactly ``encode``'s ids,
and the cut is refused where ``tokenizers`` would not split there."""

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from asyncrl.agent.envs import get_env, searchr1
from asyncrl.agent.loop import AgentLoop
from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.broker.types import PromptItem
from asyncrl.config.schema import AgentLoopConfig, SamplingConfig

QUESTIONS = [
    "what is the capital of Zorvania",
    "Who wrote it?",
    "",
    " ",
    "  leading spaces and trailing  ",
    "<answer> x </answer>",
    "</answer>!",
    "\n\nQuestion: nested?\n",
    "ñandú 12,345 über",
    "?" * 7,
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from asyncrl.models.tiny import make_tiny_checkpoint

    return AgentTokenizer.from_pretrained(make_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "m", seed=0))


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_ids_equal_a_full_encode_and_skip_the_head(tok, chat):
    loop = AgentLoop(
        env=get_env("searchr1"),
        tokenizer=tok,
        retriever=None,
        agent_cfg=AgentLoopConfig(chat_template=chat),
        sampling=SamplingConfig(),
    )
    head = loop._template_head()
    assert head.endswith("Question: ") and tok.split_point(head) > len(head) - 20  # cut after the last tag
    for q in QUESTIONS:
        text = searchr1.build_prompt(q, chat_template=chat, tokenizer=tok)
        assert loop.prompt_ids(PromptItem(0, q, [])) == tok.encode(text), q
    assert tok.prefix_encoder(head)("no head here <answer>") == tok.encode("no head here <answer>")


def _word_tok(pre, added):
    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "b", "▁a", "▁b", "x", "▁x", " ", "▁"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre
    t.add_tokens(added)
    return AgentTokenizer(t, eos_token_ids=[])


def _naive(tok, text, k, rest):
    return tok.encode(text[:k]) + tok.encode(rest) == tok.encode(text[:k] + rest)


def test_a_position_dependent_pre_tokenizer_has_no_cut():
    tok = _word_tok(pre_tokenizers.Metaspace(prepend_scheme="first"), [AddedToken("<t>", normalized=False)])
    text = "a <t>"
    assert not _naive(tok, text, len(text), "a")  # the rest alone gets the first piece's prefix
    assert tok.split_point(text) == 0
    enc = tok.prefix_encoder(text)
    assert enc(text + "a b") == tok.encode(text + "a b")


@pytest.mark.parametrize("flag", ["rstrip", "single_word", "normalized"])
def test_added_tokens_that_reach_past_themselves_are_not_cut_after(flag):
    tok = _word_tok(
        pre_tokenizers.WhitespaceSplit(),
        [AddedToken("<t>", **{"normalized": False, flag: True}), AddedToken("<u>", normalized=False)],
    )
    assert tok.split_point("a <u> b <t>") == len("a <u>")  # the plain one earlier is still a cut
    assert tok.split_point("a <t>") == 0
    enc = tok.prefix_encoder("a <t>")
    for rest in (" x", "x", "a b", ""):
        assert enc("a <t>" + rest) == tok.encode("a <t>" + rest)


def test_a_longer_added_token_across_the_cut_prevents_it():
    tok = _word_tok(
        pre_tokenizers.WhitespaceSplit(), [AddedToken("<t>", normalized=False), AddedToken("<t>x", normalized=False)]
    )
    assert not _naive(tok, "a <t>", len("a <t>"), "x")
    assert tok.split_point("a <t>") == 0
