"""launchers/generate.py then launchers/evaluate.py on a tiny model, one process each.

A random tiny model never solves arithmetic, so both steps score with the parity reward of
tests/integration/user_reward.py, which gives 0 or 1 depending on the response text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded

REWARD = f"{ROOT / 'tests/integration/user_reward.py'}:compute_score"


def _run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))


def _evaluate(generations, tmp_path) -> dict:
    table_file = tmp_path / f"{generations.stem}.json"
    result = _run("launchers/evaluate.py", generations, "--reward-function", REWARD, "--json", table_file)
    assert_succeeded(result)
    return json.loads(table_file.read_text())


def test_generate_then_evaluate(tiny_models, tmp_path):
    _, test = make_arithmetic(8, 6, seed=0, out_dir=tmp_path / "data")
    common = ["--model", tiny_models["qwen2-tied"], "--data", test, "--max-response-length", 8,
              "--reward-function", REWARD]

    greedy = tmp_path / "greedy.jsonl"  # the trainer's validation defaults: greedy, one sample
    assert_succeeded(_run("launchers/generate.py", *common, "--output", greedy, "--backend", "vllm"))
    rows = [json.loads(line) for line in greedy.read_text().splitlines()]
    assert len(rows) == 6 and {"data_source", "prompt", "response", "ground_truth", "score"} <= set(rows[0])
    table = _evaluate(greedy, tmp_path)
    assert 0 < table["all"]["mean@1"] < 1  # the scores vary, so the comparisons below mean something
    assert table["all"]["mean@1"] == pytest.approx(sum(row["score"] for row in rows) / len(rows))
    assert table["arithmetic"]["prompts"] == 6 and table["all"]["pass@1"] >= table["all"]["mean@1"]

    sampled = tmp_path / "sampled.parquet"
    assert_succeeded(_run("launchers/generate.py", *common, "--output", sampled, "--backend", "hf",
                          "-n", 4, "--temperature", 1.0))
    scores = pq.read_table(sampled).column("score").to_pylist()
    table = _evaluate(sampled, tmp_path)
    assert len(scores) == 24 and table["all"]["mean@4"] == pytest.approx(sum(scores) / len(scores))
    assert table["arithmetic"]["pass@4"] >= table["arithmetic"]["mean@4"]


def test_evaluate_names_a_missing_column(tmp_path):
    generations = tmp_path / "bad.jsonl"
    generations.write_text(json.dumps({"data_source": "arithmetic", "ground_truth": "3", "index": 0}) + "\n")
    result = _run("launchers/evaluate.py", generations)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == f"megarl: {generations}: row 0 lacks response " \
                                                     "(write it with launchers/generate.py)"
