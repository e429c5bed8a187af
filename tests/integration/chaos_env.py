"""An environment for tests (``agentloop.task_name = "chaos_env:ENV"``): whatever the model writes, every turn but
the last calls five tools at once -- the sandboxed ``python`` tool with a program that hangs, one that raises, one
that prints 100 MB and one that connects to the TCP port in ``ASYNCRL_TEST_CHAOS_PORT`` (a listener of the test),
and the ``calculator`` -- so a real run meets every kind of tool failure in every trajectory."""

from __future__ import annotations

import os

from asyncrl.agent.envs import Environment, Parsed, QwenFormat, Score, ToolCall, searchr1

PROGRAMS = {
    "hang": "while True:\n    pass\n",
    "raise": "raise ValueError('chaos: the program raised')\n",
    "flood": "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n",
    "network": ("import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')\n"),
}


class ChaosEnv(Environment):
    name = "chaos"
    tools = ("python", "calculator")
    format = QwenFormat()

    def prompt(self, item, *, tools, chat_template=False, tokenizer=None):
        return searchr1.build_prompt(item.prompt)

    def parse(self, generated_text: str) -> Parsed:
        port = os.environ.get("ASYNCRL_TEST_CHAOS_PORT", "9")
        calls = [ToolCall("python", {"code": code.replace("{port}", port)}) for code in PROGRAMS.values()]
        return Parsed(calls=(*calls, ToolCall("calculator", {"expression": "6*7"})))

    def score(self, item, generated_text: str) -> Score:
        return Score(float(len(generated_text) % 2), {"chars": float(len(generated_text))})


ENV = ChaosEnv()
