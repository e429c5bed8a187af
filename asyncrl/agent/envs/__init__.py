"""Environments: what an agentic task tells the agent loop (``base``), tool-call formats (``formats``), and the
lookup of environments, tools and rewards by name (``registry``).

    env = get_env("searchr1")                      # a built-in: asyncrl.agent.envs.<name>.ENV
    env = get_env("my_pkg.my_env:ENV")             # anything importable: an Environment, or a class of one
    tools = await make_tools(tool_specs(cfg, env), cfg)
"""

from asyncrl.agent.envs.base import Environment, Parsed, Score, ToolCall, ToolResult, as_score
from asyncrl.agent.envs.formats import QwenFormat, TagFormat, chat_prompt, describe_tools, tool_schemas
from asyncrl.agent.envs.registry import (
    available_envs,
    check_agent,
    get_env,
    load_reward,
    make_tools,
    tool_cards,
    tool_specs,
)

__all__ = [
    "Environment",
    "Parsed",
    "QwenFormat",
    "Score",
    "TagFormat",
    "ToolCall",
    "ToolResult",
    "as_score",
    "available_envs",
    "chat_prompt",
    "check_agent",
    "describe_tools",
    "get_env",
    "load_reward",
    "make_tools",
    "tool_cards",
    "tool_specs",
    "tool_schemas",
]
