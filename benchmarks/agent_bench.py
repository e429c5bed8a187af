"""Agent-loop overhead per turn and BM25 throughput.

    python benchmarks/agent_bench.py [--quick]

1. Overhead per turn: the loop runs Search-R1 trajectories (search, information, answer) against
   an engine that answers at once from a script and a retriever that answers at once from a
   table, so generation and retrieval cost ~0; overhead = (wall time - time inside generate and
   retrieve calls) / turns. It covers prompt tokenization, decoding output ids, parsing the action,
   formatting and tokenizing observations, bookkeeping and asyncio scheduling. Target < 2 ms.
2. BM25 queries/s on a 100k-document synthetic corpus (Search-R1 JSONL format), batched queries
   through ``BM25Retriever.search``. Target >= 1,000 queries/s.

Prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.agent.envs import get_env  # noqa: E402
from asyncrl.agent.loop import AgentLoop, EngineHandle  # noqa: E402
from asyncrl.agent.tokenizer import AgentTokenizer  # noqa: E402
from asyncrl.agent.tools.bm25 import BM25Retriever  # noqa: E402
from asyncrl.broker.types import Group, PromptItem  # noqa: E402
from asyncrl.config.schema import AgentLoopConfig, SamplingConfig, ToolConfig  # noqa: E402
from asyncrl.embedded.synth import write_dataset  # noqa: E402


def make_tokenizer(tmp: Path) -> tuple[AgentTokenizer, dict]:
    from asyncrl.models.tiny import make_tiny_checkpoint

    data = write_dataset(tmp / "data", seed=0, num_countries=100, num_test=20, num_tokenizer_demos=50)
    path = make_tiny_checkpoint(
        tmp / "model",
        corpus_path=data["tokenizer_text"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return AgentTokenizer.from_pretrained(path), data


class InstantRetriever:
    """A ``asyncrl.agent.tools.base.Retriever`` answering from a fixed list at once (the loop's own overhead)."""

    name = "table"

    def __init__(self, docs):
        self.docs = docs
        self.seconds = 0.0

    async def wait_available(self):
        """Never in an outage."""

    async def retrieve(self, queries, topk, *, stats=None):
        t0 = time.perf_counter()
        out = [self.docs[:topk] for _ in queries]
        self.seconds += time.perf_counter() - t0
        return out

    async def close(self):
        pass


def bench_overhead(tok: AgentTokenizer, data: dict, *, num_groups: int, group_size: int) -> dict:
    rows = [json.loads(line) for line in data["train"].read_text().splitlines()]
    docs = [json.loads(line) for line in data["corpus"].read_text().splitlines()][:3]
    replies = {}
    for r in rows:
        hop = r["extra_info"]["hops"][0]
        replies[r["question"]] = (
            tok.encode(f"<think> I need to search. </think> <search> {hop['query']} </search>"),
            tok.encode(f"<answer> {r['golden_answers'][0]} </answer>"),
        )
    first_turn = {}
    gen_seconds = [0.0]

    async def engine(input_ids, params, rid):
        t0 = time.perf_counter()
        key = rid.rsplit("-t", 1)[0]
        turn = first_turn.get(key, 0)
        first_turn[key] = turn + 1
        q = item_of[key.split("-s")[0]]
        ids = replies[q][min(turn, 1)]
        resp = {
            "output_ids": ids,
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": "</search>" if turn == 0 else "</answer>"},
                "weight_version": "1",
                "weight_versions": [{"version": "1", "start": 0, "end": len(ids)}],
                "output_token_logprobs": [[-0.5, t, None] for t in ids],
                "num_retractions": 0,
            },
        }
        gen_seconds[0] += time.perf_counter() - t0
        return resp

    retriever = InstantRetriever(docs)
    cfg = AgentLoopConfig(
        task_name="searchr1",
        max_turns=3,
        max_tokens_per_turn=64,
        max_total_tokens=1024,
        tool=ToolConfig(topk=3, max_obs_tokens=200),
    )
    loop = AgentLoop(
        env=get_env("searchr1"), tokenizer=tok, retriever=retriever, agent_cfg=cfg, sampling=SamplingConfig()
    )
    handle = EngineHandle(None, max_in_flight=64, url="bench", generate_raw=engine)
    items = [
        PromptItem(index=i, prompt=rows[i % len(rows)]["question"], answers=rows[i % len(rows)]["golden_answers"])
        for i in range(num_groups)
    ]
    item_of = {}
    for i, it in enumerate(items):
        item_of[f"bench-g{i}"] = it.prompt

    async def go():
        groups = [Group(group_id=i, item=it, epoch=0) for i, it in enumerate(items)]
        return await asyncio.gather(*(loop.run_group(g, handle, group_size=group_size) for g in groups))

    loop.rid_prefix = "bench"
    t0 = time.perf_counter()
    groups = asyncio.run(go())
    wall = time.perf_counter() - t0
    trajs = [t for g in groups for t in g.trajectories]
    turns = sum(t.num_turns for t in trajs)
    assert all(t.reward == 1.0 for t in trajs), "benchmark trajectories should all be correct"
    overhead = wall - gen_seconds[0] - retriever.seconds
    return {
        "turns": turns,
        "trajectories": len(trajs),
        "wall_s": round(wall, 3),
        "overhead_ms_per_turn": round(1000 * overhead / turns, 4),
        "mean_response_tokens": round(sum(len(t.response_ids) for t in trajs) / len(trajs), 1),
    }


