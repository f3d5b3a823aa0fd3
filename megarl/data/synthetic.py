"""Synthetic RL tasks with rule rewards, written as train/test parquet files in the common layout.

- arithmetic: "a+b=" with a, b in [0, max_operand]; the answer is the sum (data_source
  "arithmetic"). Small models learn it within a few RL steps, which makes it a good smoke test.
  With `trailing_dots` (`LongTail`), each row's warm-start target (extra_info["answer"]) is the sum, then
  a run of dots of log-normal length: a model warm-started on it writes responses whose lengths have a
  long tail, as reasoning runs' do (the workload where asynchronous RL pays; `bench/async_vs_sync.py --task
  long-tail`). The dots come after the answer, which the reward reads (the first integer), so that a tiny
  model learns the task as it learns the quick start's, and RL leaves the lengths' tail as it is.
- countdown: reach a target from 3-4 numbers in [1, 50] with + - * / and parentheses, using each
  number at most once (data_source "countdown"). The target is built by folding the numbers with
  random operations, so it is always reachable; the folding expression is kept in
  extra_info["solution"].
- multiplication: "a*b" with a, b in [10, max_operand], as a chat message; the answer is the product
  (data_source "arithmetic": the first number of the last assistant turn must be it). The agent quick
  start's task: a tiny model cannot multiply reliably, but can with the calculator tool. Each row's
  extra_info["turns"] is a supervised warm start's target as chat messages, which SFT renders with the
  model's chat template and the run's tools (`megarl.trainer.sft`): for a `tool_share` of the rows the
  tool-use trace (a calculator call, its result, the answer), for the others the answer alone.

Train and test never share a question. Generation is deterministic in `seed`.

    python -m megarl.data.synthetic --task arithmetic --out-dir data/arithmetic --num-train 2000 --num-test 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from megarl.data.dataset import write_rows

COUNTDOWN_INSTRUCTION = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and parentheses, and each number at most once. Show your work in <think> </think> "
    "tags, and return the final equation in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)


def _row(content: str, data_source: str, ability: str, ground_truth: str, extra_info: dict) -> dict:
    return {
        "prompt": [{"role": "user", "content": content}],
        "data_source": data_source,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }


def _write_split(rows: list[dict], num_test: int, out_dir: str | Path) -> tuple[str, str]:
    """The first `num_test` rows are the test split, the rest train; both get split and index."""
    splits = {"train": rows[num_test:], "test": rows[:num_test]}
    paths = []
    for split, split_rows in splits.items():
        for index, row in enumerate(split_rows):
            row["extra_info"] = {"split": split, "index": index, **row["extra_info"]}
        paths.append(str(write_rows(split_rows, Path(out_dir) / f"{split}.parquet")))
    return paths[0], paths[1]


def _check_counts(num_train: int, num_test: int) -> None:
    if num_train < 1 or num_test < 1:
        raise ValueError(f"num_train and num_test must be at least 1, got {num_train} and {num_test}")


@dataclass(frozen=True)
class LongTail:
    """Lengths exp(N(log(median), sigma^2)) rounded, at most `cap`."""

    median: float
    sigma: float = 1.0
    cap: int = 200

    def draw(self, rng: random.Random) -> int:
        return min(self.cap, round(rng.lognormvariate(math.log(self.median), self.sigma)))


def make_arithmetic(num_train: int, num_test: int, seed: int, max_operand: int = 499, *,
                    trailing_dots: LongTail | None = None, out_dir: str | Path) -> tuple[str, str]:
    """Write `a+b=` tasks to out_dir/{train,test}.parquet; returns (train_path, test_path). `trailing_dots`:
    warm-start targets of the sum followed by that many dots."""
    _check_counts(num_train, num_test)
    num_pairs = (max_operand + 1) ** 2
    if num_train + num_test > num_pairs:
        raise ValueError(f"max_operand={max_operand} gives only {num_pairs} distinct questions, "
                         f"{num_train + num_test} requested")
    # Sampling distinct (a, b) pairs without replacement keeps train and test disjoint.
    rng = random.Random(seed)
    pairs = rng.sample(range(num_pairs), num_train + num_test)
    rows = []
    for pair in pairs:
        a, b = divmod(pair, max_operand + 1)
        extra = {"answer": f"{a + b} " + "." * trailing_dots.draw(rng)} if trailing_dots is not None else {}
        rows.append(_row(f"{a}+{b}=", "arithmetic", "arithmetic", str(a + b), extra))
    return _write_split(rows, num_test, out_dir)


def _countdown_task(rng: random.Random) -> tuple[list[int], int, str]:
    """(numbers, target, an expression reaching target) with every intermediate a positive integer."""
    numbers = [rng.randint(1, 50) for _ in range(rng.choice((3, 4)))]
    order = rng.sample(numbers, len(numbers))
    value, expression = order[0], str(order[0])
    for x in order[1:]:
        operators = ["+"]
        operators += ["-"] if value > x else []
        operators += ["*"] if value * x <= 1000 else []  # keep targets in a range models can reach
        operators += ["/"] if value % x == 0 else []
        operator = rng.choice(operators)
        value = {"+": value + x, "-": value - x, "*": value * x, "/": value // x}[operator]
        expression = f"({expression} {operator} {x})"
    return numbers, value, expression[1:-1]


def make_countdown(num_train: int, num_test: int, seed: int, out_dir: str | Path) -> tuple[str, str]:
    """Write countdown tasks to out_dir/{train,test}.parquet; returns (train_path, test_path)."""
    _check_counts(num_train, num_test)
    rng = random.Random(seed)
    seen: set[tuple] = set()
    rows = []
    for _ in range(20 * (num_train + num_test)):
        if len(rows) == num_train + num_test:
            break
        numbers, target, expression = _countdown_task(rng)
        question = (tuple(sorted(numbers)), target)
        if question in seen:
            continue
        seen.add(question)
        content = COUNTDOWN_INSTRUCTION.format(numbers=numbers, target=target)
        ground_truth = json.dumps({"target": target, "numbers": numbers})
        rows.append(_row(content, "countdown", "math", ground_truth, {"solution": expression}))
    if len(rows) < num_train + num_test:
        raise ValueError(f"could only generate {len(rows)} distinct countdown tasks, "
                         f"{num_train + num_test} requested")
    return _write_split(rows, num_test, out_dir)


def make_multiplication(num_train: int, num_test: int, seed: int, tool_share: float, max_operand: int = 99, *,
                        out_dir: str | Path) -> tuple[str, str]:
    """Write "a*b" tasks with warm-start targets (see the module docstring) to out_dir/{train,test}.parquet."""
    _check_counts(num_train, num_test)
    operands = range(10, max_operand + 1)
    if num_train + num_test > len(operands) ** 2:
        raise ValueError(f"max_operand={max_operand} gives only {len(operands) ** 2} distinct questions, "
                         f"{num_train + num_test} requested")
    rng = random.Random(seed)
    rows = []
    for pair in rng.sample(range(len(operands) ** 2), num_train + num_test):
        a, b = (operands[k] for k in divmod(pair, len(operands)))
        trace = _tool_trace(a, b) if rng.random() < tool_share else []
        turns = trace + [{"role": "assistant", "content": str(a * b)}]
        rows.append(_row(f"{a}*{b}", "arithmetic", "arithmetic", str(a * b), {"turns": turns}))
    return _write_split(rows, num_test, out_dir)


def _tool_trace(a: int, b: int) -> list[dict]:
    """A calculator call (the Hermes/Qwen <tool_call> convention of megarl.agent) and its result."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}, separators=(",", ":"))
    return [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "name": "calculator", "content": str(a * b)}]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["arithmetic", "countdown", "multiplication"], required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, help="arithmetic (default 499) and multiplication (default 99)")
    parser.add_argument("--dots-median", type=float, help="arithmetic: warm-start targets follow the sum with a "
                        "log-normal number of dots of this median")
    parser.add_argument("--dots-sigma", type=float, default=1.0, help="arithmetic: the log-normal's sigma")
    parser.add_argument("--dots-max", type=int, default=200, help="arithmetic: at most this many dots")
    parser.add_argument("--tool-share", type=float, default=0.5, help="multiplication: share of warm-start targets "
                        "that use the calculator")
    args = parser.parse_args(argv)
    if args.task == "arithmetic":
        dots = LongTail(args.dots_median, args.dots_sigma, args.dots_max) if args.dots_median else None
        paths = make_arithmetic(args.num_train, args.num_test, args.seed, args.max_operand or 499, trailing_dots=dots,
                                out_dir=args.out_dir)
    elif args.task == "multiplication":
        paths = make_multiplication(args.num_train, args.num_test, args.seed, args.tool_share, args.max_operand or 99,
                                    out_dir=args.out_dir)
    else:
        paths = make_countdown(args.num_train, args.num_test, args.seed, args.out_dir)
    print(f"wrote {paths[0]} ({args.num_train} rows) and {paths[1]} ({args.num_test} rows)")


if __name__ == "__main__":
    main()
