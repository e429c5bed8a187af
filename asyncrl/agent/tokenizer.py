"""The agent loop's tokenizer: an HF checkpoint's ``tokenizer.json`` through ``tokenizers`` (no transformers).

Used to tokenize a prompt once, to decode the engine's output ids (for parsing only: generated
ids are never re-encoded) and to tokenize tool observations. ``apply_chat_template`` renders the
checkpoint's Jinja chat template as HF does (``messages``, ``add_generation_prompt`` and the
special-token strings in the context).

    tok = AgentTokenizer.from_pretrained("runs/tiny/model")
    ids = tok.encode("Answer the given question. ...")
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from asyncrl.models.spec import read_eos_token_ids, read_json


class AgentTokenizer:
    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        path: str = "",
    ):
        self.tokenizer = tokenizer
        """A ``tokenizers.Tokenizer``."""
        self.eos_token_ids = list(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.path = path
        self._template = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> AgentTokenizer:
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"tokenizer path {str(root)!r}: no tokenizer.json there")
        tokenizer = Tokenizer.from_file(str(tok_file))
        tcfg_path = root / "tokenizer_config.json"
        tcfg = read_json(tcfg_path) if tcfg_path.is_file() else {}
        special = {k: _token_str(tcfg.get(k)) for k in ("eos_token", "bos_token", "pad_token", "unk_token")}
        special = {k: v for k, v in special.items() if v}
        eos = list(read_eos_token_ids(root))
        if not eos and "eos_token" in special:
            tid = tokenizer.token_to_id(special["eos_token"])
            eos = [] if tid is None else [tid]
        return cls(
            tokenizer,
            eos_token_ids=eos,
            chat_template=tcfg.get("chat_template"),
            special_tokens=special,
            path=str(root),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prefix_encoder(self, prefix: str) -> Callable[[str], list[int]]:
        """A function equal to ``encode`` that tokenizes texts starting with ``prefix`` (a prompt template's fixed
        head) faster: ``prefix`` is cut after its last added token that splits the text whatever follows
        (``split_point``); the head's ids are computed once and only the rest is tokenized per call. Texts that
        do not start with ``prefix`` (or a tokenizer with no such cut) take ``encode`` itself."""
        k = self.split_point(prefix)
        if k == 0:
            return self.encode
        head, head_ids, encode = prefix[:k], tuple(self.encode(prefix[:k])), self.tokenizer.encode

        def encode_prompt(text: str) -> list[int]:
            if not text.startswith(head):
                return self.encode(text)
            ids = list(head_ids)
            ids += encode(text[k:], add_special_tokens=False).ids
            return ids

        return encode_prompt

    def split_point(self, text: str) -> int:
        """The end of the last added token in ``text`` after which the tokenization splits: for any ``rest``,
        ``encode(text[:k] + rest) == encode(text[:k]) + encode(rest)``; 0 when there is none.

        ``tokenizers`` cuts the input at added tokens before it normalizes and pre-tokenizes the pieces between
        them, each piece on its own. That holds at an added token that is matched whatever follows it and does not
        reach into the next piece: not ``single_word`` (its match depends on the next character), not ``rstrip``
        (it swallows the whitespace after it), not ``normalized`` (matched after normalization, inside a piece),
        no other added token able to start before the cut and end after it, and no step that depends on a
        piece's position in the input (``Metaspace`` with ``prepend_scheme = "first"``) or on its length
        (truncation, padding). A few probe texts confirm the cut; any mismatch means 0."""
        tok = self.tokenizer
        if tok.truncation is not None or tok.padding is not None or _position_dependent(tok):
            return 0
        added = [a.content for a in tok.get_added_tokens_decoder().values() if a.content]
        safe = [
            a.content
            for a in tok.get_added_tokens_decoder().values()
            if a.content and not (a.single_word or a.rstrip or a.normalized)
        ]
        best = 0
        for c in safe:
            i = text.rfind(c)
            if i < 0 or i + len(c) <= best:
                continue
            k = i + len(c)
            head = text[:k]
            if any(head.endswith(o[:j]) for o in added for j in range(1, len(o))):
                continue  # another added token could match across the cut
            best = k
        if best and any(
            self.encode(text[:best] + rest) != self.encode(text[:best]) + self.encode(rest) for rest in _PROBES
        ):
            return 0
        return best

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
    ) -> Any:
        """The rendered conversation; ``tools``: function schemas (``asyncrl.agent.envs.tool_schemas``), which a
        template that supports them (Qwen2.5/Qwen3) renders into its system prompt, as HF's ``tools=``."""
        if not self.chat_template:
            raise ValueError(f"agentloop.chat_template = true but the tokenizer at {self.path!r} has no chat_template")
        if self._template is None:
            import jinja2  # lazy: only chat templates need it (it comes with torch; not our dependency)
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                # as HF's: plain JSON (jinja's own filter escapes <, >, & for HTML)
                return json.dumps(
                    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
                )

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = tojson
            self._template = env.from_string(self.chat_template)
        extra = {"tools": tools} if tools else {}
        text = self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **extra, **self.special_tokens
        )
        return self.encode(text) if tokenize else text


_PROBES = ("", " ", "x", " x y", "\n\nQuestion: who?\n", ". Question: q0?", "  é 12,3!", "<think>")


def _position_dependent(tok: Any) -> bool:
    """A pre-tokenizer that treats the input's first piece differently (``Metaspace``, ``prepend_scheme =
    "first"``)."""
    spec = json.loads(tok.to_str()).get("pre_tokenizer")
    stack = [spec]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized as a dict
        return value.get("content")
    return value
