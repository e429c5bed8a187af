"""Options written as flags out of habit (Miles' ``--max-weight-staleness=2``, ``--runner.max-steps 3``), answered
with the ``key=value`` override they mean. Pure.

``launch/train.py`` takes one config and ``key.sub=value`` overrides; its only options are ``--dry-run`` and
``--help``. Any other ``--flag[=value]`` is refused before anything loads, one line per flag:

- a Miles flag (``asyncrl.config.seeds``, the table of ``docs/seed_mapping.md``): the project key it maps to,
  written as an override: ``--max-weight-staleness: write it as agentloop.max_actor_accept_staleness=2``;
- a project key with dashes or without its section (``--max-steps``, ``--runner.max-steps``): that key, or the
  keys it could be (``--seed``: ``runner.seed`` or ``prepare.seed``);
- else the closest keys by spelling, if any, and the override syntax.

The value is the flag's own (``=2``, or the next argument when it is neither an option, an override nor the
TOML), quoted where a string key needs it (``'eval.eval_sglang.x="0.5"'``); a switch without one is ``true``
(``false`` for ``--no-...``).

    unknown_flags(["configs/tiny.toml", "--max-weight-staleness", "2"], ["--dry-run", "-h", "--help"])
    # -> [("--max-weight-staleness", "2")]
    flag_answer("--max-weight-staleness", "2")
    # -> "--max-weight-staleness: write it as agentloop.max_actor_accept_staleness=2 (Miles' --max-weight-...)"
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any, Literal, Optional, Union

from asyncrl.config.loader import key_types, parse_override_value
from asyncrl.config.seeds import project_key

_PLAIN_KEY = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+$")


def unknown_flags(argv: list[str], known: list[str]) -> list[tuple[str, Optional[str]]]:
    """``(flag, value or None)`` of each option in ``argv`` that is not one of ``known`` (nor an unambiguous
    abbreviation of a long one, as argparse accepts)."""
    out = []
    for i, tok in enumerate(argv):
        if not tok.startswith("-") or tok == "-" or tok == "--" or _is_number(tok):
            continue
        name, eq, value = tok.partition("=")
        longs = [k for k in known if k.startswith("--")]
        if name in known or (name.startswith("--") and len([k for k in longs if k.startswith(name)]) == 1):
            continue
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            looks_like_value = nxt is not None and not nxt.startswith("-") and "=" not in nxt
            value = nxt if looks_like_value and not nxt.endswith(".toml") else None
        out.append((name, value))
    return out


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def flag_answer(flag: str, value: Optional[str]) -> str:
    """One line: what ``flag`` (with ``value``, None when it had none) is written as here."""
    name = flag.lstrip("-")
    types = key_types()
    miles = project_key(name)
    if miles is not None:
        seed = f"Miles' --{name.replace('_', '-')}; docs/seed_mapping.md"
        if not _PLAIN_KEY.match(miles):
            return f"{flag}: here it is {miles} ({seed})"
        return f"{flag}: write it as {_override(miles, _key_type(miles, types), value, name)} ({seed})"
    dotted = name.replace("-", "_")
    matches = [k for k in types if k == dotted or k.endswith("." + dotted)]
    if matches:
        written = " or ".join(_override(k, (types[k], False), value, name) for k in matches)
        return f"{flag}: write it as {written}"
    leaves = {k.rsplit(".", 1)[-1]: k for k in types}
    close = difflib.get_close_matches(dotted, list(types), n=2, cutoff=0.7)
    close += [leaves[x] for x in difflib.get_close_matches(dotted, list(leaves), n=2, cutoff=0.7)]
    close = list(dict.fromkeys(close))[:2]
    hint = f"; did you mean {' or '.join(repr(k) for k in close)}?" if close else ""
    return f"{flag}: not an option (the options are --dry-run and --help){hint}"


def _key_type(key: str, types: dict[str, Any]) -> tuple[Any, bool]:
    """The annotation of ``key`` and whether it is a field inside a table (``eval.eval_sglang.x``: the table's
    value type, a string standing for any SGLang flag)."""
    if key in types:
        return types[key], False
    parent = key.rsplit(".", 1)[0]
    if typing.get_origin(types.get(parent)) is dict:
        return typing.get_args(types[parent])[1], True
    return None, False


def _override(key: str, typed: tuple[Any, bool], value: Optional[str], name: str) -> str:
    tp, in_table = typed
    if typing.get_origin(tp) is dict:  # Miles' "--eval-prompt-data name path": a TOML table here
        return f'{key}={{ NAME = "PATH" }}'
    args = set(typing.get_args(tp)) if typing.get_origin(tp) in (Union, Literal) else {tp}
    if value is None and (bool in args or in_table):  # a flag without a value is a switch
        value = "false" if name.replace("_", "-").startswith("no-") else "true"
    if value is None:
        return f"{key}=VALUE"
    is_text = str in args or (typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in args))
    if is_text and not isinstance(parse_override_value(value), str):  # 0.5, true: a string only when quoted
        return f"'{key}=\"{value}\"'"  # quoted for the shell too
    return f"{key}={value}"
