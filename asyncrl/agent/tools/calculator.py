"""``CalculatorTool``: arithmetic on numbers, evaluated in process over ``ast`` (never ``eval``).

Contract: ``call({"expression": "3 * (4 + 5) ** 2"}, timeout_s=...)`` returns the value as text (``"243"``), or raises
``ToolError("cannot evaluate: ...")`` naming what is wrong. Allowed: int and float literals, ``+ - * / // % **``,
unary ``-`` and ``+``, parentheses; nothing else (no names, calls, strings, comparisons). Bounded so that no
expression can take long or take much memory: the text is at most ``MAX_EXPRESSION_CHARS``, an integer (a literal, an
intermediate or the result) at most ``MAX_INT_BITS`` bits, ``|exponent|`` at most ``MAX_EXPONENT``; a float that
overflows is an error too. Pure: ``evaluate`` and ``format_number`` hold the logic, the tool only checks arguments.

Output format: an integer as an integer (``7 // 2`` -> ``3``); a float rounded to 6 decimal places with trailing zeros
dropped (``7 / 2`` -> ``3.5``, ``1 / 3`` -> ``0.333333``, ``10 / 2`` -> ``5``); a float below 1e-6 or from 1e15 on in
scientific notation with 6 significant digits (``1e-9`` -> ``1e-09``).

    tool = CalculatorTool()
    await tool.call({"expression": "(2 + 3) * 4 / 8"}, timeout_s=1.0)   # "2.5"
    evaluate("2 ** 10")                                                 # 1024
"""

from __future__ import annotations

import ast
import math
import operator

from asyncrl.agent.tools.base import ToolError

MAX_EXPRESSION_CHARS = 1000  # an arithmetic expression a model writes is a line; longer is not arithmetic
MAX_INT_BITS = 4096  # ~1233 decimal digits: any real arithmetic answer, and a multiply of two stays microseconds
MAX_EXPONENT = 10_000  # 2 ** 4096 is already at MAX_INT_BITS; a bigger exponent only makes sense for floats near 1

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOL = {ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@"}


class _Refused(ValueError):
    """What makes an expression not evaluable; the message follows 'cannot evaluate: '."""


def _check_size(value: int | float) -> int | float:
    if isinstance(value, complex):
        raise _Refused("the result is a complex number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _Refused(f"a number has more than {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused("the result is too large for a float")
    return value


def _check_operands(op: ast.operator, left: int | float, right: int | float) -> None:
    """Refuse before computing what would be too big (pow and multiply grow without bound)."""
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise _Refused(f"exponent {right:.6g} is larger than {MAX_EXPONENT}")
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if (abs(left).bit_length() - 1) * right > MAX_INT_BITS:
                raise _Refused(f"{left} ** {right} has more than {MAX_INT_BITS} bits")
    if isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
            raise _Refused(f"the product has more than {MAX_INT_BITS} bits")


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass: refused too
            raise _Refused(f"only numbers are allowed, not {node.value!r:.40}")
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            sym = _SYMBOL.get(type(node.op), type(node.op).__name__)
            hint = " (use ** for powers)" if sym == "^" else ""
            raise _Refused(f"operator {sym} is not supported{hint}")
        left, right = _eval(node.left), _eval(node.right)
        _check_operands(node.op, left, right)
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise _Refused("division by zero") from None
        except OverflowError:
            raise _Refused("the result is too large for a float") from None
    if isinstance(node, ast.Name):
        raise _Refused(f"names are not allowed ({node.id!r})")
    if isinstance(node, ast.Call):
        raise _Refused("function calls are not allowed")
    raise _Refused(f"{type(node).__name__} is not arithmetic")


def evaluate(expression: str) -> int | float:
    """The value of ``expression``; ToolError('cannot evaluate: <reason>') when it is not bounded arithmetic."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(
            f"cannot evaluate: the expression has {len(expression)} characters, at most {MAX_EXPRESSION_CHARS}"
        )
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _eval(tree)
    except _Refused as exc:
        raise ToolError(f"cannot evaluate: {exc}") from None
    except SyntaxError as exc:
        raise ToolError(f"cannot evaluate: invalid syntax ({exc.msg})") from None
    except (RecursionError, MemoryError):  # parentheses nested hundreds deep
        raise ToolError("cannot evaluate: the expression is nested too deeply") from None


def format_number(value: int | float) -> str:
    """An int as is; a float to 6 decimal places without trailing zeros, scientific outside [1e-6, 1e15)."""
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"
    if 1e-6 <= abs(value) < 1e15:
        return f"{value:.6f}".rstrip("0").rstrip(".")
    return f"{value:.6g}"


class CalculatorTool:
    """Bounded arithmetic in process (see the module docstring); cheap, so no concurrency bound."""

    name = "calculator"
    description = (
        "Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses. Returns the value as text."
    )
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3 / 2"}},
        "required": ["expression"],
    }

    async def call(self, arguments: dict, *, timeout_s: float) -> str:
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        if not isinstance(expression, str):
            raise ToolError(f"calculator: argument 'expression' must be a string, got {type(expression).__name__}")
        return format_number(evaluate(expression))

    async def close(self) -> None:
        return None
