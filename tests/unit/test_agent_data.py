"""The embedded task data: determinism, answerability by search only, loaders, demonstrations."""

import json

import pytest

from asyncrl.agent.data.loaders import load_prompts
from asyncrl.agent.envs import searchr1
from asyncrl.agent.tools.bm25 import BM25Retriever
from asyncrl.embedded.synth import make_sft_demos, write_dataset


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    write_dataset(out, seed=3, num_countries=60, num_test=40, num_tokenizer_demos=20)
    return out


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_bytes_other_seed_differs(synth_dir, tmp_path):
    again = write_dataset(tmp_path / "a", seed=3, num_countries=60, num_test=40, num_tokenizer_demos=20)
    for key in ("corpus", "train", "test", "tokenizer_text"):
        assert (synth_dir / again[key].name).read_bytes() == again[key].read_bytes()
    other = write_dataset(tmp_path / "b", seed=4, num_countries=60, num_test=40, num_tokenizer_demos=20)
    assert (synth_dir / "corpus.jsonl").read_bytes() != other["corpus"].read_bytes()


def test_rows_have_search_r1_fields_and_both_hop_kinds(synth_dir):
    train, test = _rows(synth_dir / "train.jsonl"), _rows(synth_dir / "test.jsonl")
    assert train and 0 < len(test) <= 40
    for row in train + test:
        assert set(row) >= {
            "data_source",
            "prompt",
            "ability",
            "reward_model",
            "extra_info",
            "question",
            "golden_answers",
        }
        assert row["prompt"][0]["role"] == "user"
        assert row["prompt"][0]["content"] == searchr1.build_prompt(row["question"])
        assert row["reward_model"]["ground_truth"]["target"] == row["golden_answers"]
    sources = {r["data_source"] for r in train}
    assert sources == {"synth_1hop", "synth_2hop"}
    assert all(len(r["extra_info"]["hops"]) == 2 for r in train if r["data_source"] == "synth_2hop")
    for doc in _rows(synth_dir / "corpus.jsonl"):
        assert set(doc) == {"id", "contents"} and "\n" in doc["contents"]


def test_answers_only_by_search(synth_dir):
    """Each hop's answer is in the top retrieved document of its query; never in the question;
    test answers never appear as training answers (so memorizing train answers does not help)."""
    retriever = BM25Retriever.from_jsonl(synth_dir / "corpus.jsonl")
    train, test = _rows(synth_dir / "train.jsonl"), _rows(synth_dir / "test.jsonl")
    hops = [h for r in train + test for h in r["extra_info"]["hops"]]
    docs, _ = retriever.search([h["query"] for h in hops], topk=2)
    assert all(h["answer"] in d[0]["contents"] for h, d in zip(hops, docs))
    for r in train + test:
        assert all(
            searchr1.normalize_answer(a) not in searchr1.normalize_answer(r["question"]) for a in r["golden_answers"]
        )
    train_answers = {a for r in train for a in r["golden_answers"]}
    assert not train_answers & {a for r in test for a in r["golden_answers"]}
    # a policy that always guesses the most common training answer scores ~0 on test
    from collections import Counter

    guess = Counter(a for r in train for a in r["golden_answers"]).most_common(1)[0][0]
    acc = sum(searchr1.compute_reward(f"<answer> {guess} </answer>", r["golden_answers"]) for r in test) / len(test)
    assert acc == 0.0


def test_load_prompts_parquet_equals_jsonl(synth_dir):
    a = load_prompts(synth_dir / "train.parquet")
    b = load_prompts(synth_dir / "train.jsonl")
    assert [(i.index, i.prompt, i.answers, i.data_source) for i in a] == [
        (i.index, i.prompt, i.answers, i.data_source) for i in b
    ]
    assert a[5].index == 5 and a[5].prompt.endswith("?") and a[5].answers


def test_load_prompts_search_r1_row_without_question_column(tmp_path):
    row = {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": searchr1.build_prompt("who wrote hamlet")}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare", "William Shakespeare"]}},
        "extra_info": {"split": "train", "index": 0},
    }
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(row) + "\n")
    (item,) = load_prompts(p)
    assert item.prompt == "who wrote hamlet?"
    assert item.answers == ["Shakespeare", "William Shakespeare"]
    assert item.data_source == "nq"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match="row 0: no gold answers"):
        load_prompts(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.parquet")


def test_sft_demos_kinds_segments_and_rewards(synth_dir):
    retriever = BM25Retriever.from_jsonl(synth_dir / "corpus.jsonl")
    rows = _rows(synth_dir / "train.jsonl")
    demos = make_sft_demos(rows, lambda q, k: retriever.search(q, k)[0], num_demos=60, seed=0, topk=2)
    kinds = {d["kind"] for d in demos}
    assert kinds == {"correct", "wrong_copy", "guess"}
    for d in demos:
        gen = [s for s in d["segments"] if s["generated"]]
        assert gen[-1]["text"].startswith("<answer>") and gen[-1]["text"].endswith("</answer>")
        assert d["reward"] == (1.0 if d["kind"] == "correct" else 0.0)
        if d["kind"] == "guess":
            assert len(d["segments"]) == 1
        else:
            # search turns and information blocks alternate, formatted as the loop formats them
            for turn, obs in zip(d["segments"][0:-1:2], d["segments"][1:-1:2]):
                assert turn["generated"] and turn["text"].startswith("<search>")
                assert not obs["generated"]
                query = searchr1.parse_action(turn["text"]).content
                assert obs["text"] == searchr1.format_observation(retriever.search([query], 2)[0][0])
        assert d["prompt"] == searchr1.build_prompt(d["question"])
