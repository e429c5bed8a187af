"""The calculator tool: values, precedence, formatting, and every refusal as a ToolError the policy reads."""

import asyncio
import time

import pytest

from asyncrl.agent.tools.base import ToolError
from asyncrl.agent.tools.calculator import MAX_EXPRESSION_CHARS, CalculatorTool, evaluate, format_number


def calc(expression):
    return asyncio.run(CalculatorTool().call({"expression": expression}, timeout_s=1.0))


@pytest.mark.parametrize(
    "expression, text",
    [
        ("1 + 2", "3"),
        ("2 + 3 * 4", "14"),  # * before +
        ("(2 + 3) * 4", "20"),
        ("2 ** 3 ** 2", "512"),  # ** is right-associative
        ("-2 ** 2", "-4"),  # unary minus binds looser than **
        ("(-2) ** 2", "4"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("7 / 2", "3.5"),
        ("10 / 2", "5"),  # an integral float prints as an integer
        ("1 / 3", "0.333333"),
        ("2 ** 0.5", "1.414214"),
        ("2 ** -2", "0.25"),
        ("1e-9 * 1", "1e-09"),
        ("1e20 + 1", "1e+20"),
        ("0.1 + 0.2", "0.3"),
        ("-0.0", "0"),
        ("+5 - -5", "10"),
        ("2 ** 100", "1267650600228229401496703205376"),
        (" 12 * (3 + 4) ", "84"),
    ],
)
def test_values_and_precedence(expression, text):
    assert calc(expression) == text


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("x + 1", "names are not allowed ('x')"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("1 / 0", "division by zero"),
        ("5 // 0", "division by zero"),
        ("5 % 0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 10000000", "exponent"),
        ("10 ** 5000", "bits"),
        ("9 ** 9 ** 9", "exponent"),
        ("(2 ** 4000) * (2 ** 4000)", "bits"),
        ("10.0 ** 400", "too large for a float"),
        ("1e308 * 10", "too large for a float"),
        ("(-8) ** 0.5", "complex"),
        ("2 ^ 3", "operator ^ is not supported (use ** for powers)"),
        ("1 < 2", "Compare is not arithmetic"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 +", "invalid syntax"),
        ("", "invalid syntax"),
        pytest.param("(" * 400 + "1" + ")" * 400, "cannot evaluate", id="nested-400"),  # never a crash
    ],
)
def test_refusals_name_the_reason(expression, reason):
    with pytest.raises(ToolError) as err:
        calc(expression)
    assert str(err.value).startswith("cannot evaluate: ")
    assert reason in str(err.value)


def test_long_input_is_refused_before_parsing():
    text = "1+" * MAX_EXPRESSION_CHARS + "1"
    start = time.monotonic()
    with pytest.raises(ToolError, match=f"at most {MAX_EXPRESSION_CHARS}"):
        calc(text)
    assert time.monotonic() - start < 1.0


def test_bounded_work_is_fast():
    """The biggest refusals are decided before computing: none takes long."""
    start = time.monotonic()
    for expression in ["2 ** 10000", "99999 ** 9999", "(10 ** 1000) ** 1000", "1.0000001 ** 10000"]:
        try:
            evaluate(expression)
        except ToolError:
            pass
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("arguments", [{}, {"expression": 3}, {"expr": "1+1"}, None])
def test_bad_arguments_name_the_field(arguments):
    with pytest.raises(ToolError, match="'expression' must be a string"):
        asyncio.run(CalculatorTool().call(arguments, timeout_s=1.0))


def test_format_number():
    assert format_number(3) == "3"
    assert format_number(-2.5) == "-2.5"
    assert format_number(0.9999999) == "1"
    assert format_number(123456.7) == "123456.7"
    assert format_number(1e15) == "1e+15"


def test_the_tool_describes_itself():
    tool = CalculatorTool()
    assert tool.name == "calculator"
    assert tool.parameters["required"] == ["expression"]
    assert tool.parameters["properties"]["expression"]["type"] == "string"
    asyncio.run(tool.close())
