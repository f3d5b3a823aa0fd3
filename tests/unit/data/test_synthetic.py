"""Synthetic arithmetic and countdown tasks: valid layout, disjoint splits, rewardable answers, long tails."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from megarl.data import load_rows
from megarl.data.synthetic import LongTail, main, make_arithmetic, make_countdown
from megarl.rewards import compute_score


def question(row):
    return row["prompt"][0]["content"]


def test_arithmetic(tmp_path):
    train_path, test_path = make_arithmetic(200, 50, seed=1, max_operand=20, out_dir=tmp_path)
    train, test = load_rows([train_path]), load_rows([test_path])
    assert (len(train), len(test)) == (200, 50)
    assert not {question(r) for r in train} & {question(r) for r in test}
    assert len({question(r) for r in train}) == 200
    for r in train + test:
        a, b = map(int, question(r).removesuffix("=").split("+"))
        assert 0 <= a <= 20 and 0 <= b <= 20 and r["reward_model"]["ground_truth"] == str(a + b)
        assert compute_score(r["data_source"], str(a + b), r["reward_model"]["ground_truth"]) == 1.0
        assert compute_score(r["data_source"], str(a + b + 1), r["reward_model"]["ground_truth"]) == 0.0
    assert test[3]["extra_info"] == {"split": "test", "index": 3}
    assert load_rows([make_arithmetic(200, 50, seed=1, max_operand=20, out_dir=tmp_path / "again")[0]]) == train


def test_arithmetic_trailing_dots(tmp_path):
    """The long-tailed warm start's targets: the rewarded sum, then dots as many as the log-normal draws."""
    train_path, _ = make_arithmetic(2000, 10, seed=0, trailing_dots=LongTail(12, 1.3, 400), out_dir=tmp_path)
    dots = []
    for r in load_rows([train_path]):
        answer, ground_truth = r["extra_info"]["answer"], r["reward_model"]["ground_truth"]
        assert answer.startswith(f"{ground_truth} ") and set(answer[len(ground_truth) + 1:]) <= {"."}
        assert compute_score(r["data_source"], answer, ground_truth) == 1.0
        dots.append(len(answer) - len(ground_truth) - 1)
    assert max(dots) <= 400 and 10 <= statistics.median(dots) <= 14
    assert 0.05 < sum(n > 64 for n in dots) / len(dots) < 0.15  # P(N(0, 1.3) > log(64 / 12)) = 0.099


def test_arithmetic_too_many_requested(tmp_path):
    with pytest.raises(ValueError, match="only 9 distinct questions"):
        make_arithmetic(8, 2, seed=0, max_operand=2, out_dir=tmp_path)


def test_countdown(tmp_path):
    train_path, test_path = make_countdown(100, 20, seed=2, out_dir=tmp_path)
    train, test = load_rows([train_path]), load_rows([test_path])
    key = lambda r: json.dumps(sorted(json.loads(r["reward_model"]["ground_truth"]).items()))  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    for r in train + test:
        task = json.loads(r["reward_model"]["ground_truth"])
        assert 3 <= len(task["numbers"]) <= 4 and all(1 <= n <= 50 for n in task["numbers"])
        assert str(task["target"]) in question(r) and "<answer>" in question(r)
        answer = f"<think>...</think> <answer>{r['extra_info']['solution']}</answer>"
        assert compute_score("countdown", answer, r["reward_model"]["ground_truth"]) == 1.0
        assert compute_score("countdown", "<answer>0</answer>", r["reward_model"]["ground_truth"]) == 0.0


def test_cli(tmp_path, capsys):
    main(["--task", "countdown", "--out-dir", str(tmp_path), "--num-train", "5", "--num-test", "2", "--seed", "0"])
    assert "(5 rows)" in capsys.readouterr().out
    assert len(load_rows([str(tmp_path / "test.parquet")])) == 2


def test_module_entry_point(tmp_path):
    command = [sys.executable, "-m", "megarl.data.synthetic", "--task", "arithmetic", "--out-dir", str(tmp_path),
               "--num-train", "6", "--num-test", "3", "--seed", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert len(load_rows([str(tmp_path / "train.parquet")])) == 6
