"""Environments, tools and rewards by name: the lookups the agent worker, the evaluator and the dry run share.

Contract
- ``get_env(spec)``: a built-in name (``searchr1``, ``arith``: the module ``asyncrl.agent.envs.<name>``'s ``ENV``)
  or ``module:attr`` (an ``Environment``, or a class or function returning one). ``ConfigError`` naming
  ``agentloop.task_name`` and the reason otherwise.
- ``tool_specs(cfg, env)``: ``agentloop.tools`` when set, else the environment's ``tools``. A spec is a built-in
  name (``search``: the retriever of ``agentloop.tool``; ``python``: the sandbox of ``agentloop.python``;
  ``calculator``), ``http:<url>`` (every tool a tool server at ``<url>`` lists, ``asyncrl.agent.tools.http_tool``),
  ``module:attr`` (a ``Tool``, or a class or function returning one), or a ``Tool`` object.
- ``make_tools(specs, cfg, retriever=None)`` (async: a tool server is asked for its tools): ``{name: Tool}``; two
  tools of one name are an error. ``retriever``: the ``search`` tool's retriever when one is already built.
- ``tool_cards(specs)``: what a prompt shows of the tools, without making them (the broker counts prompt lengths).
- ``load_reward(spec)``: ``agentloop.reward_path`` as a function ``(item, generated_text) -> Score``.
- ``check_agent(cfg)``: the dry run's and the launcher's check, before any process starts: the environment, every
  tool spec (imported, named; a tool server's URL well formed) and the reward import, and what the environment's
  tags call exists. ``ConfigError`` naming the key.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from asyncrl.agent.envs.base import Environment, Score, as_score
from asyncrl.config.validate import ConfigError, resolve_hook

_NOT_ENVS = {"base", "formats", "registry"}
_BUILTIN_CLASSES = {
    "search": "asyncrl.agent.tools.search:SearchTool",
    "python": "asyncrl.agent.tools.python_sandbox:PythonTool",
    "calculator": "asyncrl.agent.tools.calculator:CalculatorTool",
}
BUILTIN_TOOLS = tuple(_BUILTIN_CLASSES)
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def available_envs() -> list[str]:
    here = str(Path(__file__).parent)
    return sorted(m.name for m in pkgutil.iter_modules([here]) if m.name not in _NOT_ENVS)


def _instance(obj: Any, spec: str, key: str, what: str) -> Any:
    """A class or a factory function is called with no arguments; anything else is the object itself."""
    if inspect.isclass(obj) or inspect.isfunction(obj):
        try:
            return obj()
        except Exception as e:
            raise ConfigError(f"{key}: {spec!r}: making the {what} raised {type(e).__name__}: {e}") from None
    return obj


def get_env(spec: Optional[str], key: str = "agentloop.task_name") -> Environment:
    if not spec:
        raise ConfigError(f'{key}: no environment named (e.g. {key} = "searchr1"; known: {available_envs()})')
    if ":" in spec:
        env = _instance(resolve_hook(spec, key), spec, key, "environment")
    else:
        if spec in _NOT_ENVS or not _NAME_RE.fullmatch(spec):
            raise ConfigError(f"{key}: unknown environment {spec!r}; known: {available_envs()} or 'module:attr'")
        try:
            module = importlib.import_module(f"asyncrl.agent.envs.{spec}")
        except ModuleNotFoundError as e:
            if e.name != f"asyncrl.agent.envs.{spec}":
                raise
            raise ConfigError(
                f"{key}: unknown environment {spec!r}; known: {available_envs()} or 'module:attr'"
            ) from None
        env = getattr(module, "ENV", None)
        if env is None:
            raise ConfigError(f"{key}: module {module.__name__} defines no ENV")
    missing = [m for m in ("prompt", "score", "parse", "observe", "invalid_observation") if not hasattr(env, m)]
    if missing:
        raise ConfigError(
            f"{key}: {spec!r} is a {type(env).__name__}, not an environment (no {', '.join(missing)}); subclass "
            f"asyncrl.agent.envs.Environment (docs/environments.md)"
        )
    return env


def tool_specs(cfg, env: Environment) -> list[Any]:
    given = cfg.agentloop.tools
    return list(given) if given is not None else list(getattr(env, "tools", ()))


def load_reward(spec: str, key: str = "agentloop.reward_path"):
    fn = resolve_hook(spec, key)
    if not callable(fn):
        raise ConfigError(f"{key}: {spec!r} is not callable")

    def reward(item, generated_text: str) -> Score:
        return as_score(fn(item, generated_text), where=f"{key} {spec!r}")

    return reward


def _check_tool_object(tool: Any, where: str) -> str:
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"{where}: a tool needs a name matching [A-Za-z_][A-Za-z0-9_-]*, got {name!r}")
    if not callable(getattr(tool, "call", None)):
        raise ConfigError(f"{where}: tool {name!r} has no async call(arguments, *, timeout_s)")
    return name


def _check_spec(spec: Any, key: str) -> Optional[str]:
    """The tool name a spec gives (None: a tool server's, known only when asked)."""
    if not isinstance(spec, str):
        return _check_tool_object(spec, key)
    if spec in BUILTIN_TOOLS:
        return spec
    if spec.startswith("http:"):
        url = spec[len("http:") :]
        u = urlparse(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"{key}: {spec!r}: expected http:<http://host:port> of a tool server")
        return None
    if ":" in spec:
        obj = resolve_hook(spec, key)
        if inspect.isclass(obj):
            return _check_tool_object(obj, f"{key} {spec!r}")
        return _check_tool_object(obj, f"{key} {spec!r}") if hasattr(obj, "call") else None
    raise ConfigError(f"{key}: unknown tool {spec!r}; built in: {', '.join(BUILTIN_TOOLS)}; or http:<url>, module:attr")


def check_agent(cfg) -> list[str]:
    """What the dry run says about the agent side (``ConfigError`` naming the key on anything wrong)."""
    a = cfg.agentloop
    if not a.task_name:
        return []
    env = get_env(a.task_name)
    key = "agentloop.tools" if a.tools is not None else f"agentloop.task_name ({a.task_name!r}: its tools)"
    specs = tool_specs(cfg, env)
    names = [_check_spec(s, key) for s in specs]
    known = [n for n in names if n]
    dup = sorted({n for n in known if known.count(n) > 1})
    if dup:
        raise ConfigError(f"{key}: two tools named {dup[0]!r}")
    if "search" in specs:
        tool = a.tool
        if tool.retriever == "http" and not tool.retriever_url:
            raise ConfigError('agentloop.tool.retriever_url: required when agentloop.tool.retriever = "http"')
        if tool.retriever == "bm25" and not tool.corpus_path:
            raise ConfigError(
                f'agentloop.tool.corpus_path: required when agentloop.tool.retriever = "bm25" ({key} uses search)'
            )
    fmt = getattr(env, "format", None)
    if None not in names and hasattr(fmt, "calls"):
        for tag, (tool, _) in fmt.calls.items():
            if tool not in known:
                raise ConfigError(f"{key}: the environment's <{tag}> calls tool {tool!r}, which is not among {known}")
    if a.reward_path:
        load_reward(a.reward_path)
    return [
        f"environment {a.task_name!r} ({type(env).__name__}), tools: "
        + (", ".join(n or str(s) for n, s in zip(names, specs)) or "none")
        + (f", reward {a.reward_path}" if a.reward_path else "")
    ]


def tool_cards(specs: Sequence[Any]) -> list[Any]:
    """What a prompt shows of each tool (``name``, ``description``, ``parameters``) without making it: the built-in
    tools' classes, ``module:attr`` objects; a tool server's tools are left out (known only when asked)."""
    out = []
    for spec in specs:
        if not isinstance(spec, str):
            out.append(spec)
        elif spec in _BUILTIN_CLASSES:
            module, cls = _BUILTIN_CLASSES[spec].split(":")
            out.append(getattr(importlib.import_module(module), cls))
        elif ":" in spec and not spec.startswith("http:"):
            out.append(resolve_hook(spec, "agentloop.tools"))
    return out


async def make_tools(specs: Sequence[Any], cfg, *, retriever=None) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def add(tool: Any, where: str) -> None:
        name = _check_tool_object(tool, where)
        if name in out:
            raise ConfigError(f"{where}: two tools named {name!r}")
        out[name] = tool

    for spec in specs:
        if not isinstance(spec, str):
            add(spec, "agentloop.tools")
        elif spec == "search":
            from asyncrl.agent.tools import make_retriever
            from asyncrl.agent.tools.search import SearchTool

            add(SearchTool(retriever or make_retriever(cfg.agentloop.tool), cfg.agentloop.tool.topk), spec)
        elif spec == "python":
            from asyncrl.agent.tools.python_sandbox import PythonTool

            p = cfg.agentloop.python
            add(
                PythonTool(
                    timeout_s=p.timeout_s,
                    cpu_s=p.cpu_s,
                    memory_mb=p.memory_mb,
                    max_output_bytes=p.max_output_bytes,
                    max_concurrent=p.max_concurrent,
                    file_size_mb=p.file_size_mb,
                    network_isolation=p.network_isolation,
                ),
                spec,
            )
        elif spec == "calculator":
            from asyncrl.agent.tools.calculator import CalculatorTool

            add(CalculatorTool(), spec)
        elif spec.startswith("http:"):
            from asyncrl.agent.tools.http_tool import HttpTool

            t = cfg.agentloop.tool_timeout_s
            for tool in await HttpTool.discover(spec[len("http:") :], timeout_s=t, call_timeout_s=t):
                add(tool, spec)
        else:
            add(_instance(resolve_hook(spec, "agentloop.tools"), spec, "agentloop.tools", "tool"), spec)
    return out
