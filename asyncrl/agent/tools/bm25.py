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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from asyncrl.agent.tools import RetrieverError


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
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.docs = list(docs)
        self.name = name
        self._tokenizer = Tokenizer(stopwords="en")
        corpus_ids = self._tokenizer.tokenize([d["contents"] for d in self.docs], update_vocab=True,
                                              return_as="ids", show_progress=False)
        self._bm25 = bm25s.BM25()
        self._bm25.index(corpus_ids, show_progress=False)
        # bm25s is pure CPU work: run it off the event loop, one batch at a time.
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def from_jsonl(cls, path: str | Path) -> "BM25Retriever":
        return cls(read_corpus(path), name=f"bm25:{path}")

    def search(self, queries: Sequence[str], topk: int) -> tuple[list[list[dict]], list[list[float]]]:
        """Top documents and their BM25 scores per query (synchronous)."""
        if not queries:
            return [], []
        k = min(int(topk), len(self.docs))
        if k <= 0:
            raise RetrieverError(f"{self.name}: topk must be > 0, got {topk!r}")
        q_ids = self._tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        idx, scores = self._bm25.retrieve(q_ids, k=k, show_progress=False, n_threads=0)
        docs = [[self.docs[int(i)] for i in row] for row in idx]
        return docs, [[float(s) for s in row] for row in scores]

    async def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bm25")
        docs, _ = await asyncio.get_running_loop().run_in_executor(self._executor, self.search, queries, topk)
        return docs

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
