"""Tool-call formats (Search-R1 tags, Qwen's <tool_call> JSON) and the chat-template rendering of tools and tool
results, on a chat template written here in the shape Qwen2.5 documents (tools in the system turn, tool results as
<tool_response> blocks in one user turn)."""

import json

import pytest

from asyncrl.agent.envs import QwenFormat, TagFormat, ToolCall, chat_prompt, get_env, tool_schemas
from asyncrl.agent.envs.base import Parsed, ToolResult
from asyncrl.agent.envs.formats import chat_tool_turn
from asyncrl.agent.tokenizer import AgentTokenizer

# Written for this test in the layout Qwen2.5's model card documents (not its template's text).
QWEN_LIKE = (  # rendered with trim_blocks, as HF does: a newline right after a block tag is dropped, so newlines are
    # written as {{ nl }} there
    "{% set nl = '\\n' %}"
    "{% if tools %}<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>"
    "{% for t in tools %}{{ nl }}{{ t | tojson }}{% endfor %}{{ nl }}</tools>\n\nCall a function with <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>{{ nl }}{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ nl }}<tool_response>{{ nl }}{{ m.content }}{{ nl }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ nl }}{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}{{ nl }}{{ m.content }}<|im_end|>{{ nl }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% endif %}"
)


class Card:
    name, description = "python", "Run Python code; returns what it prints."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}


@pytest.fixture()
def chat_tok():
    return AgentTokenizer(None, eos_token_ids=[], chat_template=QWEN_LIKE)


def test_tag_format_takes_the_last_complete_action_and_names_every_tag():
    fmt = TagFormat(calls={"py": ("python", "code"), "calc": ("calculator", "expression")})
    assert fmt.stop == ("</py>", "</calc>", "</answer>")
    assert fmt.parse("<calc> 2*3 </calc>") == Parsed(calls=(ToolCall("calculator", {"expression": "2*3"}),))
    assert fmt.parse("<calc>1</calc> then <py>print(1)</py>").calls[0].name == "python"
    assert fmt.parse("<py> a <calc> 7 </calc>").calls == (ToolCall("calculator", {"expression": "7"}),)
    assert fmt.parse("<answer> 42 </answer>") == Parsed(answer="42")
    assert fmt.parse("<calc> 2*3").kind == "invalid"
    msg = fmt.invalid_message(Parsed())
    assert "<py> and </py>" in msg and "<calc> and </calc>" in msg and "<answer> and </answer>" in msg
    call = ToolCall("calculator", {"expression": "1/0"})
    assert fmt.render([ToolResult(call, "6"), ToolResult(call, error="division by zero")]) == (
        "\n\n<result>6</result>\n\n\n\n<result>error: division by zero</result>\n\n"
    )
    with pytest.raises(ValueError, match="distinct names"):
        TagFormat(calls={"answer": ("x", "y")})


def test_searchr1_is_a_tag_format_with_its_own_texts():
    env = get_env("searchr1")
    assert env.stop == ("</search>", "</answer>") and env.reward_name == "accuracy"
    assert env.parse("<search> capital of Zorvania </search>").calls == (
        ToolCall("search", {"query": "capital of Zorvania"}),
    )
    obs = env.observe([ToolResult(ToolCall("search", {"query": "q"}), [{"id": "0", "contents": "T\nbody"}])])
    assert obs == "\n\n<information>Doc 1(Title: T) body</information>\n\n"


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (
            '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>',
            ("python", {"code": "print(1)"}),
        ),
        (
            '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>',
            ("calc", {"expression": "2+2"}),
        ),
        ('<tool_call>{"name": "now"}</tool_call>', ("now", {})),
    ],
)
def test_qwen_format_reads_one_call(text, expect):
    p = QwenFormat().parse("Let me compute.\n" + text)
    assert p.kind == "tool" and p.calls == (ToolCall(*expect),)


def test_qwen_format_reads_several_calls_in_order_and_names_what_is_malformed():
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    assert [c.name for c in QwenFormat().parse(two).calls] == ["a", "b"]
    bad = QwenFormat().parse('<tool_call>{"name": "a", "arguments": {}</tool_call>')
    assert bad.kind == "invalid" and "tool call 1 is malformed: not JSON" in bad.error
    assert "not JSON" in QwenFormat().invalid_message(bad)
    assert 'no "name"' in QwenFormat().parse('<tool_call>{"arguments": {}}</tool_call>').error
    assert "must be an object" in QwenFormat().parse('<tool_call>{"name": "a", "arguments": [1]}</tool_call>').error
    assert "not closed" in QwenFormat().parse('<tool_call>{"name": "a"').error
    assert QwenFormat().parse("The answer is 7.") == Parsed(answer="The answer is 7.")
    tagged = QwenFormat(answer_tag="answer")
    assert tagged.stop == ("</answer>",)
    assert tagged.parse("so <answer> 7 </answer>") == Parsed(answer="7") and tagged.parse("so 7").kind == "invalid"


def test_tools_reach_the_chat_template_as_json_schemas(chat_tok):
    text = chat_prompt(chat_tok, "What is 2**10?", tools=[Card])
    schema = tool_schemas([Card])[0]
    assert schema == {
        "type": "function",
        "function": {"name": "python", "description": Card.description, "parameters": Card.parameters},
    }
    assert "<tools>\n" + json.dumps(schema) + "\n</tools>" in text  # plain JSON: no HTML escaping of < > &
    assert text.endswith("<|im_start|>user\nWhat is 2**10?<|im_end|>\n<|im_start|>assistant\n")
    assert "# Tools" not in chat_prompt(chat_tok, "hi")  # no tools: the template's plain system-less prompt


def test_tool_results_are_rendered_by_the_chat_template_after_the_turn_end(chat_tok):
    calls = [ToolCall("python", {"code": "print(1)"}), ToolCall("python", {"code": "1/0"})]
    results = [ToolResult(calls[0], "1\n"), ToolResult(calls[1], error="ZeroDivisionError: division by zero")]
    want = (
        "\n<|im_start|>user\n<tool_response>\n1\n\n</tool_response>\n<tool_response>\nerror: ZeroDivisionError: "
        "division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # the turn ended with its end-of-turn token (already in the trajectory): what follows it
    assert QwenFormat().render(results, turn_end="<|im_end|>", chat_template=True, tokenizer=chat_tok) == want
    # a turn cut before its end token: the template's turn end comes first
    assert (
        chat_tool_turn(chat_tok, ["x"], "")
        == "<|im_end|>\n<|im_start|>user\n<tool_response>\nx\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    plain = QwenFormat().render(results)
    assert (
        plain
        == "\n<tool_response>\n1\n\n</tool_response>\n<tool_response>\nerror: ZeroDivisionError: division by zero\n</tool_response>\n"
    )
