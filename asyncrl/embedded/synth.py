"""The embedded task: a deterministic synthetic knowledge base and search-QA over it.

    python -m asyncrl.embedded.synth --out DIR --seed S [--num-countries N] [--num-test M]

writes into DIR
- ``corpus.jsonl``: Search-R1 corpus rows ``{"id", "contents": "Title\\ntext"}``, one fact each,
  e.g. ``"Zorvania\\nThe capital of Zorvania is Quelport."``;
- ``train.jsonl`` / ``test.jsonl`` and the same as ``.parquet``: Search-R1 rows (``id``,
  ``question``, ``golden_answers``, ``data_source``, ``prompt`` chat list, ``ability``,
  ``reward_model``, ``extra_info{split, index, hops}``), where ``hops`` lists the search query and
  the intermediate answer of each step (for demonstrations);
- ``tokenizer_text.txt``: text to train a tokenizer on (corpus, prompts, demonstrations).

Every entity name is made up from a fixed syllable set, so answers cannot be guessed: single-hop
questions ("What is the capital of Zorvania?") need one search, two-hop ones ("What is the capital
of the country where Tarin Velo was born?") two. Test questions are about held-out countries, so
no test answer appears as a training answer. The same seed gives byte-identical files.

``make_sft_demos(rows, retriever, ...)`` builds demonstration trajectories as text segments
(some search and copy correctly, some answer a wrong span, some guess without searching) for a
supervised warm start; ``warm_start_demos(cfg, ...)`` and ``prepare_data(cfg, ...)`` are what the embedded
default's preparation calls (``asyncrl.embedded.DATA_MODULES``).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.agent.envs import searchr1
from asyncrl.agent.tools.bm25 import BM25Retriever

# Small, regular syllable sets: names stay short in a tokenizer trained on this corpus.
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "kr", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s")
_COUNTRY_SUFFIXES = ("ania", "land", "ora", "istan")
_CITY_SUFFIXES = ("port", "ford", "holm", "ton")
_CURRENCY_SUFFIXES = ("ar", "o", "el")

ABILITY = "fact-reasoning"


@dataclass
class Country:
    name: str
    capital: str
    currency: str
    leader: str


@dataclass
class KnowledgeBase:
    countries: list[Country]
    births: dict[str, str]
    """person -> country of birth."""
    test_countries: set[str] = field(default_factory=set)


def _word(rng: random.Random, syllables: int, suffix: str = "") -> str:
    parts = [
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + (rng.choice(_CODAS) if i == syllables - 1 and not suffix else "")
        for i in range(syllables)
    ]
    return ("".join(parts) + suffix).capitalize()


def _unique(rng: random.Random, used: set[str], make: Callable[[], str]) -> str:
    for _ in range(1000):
        name = make()
        if name.lower() not in used:
            used.add(name.lower())
            return name
    raise RuntimeError("name space exhausted: lower the number of entities")


def make_knowledge_base(
    *, seed: int, num_countries: int = 200, num_test_countries: int = 20, people_per_country: int = 2
) -> KnowledgeBase:
    """Countries (capital, currency, leader) and people (country of birth), all names made up."""
    rng = random.Random(seed)
    used: set[str] = set()
    countries = []
    for _ in range(num_countries):
        name = _unique(rng, used, lambda: _word(rng, rng.choice((1, 2)), rng.choice(_COUNTRY_SUFFIXES)))
        capital = _unique(rng, used, lambda: _word(rng, rng.choice((1, 2)), rng.choice(_CITY_SUFFIXES)))
        currency = _unique(rng, used, lambda: _word(rng, rng.choice((1, 2)), rng.choice(_CURRENCY_SUFFIXES)).lower())
        leader = _unique(rng, used, lambda: f"{_word(rng, 2)} {_word(rng, 2)}")
        countries.append(Country(name, capital, currency, leader))
    births: dict[str, str] = {}
    for c in countries:
        births[c.leader] = c.name
    for _ in range(num_countries * (people_per_country - 1)):
        person = _unique(rng, used, lambda: f"{_word(rng, 2)} {_word(rng, 2)}")
        births[person] = rng.choice(countries).name
    test = {c.name for c in rng.sample(countries, min(num_test_countries, num_countries))}
    return KnowledgeBase(countries, births, test)


def corpus_docs(kb: KnowledgeBase) -> list[dict]:
    """One document per fact: title line, then one sentence."""
    texts = []
    for c in kb.countries:
        texts.append(f"{c.name}\nThe capital of {c.name} is {c.capital}.")
        texts.append(f"{c.name}\nThe currency of {c.name} is the {c.currency}.")
        texts.append(f"{c.name}\nThe leader of {c.name} is {c.leader}.")
    for person, country in kb.births.items():
        texts.append(f"{person}\n{person} was born in {country}.")
    return [{"id": str(i), "contents": t} for i, t in enumerate(texts)]


def make_questions(kb: KnowledgeBase, *, seed: int, two_hop_fraction: float = 0.2) -> list[dict]:
    """Question records ``{question, answers, key_country, data_source, hops}`` (not yet split)."""
    rng = random.Random(seed + 1)
    by_name = {c.name: c for c in kb.countries}
    out = []
    for c in kb.countries:
        out.append(
            _q(
                f"What is the capital of {c.name}?",
                c.capital,
                key_country=c.name,
                source="synth_1hop",
                hops=[(f"capital of {c.name}", c.capital)],
            )
        )
        out.append(
            _q(
                f"What is the currency of {c.name}?",
                c.currency,
                key_country=c.name,
                source="synth_1hop",
                hops=[(f"currency of {c.name}", c.currency)],
            )
        )
        out.append(
            _q(
                f"Who is the leader of {c.name}?",
                c.leader,
                key_country=c.name,
                source="synth_1hop",
                hops=[(f"leader of {c.name}", c.leader)],
            )
        )
    two_hop = []
    for person, country in kb.births.items():
        out.append(
            _q(
                f"Where was {person} born?",
                country,
                key_country=country,
                source="synth_1hop",
                hops=[(f"{person} born", country)],
            )
        )
        cap = by_name[country].capital
        two_hop.append(
            _q(
                f"What is the capital of the country where {person} was born?",
                cap,
                key_country=country,
                source="synth_2hop",
                hops=[(f"{person} born", country), (f"capital of {country}", cap)],
            )
        )
    num_two_hop = round(two_hop_fraction / max(1e-9, 1 - two_hop_fraction) * len(out))
    out.extend(rng.sample(two_hop, min(num_two_hop, len(two_hop))))
    rng.shuffle(out)
    return out


def _q(question: str, answer: str, *, key_country: str, source: str, hops: list[tuple[str, str]]) -> dict:
    return {
        "question": question,
        "answers": [answer],
        "key_country": key_country,
        "data_source": source,
        "hops": [{"query": q, "answer": a} for q, a in hops],
    }


def to_search_r1_row(q: dict, *, split: str, index: int) -> dict:
    """A question record as a Search-R1 dataset row."""
    return {
        "id": f"{split}_{index}",
        "question": q["question"],
        "golden_answers": list(q["answers"]),
        "data_source": q["data_source"],
        "prompt": [{"role": "user", "content": searchr1.build_prompt(q["question"])}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": {"target": list(q["answers"])}},
        "extra_info": {"split": split, "index": index, "hops": q["hops"]},
    }


def split_rows(kb: KnowledgeBase, questions: Sequence[dict], *, num_test: int) -> tuple[list[dict], list[dict]]:
    """Train rows (questions about training countries) and at most ``num_test`` test rows."""
    train_q = [q for q in questions if q["key_country"] not in kb.test_countries]
    test_q = [q for q in questions if q["key_country"] in kb.test_countries][:num_test]
    train = [to_search_r1_row(q, split="train", index=i) for i, q in enumerate(train_q)]
    test = [to_search_r1_row(q, split="test", index=i) for i, q in enumerate(test_q)]
    return train, test


# ---------------------------------------------------------------- demonstrations


SearchFn = Callable[[list[str], int], list[list[dict]]]
"""``(queries, topk) -> docs per query`` (e.g. ``lambda q, k: bm25.search(q, k)[0]``)."""


def make_sft_demos(
    rows: Sequence[dict],
    search: SearchFn,
    *,
    num_demos: int,
    seed: int,
    topk: int = 3,
    correct_fraction: float = 0.6,
    wrong_copy_fraction: float = 0.2,
    chat_template: bool = False,
    tokenizer: Any = None,
) -> list[dict]:
    """Demonstration trajectories over ``rows`` (Search-R1 rows with ``extra_info.hops``).

    Kinds: ``correct`` (search each hop's query, copy the answer), ``wrong_copy`` (search, then
    answer another name from the retrieved documents or the corpus), ``guess`` (answer at once with
    a made-up name, no search). Each demo: ``{"kind", "question", "answers", "prompt": text,
    "segments": [{"text", "generated": bool}], "reward"}``; ``generated`` segments are the policy's
    turns (loss on), the others are information blocks (loss off), exactly as the agent loop
    formats them (``searchr1.format_observation``).
    """
    if not rows:
        raise ValueError("make_sft_demos: no rows")
    rng = random.Random(seed)
    answer_pool = sorted({a for r in rows for a in r["golden_answers"]})
    demos = []
    for _ in range(num_demos):
        row = rows[rng.randrange(len(rows))]
        kind = _demo_kind(rng.random(), correct_fraction=correct_fraction, wrong_copy_fraction=wrong_copy_fraction)
        answers = list(row["golden_answers"])
        segments = _search_segments(row["extra_info"]["hops"], search, topk) if kind != "guess" else []
        final = answers[0] if kind == "correct" else _wrong_answer(rng, answers, answer_pool)
        segments.append({"text": f"<answer> {final} </answer>", "generated": True})
        generated = "".join(s["text"] for s in segments if s["generated"])
        demos.append(
            {
                "kind": kind,
                "question": row["question"],
                "answers": answers,
                "prompt": searchr1.build_prompt(row["question"], chat_template=chat_template, tokenizer=tokenizer),
                "segments": segments,
                "reward": searchr1.compute_reward(generated, answers),
            }
        )
    return demos


def _demo_kind(u: float, *, correct_fraction: float, wrong_copy_fraction: float) -> str:
    """The kind of demonstration a uniform draw ``u`` in [0, 1) picks."""
    if u < correct_fraction:
        return "correct"
    return "wrong_copy" if u < correct_fraction + wrong_copy_fraction else "guess"


def _search_segments(hops: Sequence[dict], search: SearchFn, topk: int) -> list[dict]:
    """One search turn (generated) and its information block (not generated) per hop."""
    segments: list[dict] = []
    for hop in hops:
        segments.append({"text": f"<search> {hop['query']} </search>", "generated": True})
        docs = search([hop["query"]], topk)[0]
        segments.append({"text": searchr1.format_observation(docs), "generated": False})
    return segments


def _wrong_answer(rng: random.Random, answers: list[str], pool: list[str]) -> str:
    gold = {searchr1.normalize_answer(a) for a in answers}
    for _ in range(100):
        cand = rng.choice(pool)
        if searchr1.normalize_answer(cand) not in gold:
            return cand
    raise RuntimeError("no wrong answer candidate in the pool")


def warm_start_demos(cfg, *, data_dir: Path, num_demos: int) -> list[dict]:
    """The warm start's demonstrations (``asyncrl.embedded.warm_start``): ``make_sft_demos`` over the training rows,
    BM25 over the corpus (each query searched once), ``prepare.sft_*`` fractions."""
    from asyncrl.agent.data.loaders import load_rows
    from asyncrl.agent.tools.bm25 import read_corpus

    rows = load_rows(Path(data_dir) / "train.jsonl")
    bm25 = BM25Retriever(read_corpus(Path(data_dir) / "corpus.jsonl"))
    cache: dict[tuple[str, int], list[dict]] = {}

    def search(queries: list[str], k: int) -> list[list[dict]]:  # demos repeat queries: search each once
        missing = [q for q in dict.fromkeys(queries) if (q, k) not in cache]
        if missing:
            for q, docs in zip(missing, bm25.search(missing, k)[0]):
                cache[(q, k)] = docs
        return [cache[(q, k)] for q in queries]

    return make_sft_demos(
        rows,
        search,
        num_demos=num_demos,
        seed=cfg.prepare.seed + 1,
        topk=cfg.agentloop.tool.topk,
        correct_fraction=cfg.prepare.sft_correct_fraction,
        wrong_copy_fraction=cfg.prepare.sft_wrong_copy_fraction,
    )


# ---------------------------------------------------------------- files


def prepare_data(cfg, out_dir: Path) -> dict[str, Path]:
    """``prepare_if_needed``'s data stage: ``prepare.num_entities`` countries, ``prepare.seed``."""
    return write_dataset(out_dir, seed=cfg.prepare.seed, num_countries=cfg.prepare.num_entities)