def bench_bm25(num_docs: int, num_queries: int, batch: int) -> dict:
    rng = random.Random(0)
    syll = ["ka", "ro", "mi", "tu", "le", "sa", "vo", "ni", "pe", "zu", "da", "fi", "go", "hu", "bri", "sto"]
    names = set()
    while len(names) < num_docs:
        names.add("".join(rng.choice(syll) for _ in range(rng.randint(3, 5))).capitalize())
    names = sorted(names)
    rels = ["capital", "currency", "leader", "river", "mountain", "language", "founder", "anthem"]
    docs = []
    for i, n in enumerate(names):
        rel = rels[i % len(rels)]
        other = names[rng.randrange(num_docs)]
        docs.append({"id": str(i), "contents": f"{n}\nThe {rel} of {n} is {other}. It is known for {rel}s."})
    t0 = time.perf_counter()
    r = BM25Retriever(docs)
    index_s = time.perf_counter() - t0
    queries = [f"{rels[i % len(rels)]} of {names[rng.randrange(num_docs)]}" for i in range(num_queries)]
    r.search(queries[:batch], topk=3)  # warm-up
    t0 = time.perf_counter()
    hits = 0
    for s in range(0, num_queries, batch):
        qs = queries[s : s + batch]
        got, _ = r.search(qs, topk=3)
        hits += sum(q.split(" of ")[1] == d[0]["contents"].split("\n")[0] for q, d in zip(qs, got))
    dt = time.perf_counter() - t0
    return {
        "num_docs": num_docs,
        "num_queries": num_queries,
        "batch": batch,
        "index_s": round(index_s, 2),
        "queries_per_s": round(num_queries / dt, 1),
        "top1_is_subject": round(hits / num_queries, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="under 60 s")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tok, data = make_tokenizer(Path(tmp))
        overhead = bench_overhead(tok, data, num_groups=50 if args.quick else 400, group_size=4)
    bm25 = bench_bm25(100_000, 5_000 if args.quick else 50_000, batch=256)
    out = {
        "bench": "agent",
        "quick": args.quick,
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "overhead_ms_per_turn": overhead["overhead_ms_per_turn"],
        "overhead_target_ms": 2.0,
        "bm25_queries_per_s": bm25["queries_per_s"],
        "bm25_target_qps": 1000,
        "overhead": overhead,
        "bm25": bm25,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
