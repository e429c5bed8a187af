"""Shared set-up of the agent integration tests: synthetic data, a tiny "scripted" Qwen2 checkpoint
served by the real CPU engine, and helpers to start/stop servers by PID.

The checkpoint is a real Qwen2 HF checkpoint whose weights make it a bigram model: the attention
and MLP outputs are zero, so the next-token logits depend on the current token only, and the
``lm_head`` rows are set so that greedy (and, with these margins, sampled) decoding follows one
chain: after a newline, ``<search> capital of X </search>``. The prompt and the information
block both end with a newline, so every turn searches (a bigram model cannot tell them apart):
turn 1 searches and gets the information block, turn 2 searches again. The engine, the client,
the tokenizer and the retriever are all real.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from asyncrl.agent.envs import searchr1
from asyncrl.cluster.ports import free_port

LOGIT_SCALE = 30.0


@dataclass
class ScriptedModel:
    path: Path
    data_dir: Path
    question: str
    answer: str
    query: str


def make_scripted_model(root: Path, *, seed: int = 0, topk: int = 2) -> ScriptedModel:
    import torch
    from safetensors.torch import load_file, save_file

    from asyncrl.agent.tokenizer import AgentTokenizer
    from asyncrl.agent.tools.bm25 import BM25Retriever
    from asyncrl.embedded.synth import write_dataset
    from asyncrl.models.tiny import make_tiny_checkpoint

    data = write_dataset(root / "data", seed=seed, num_countries=40, num_test=20, num_tokenizer_demos=40)
    path = make_tiny_checkpoint(
        root / "model",
        corpus_path=data["tokenizer_text"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=600,
        seed=seed,
    )
    tok = AgentTokenizer.from_pretrained(path)
    bm25 = BM25Retriever.from_jsonl(data["corpus"])
    rows = [json.loads(line) for line in data["train"].read_text().splitlines()]
    space = set(tok.encode(" "))
    for row in rows:
        if not row["question"].startswith("What is the capital of") or len(row["extra_info"]["hops"]) != 1:
            continue
        query, answer = row["extra_info"]["hops"][0]["query"], row["golden_answers"][0]
        search = [t for t in tok.encode(f"<search> {query} </search>") if t not in space]
        prompt_last = tok.encode(searchr1.build_prompt(row["question"]))[-1]
        obs_last = tok.encode(searchr1.format_observation(bm25.search([query], topk)[0][0]))[-1]
        chain = [prompt_last, *search]
        if len(set(chain)) == len(chain) and obs_last == prompt_last:
            break
    else:
        raise RuntimeError("no question with distinct chain tokens")
    w = load_file(str(path / "model.safetensors"))
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    emb = w["model.embed_tokens.weight"]
    lm = w["lm_head.weight"] * 0.1
    for cur, nxt in zip([prompt_last, *search[:-1]], search):
        h = emb[cur] / emb[cur].pow(2).mean().sqrt()  # what the final RMSNorm (weight 1) makes of it
        lm[nxt] = LOGIT_SCALE * h / h.norm()
    w["lm_head.weight"] = lm
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return ScriptedModel(path=path, data_dir=root / "data", question=row["question"], answer=answer, query=query)


class Server:
    """A child process serving HTTP; ``stop`` kills it by PID."""

    def __init__(self, cmd: list[str], log_path: Path):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


def start_cpu_engine(
    model_path: Path,
    log_path: Path,
    *,
    timeout_s: float = 120.0,
    max_running_requests: int = 16,
    api_key: str | None = None,
) -> tuple[Server, str]:
    port = free_port()
    srv = Server(
        [
            sys.executable,
            "-m",
            "asyncrl.cpu_engine.server",
            "--model-path",
            str(model_path),
            "--port",
            str(port),
            "--max-running-requests",
            str(max_running_requests),
            "--weight-version",
            "0",
            "--num-threads",
            "1",
            *(["--api-key", api_key] if api_key else []),
        ],
        log_path,
    )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if srv.proc.poll() is not None:
            srv.stop()
            raise RuntimeError(f"CPU engine exited: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/model_info", headers=headers), timeout=2) as r:
                if r.status == 200:
                    return srv, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            srv.stop()
            raise TimeoutError(f"CPU engine not ready in {timeout_s}s: {log_path.read_text()[-2000:]}")
        time.sleep(0.2)


def start_retrieval_server(
    corpus: Path, log_path: Path, *, timeout_s: float = 60.0, port: int = 0
) -> tuple[Server, str]:
    srv = Server(
        [sys.executable, "-m", "asyncrl.agent.tools.retrieval_server", "--corpus", str(corpus), "--port", str(port)],
        log_path,
    )
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line:
        if srv.proc.poll() is not None or time.monotonic() > deadline:
            srv.stop()
            raise RuntimeError(f"retrieval server did not start: {log_path.read_text()[-2000:]}")
        line = srv.proc.stdout.readline()
    return srv, json.loads(line)["url"]