def write_dataset(
    out_dir: str | Path,
    *,
    seed: int,
    num_countries: int = 200,
    num_test: int = 100,
    num_test_countries: int | None = None,
    two_hop_fraction: float = 0.2,
    num_tokenizer_demos: int = 200,
) -> dict[str, Path]:
    """Write the corpus, the train/test splits (JSONL and parquet) and the tokenizer text."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if num_test_countries is None:
        num_test_countries = max(1, num_countries // 10)
    kb = make_knowledge_base(seed=seed, num_countries=num_countries, num_test_countries=num_test_countries)
    docs = corpus_docs(kb)
    questions = make_questions(kb, seed=seed, two_hop_fraction=two_hop_fraction)
    train, test = split_rows(kb, questions, num_test=num_test)
    paths = {
        "corpus": out / "corpus.jsonl",
        "train": out / "train.jsonl",
        "test": out / "test.jsonl",
        "train_parquet": out / "train.parquet",
        "test_parquet": out / "test.parquet",
        "tokenizer_text": out / "tokenizer_text.txt",
    }
    _write_jsonl(paths["corpus"], docs)
    _write_jsonl(paths["train"], train)
    _write_jsonl(paths["test"], test)
    _write_parquet(paths["train_parquet"], train)
    _write_parquet(paths["test_parquet"], test)

    bm25 = BM25Retriever(docs)
    demos = make_sft_demos(train, lambda q, k: bm25.search(q, k)[0], num_demos=num_tokenizer_demos, seed=seed)
    lines = [d["contents"] for d in docs]
    lines += [r["prompt"][0]["content"] for r in train + test]
    lines += [d["prompt"] + "".join(s["text"] for s in d["segments"]) for d in demos]
    # the invalid-action message is tool text the policy reads often: give the BPE enough of it
    lines += [searchr1.INVALID_ACTION_MESSAGE.strip()] * 50
    paths["tokenizer_text"].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def _write_parquet(path: Path, rows: Sequence[dict]) -> None:
    import pyarrow as pa  # lazy: a second to import, and only the parquet copies need it
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(rows)), path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.embedded.synth", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-countries", type=int, default=200)
    ap.add_argument("--num-test", type=int, default=100, help="at most this many test questions")
    ap.add_argument("--two-hop-fraction", type=float, default=0.2)
    args = ap.parse_args(argv)
    paths = write_dataset(
        args.out,
        seed=args.seed,
        num_countries=args.num_countries,
        num_test=args.num_test,
        two_hop_fraction=args.two_hop_fraction,
    )
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
