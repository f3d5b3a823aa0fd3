"""Rule scorers, chosen by a row's `data_source`: fn(solution_str, ground_truth, extra_info) -> float.

Every scorer returns 1.0 for a correct answer and 0.0 otherwise; a malformed *response* scores 0.0,
a malformed *ground truth* raises ValueError (that is a data bug, not a model mistake).

- `openai/gsm8k`: verl's semantics. Strict by default: the answer is the number after the last
  `#### ` (only the last 300 characters are searched, as in verl); `extra_info["gsm8k_method"] =
  "flexible"` falls back to the last number in the response. Unlike verl, the comparison is
  numeric ("18.0" matches "18"), not string equality.
- math (`math`, `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`): math-verify's `parse` +
  `verify`. Its signal-based timeouts are disabled (signals only work in the main thread);
  `RewardManager` applies the timeout instead. An exception of math-verify's is not turned into a
  score: `RewardManager` counts it in `reward/errors` (the item scores 0) and logs the first.
- `arithmetic`: the first integer in the response equals the ground truth.
- `countdown`: the last `<answer>...</answer>` (else the last line) is an expression over the given
  numbers, each used at most once, with only + - * / and parentheses; it is parsed with `ast` and
  evaluated exactly with fractions, never with `eval`.
"""

from __future__ import annotations

import ast
import json
import re
from fractions import Fraction

from megarl.registry import Registry

RULE_SCORERS = Registry("rule scorer (data_source)")

_GSM8K_CLIP_CHARS = 300


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict | None = None) -> float | dict:
    """The common scoring signature: the rule scorer registered for `data_source`."""
    return RULE_SCORERS.get(data_source)(solution_str, ground_truth, extra_info)


def _to_float(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", ""))
    except ValueError:
        return None


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer text after the last `#### ` (strict); flexible falls back to the last number."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-_GSM8K_CLIP_CHARS:]  # regexes on very long responses are slow (verl does this too)
    marked = re.findall(r"#### (\-?[0-9\.\,]+)", tail)
    if marked:
        return marked[-1]
    if method == "flexible":
        numbers = [n for n in re.findall(r"\-?[0-9\.\,]+", tail) if n not in ("", ".", ",", "-")]
        return numbers[-1] if numbers else None
    return None


@RULE_SCORERS.register("openai/gsm8k")
def gsm8k_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    method = (extra_info or {}).get("gsm8k_method") or "strict"
    expected = _to_float(ground_truth)
    if expected is None:
        raise ValueError(f"gsm8k ground_truth must be a number, got {ground_truth!r}")
    answer = extract_gsm8k_answer(solution_str, method)
    value = None if answer is None else _to_float(answer)
    return 1.0 if value is not None and abs(value - expected) < 1e-6 else 0.0


def math_verify_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    try:
        from math_verify import parse, verify  # imported lazily: sympy is slow to import
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("the math rule scorer needs math-verify: make install (or pip install math-verify)") \
            from error

    gold_text = ground_truth if "$" in ground_truth or "\\boxed" in ground_truth else f"${ground_truth}$"
    gold = parse(gold_text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math ground_truth {ground_truth!r} cannot be parsed")
    answer = parse(solution_str, parsing_timeout=None)  # a response with nothing to parse is a wrong answer
    return 1.0 if answer and verify(gold, answer, timeout_seconds=None) else 0.0


for _source in ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"):
    RULE_SCORERS.register(_source)(math_verify_score)


@RULE_SCORERS.register("arithmetic")
def arithmetic_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    expected = int(ground_truth)
    match = re.search(r"-?\d+", solution_str)
    return 1.0 if match is not None and int(match.group()) == expected else 0.0


_COUNTDOWN_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an expression tree of integer literals and + - * /; ValueError otherwise."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _COUNTDOWN_OPERATORS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _COUNTDOWN_OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, used)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"forbidden syntax {type(node).__name__}")


def evaluate_countdown_expression(expression: str, numbers: list[int]) -> Fraction | None:
    """The exact value of `expression`, or None if it is not a valid countdown answer."""
    if len(expression) > 1000:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        used: list[int] = []
        value = _evaluate(tree, used)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    available = list(numbers)
    for number in used:  # each given number at most once
        if number not in available:
            return None
        available.remove(number)
    return value


def extract_countdown_answer(solution_str: str) -> str:
    """The text in the last <answer>...</answer>, else the response's last non-empty line."""
    answers = re.findall(r"<answer>(.*?)</answer>", solution_str, flags=re.DOTALL)
    if answers:
        return answers[-1].strip()
    lines = [line.strip() for line in solution_str.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@RULE_SCORERS.register("countdown")
def countdown_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    try:
        task = json.loads(ground_truth)
        target, numbers = int(task["target"]), [int(n) for n in task["numbers"]]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"countdown ground_truth must be JSON {{'target': int, 'numbers': [int]}}, "
                         f"got {ground_truth!r}") from exc
    value = evaluate_countdown_expression(extract_countdown_answer(solution_str), numbers)
    return 1.0 if value is not None and value == target else 0.0
