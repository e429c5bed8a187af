"""BM25 over a Search-R1 JSONL corpus, in process (bm25s, numpy backend).

Words are lowercased ``\\w\\w+`` runs minus English stop words (bm25s' tokenizer), over the whole
``contents`` (title line included). Every query gets ``min(topk, corpus size)`` documents, best
first, even when no word matches (scores 0 then), as a dense retriever would.

    r = BM25Retriever.from_jsonl("corpus.jsonl")
    docs, scores = r.search(["capital of Zorvania"], topk=3)       # sync, for the server and demos
    docs = await r.retrieve(["capital of Zorvania"], topk=3)       # async, for the agent loop
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from asyncrl.agent.tools.base import RetrieverError


def read_corpus(path: str | Path) -> list[dict]:
    """Rows of a Search-R1 corpus JSONL; each needs ``contents`` (``id`` defaults to the line number)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"agentloop.tool.corpus_path: corpus file {str(p)!r} does not exist")
    docs = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{lineno}: not a JSON object ({exc})") from None
            if "contents" not in row:
                raise ValueError(f"{p}:{lineno}: no 'contents' field")
            row.setdefault("id", str(len(docs)))
            docs.append(row)
    if not docs:
        raise ValueError(f"{p}: empty corpus")
    return docs


class BM25Retriever:
    def __init__(self, docs: Sequence[dict], *, name: str = "bm25"):
        # lazy: bm25s (and the scipy it pulls in) is only needed where a BM25 index is built, not by the
        # HTTP retriever's users that import this package
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.docs = list(docs)
        self.name = name
        self._tokenizer = Tokenizer(stopwords="en")
        corpus_ids = self._tokenizer.tokenize(
            [d["contents"] for d in self.docs], update_vocab=True, return_as="ids", show_progress=False
        )
        self._bm25 = bm25s.BM25()
        self._bm25.index(corpus_ids, show_progress=False)
        # bm25s is pure CPU work: run it off the event loop, one batch at a time.
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def from_jsonl(cls, path: str | Path) -> BM25Retriever:
        return cls(read_corpus(path), name=f"bm25:{path}")

    def search(self, queries: Sequence[str], topk: int) -> tuple[list[list[dict]], list[list[float]]]:
        """Top documents and their BM25 scores per query (synchronous)."""
        if not queries:
            return [], []
        k = min(int(topk), len(self.docs))
        if k <= 0:
            raise RetrieverError(f"{self.name}: topk must be > 0, got {topk!r}")
        q_ids = self._tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        docs, scores = [], []
        for ids in q_ids:
            top, top_scores = self._topk(ids, k)
            docs.append([self.docs[i] for i in top])
            scores.append(top_scores)
        return docs, scores

    def _topk(self, ids: list[int], k: int) -> tuple[list[int], list[float]]:
        """Top-k over the documents that share a word with the query only (BM25 scores are >= 0 and
        0 elsewhere): a full-corpus partial sort per query would dominate on large corpora. Ties
        go to the lower document index; missing places are filled with zero-score documents."""
        num_docs = len(self.docs)
        if ids:
            scores = self._bm25.get_scores_from_ids(ids)
            cand = np.flatnonzero(scores)
        else:
            scores, cand = None, np.empty(0, dtype=np.int64)
        if len(cand) > k:
            cand = cand[np.argpartition(-scores[cand], k - 1)[:k]]
        if len(cand):
            cand = cand[np.lexsort((cand, -scores[cand]))]
        top = [int(i) for i in cand]
        top_scores = [float(scores[i]) for i in top] if len(top) else []
        if len(top) < k:
            chosen = set(top)
            fill = [i for i in range(min(num_docs, k + len(top))) if i not in chosen][: k - len(top)]
            top += fill
            top_scores += [0.0] * len(fill)
        return top, top_scores

    async def wait_available(self) -> None:
        """In process: always available."""

    async def retrieve(self, queries: list[str], topk: int, *, stats: dict | None = None) -> list[list[dict]]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bm25")
        docs, _ = await asyncio.get_running_loop().run_in_executor(self._executor, self.search, queries, topk)
        return docs

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
