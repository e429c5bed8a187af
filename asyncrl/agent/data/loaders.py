"""Prompt loading: Search-R1 parquet, or JSONL rows with the same fields -> ``PromptItem``.

A Search-R1 row: ``data_source``, ``prompt`` (chat list ``[{"role": "user", "content": ...}]``),
``ability``, ``reward_model{style, ground_truth{target: [...]}}``, ``extra_info{split, index}``,
and usually the raw ``question`` / ``golden_answers`` columns kept by its preprocessing. The
question comes from ``question`` when present, else from the text after the last ``Question:``
of the prompt; the gold answers from ``reward_model.ground_truth.target``, else ``golden_answers``.
``PromptItem.index`` is the row's position in the file (stable across epochs).

    items = load_prompts("runs/tiny/data/train.jsonl")
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from asyncrl.broker.types import PromptItem


def load_rows(path: str | Path) -> list[dict]:
    """The raw rows of a ``.parquet`` or ``.jsonl``/``.json`` file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file {str(p)!r} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: a second to import, and only parquet files need it

        return pq.read_table(p).to_pylist()
    if p.suffix in (".jsonl", ".json"):
        rows = []
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{p}:{lineno}: not a JSON object ({exc})") from None
        return rows
    raise ValueError(f"prompt file {str(p)!r}: expected .parquet or .jsonl")


def row_to_item(row: dict, index: int, *, source: str = "") -> PromptItem:
    question = row.get("question")
    if not question:
        question = _question_from_prompt(row.get("prompt"))
    if not question:
        raise ValueError(f"{source} row {index}: no 'question' field and no 'Question:' in its prompt")
    answers = _answers(row)
    if not answers:
        raise ValueError(f"{source} row {index}: no gold answers (reward_model.ground_truth.target or golden_answers)")
    extra: dict[str, Any] = {}
    for key in ("id", "extra_info", "ability"):
        if row.get(key) is not None:
            extra[key] = row[key]
    return PromptItem(
        index=index,
        prompt=str(question).strip(),
        answers=answers,
        data_source=str(row.get("data_source") or ""),
        extra=extra,
    )


def load_prompts(path: str | Path) -> list[PromptItem]:
    """All prompts of a Search-R1 parquet or JSONL file, in file order."""
    return [row_to_item(row, i, source=str(path)) for i, row in enumerate(load_rows(path))]


def _question_from_prompt(prompt: Any) -> str | None:
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else None
    if not isinstance(prompt, str):
        return None
    head, sep, tail = prompt.rpartition("Question:")
    return tail.strip() if sep else None


def _answers(row: dict) -> list[str]:
    target = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if target is None:
        target = row.get("golden_answers")
    if target is None:
        target = row.get("answers")
    if isinstance(target, str):
        return [target]
    return [str(t) for t in _as_list(target)]


def _as_list(value: Any) -> Iterable:
    if value is None:
        return []
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value)
