"""Arithmetic on a string without running it: the expression is parsed with `ast` and only numbers,
parentheses and + - * / // % ** are evaluated. Powers whose result would exceed `MAX_BITS` bits are
refused before they are computed (`9**9**9` would otherwise hold a core for minutes), and so is any
intermediate integer over `MAX_BITS` bits, which keeps every later operation cheap."""

from __future__ import annotations

import ast
import math
import operator

MAX_BITS = 4096
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError saying what is not allowed."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as exc:
            raise ValueError(str(exc)) from None
        if isinstance(result, int) and result.bit_length() > MAX_BITS:  # bounds every later operation
            raise ValueError(f"an intermediate result is too large (over {MAX_BITS} bits)")
        return result
    raise ValueError(f"{type(node).__name__} is not allowed: only numbers, parentheses and + - * / // % **")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(base) > 1 and exponent > 0 and exponent * math.log2(abs(base)) > MAX_BITS:
        raise ValueError(f"{base} ** {exponent} is too large (over {MAX_BITS} bits)")
