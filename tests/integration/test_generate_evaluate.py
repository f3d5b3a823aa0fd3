"""launchers/generate.py then launchers/evaluate.py on a tiny HF model, one process each; and on a
checkpoint of a real training run (2 processes), where they reproduce the trainer's last validation.

A random tiny model never solves arithmetic, so all steps score with the parity reward of
tests/integration/user_reward.py, which gives 0 or 1 depending on the response text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlflow
import pyarrow.parquet as pq
import pytest

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, torchrun

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


def _last_logged(run_dir, experiment: str, metric: str) -> float:
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0]
    return max(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step).value


def test_generate_on_a_checkpoint_reproduces_the_trainers_validation(tiny_models, tmp_path):
    # Greedy responses of these tiny models repeat one character, whose parity the reward then scores:
    # an odd response length keeps the scores varied. The learning rate makes the last step change the
    # validation score, so a validation of stale weights (those the step started from) fails here.
    # The seed picks such a run: val/score/mean 0.6875 after step 1, 0.5 after step 2 (with seed 1
    # every response of step 2 is "<<<<<", all scoring 0).
    train, test = make_arithmetic(8, 16, seed=0, out_dir=tmp_path / "data")
    lengths = {"max_prompt_length": 16, "max_response_length": 5}  # the same for validation and generate.py
    reward_file, _ = REWARD.split(":")
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                              f"model.path={tiny_models['qwen2-tied']}", f"data.train_files=[{train}]",
                              f"data.val_files=[{test}]", "data.apply_chat_template=false",
                              *(f"data.{key}={value}" for key, value in lengths.items()),
                              f"trainer.output_dir={tmp_path}", f"trainer.checkpoint_dir={tmp_path}/ckpt",
                              "trainer.total_steps=2", "trainer.save_freq=2", "trainer.test_freq=0",
                              "trainer.val_before_train=false", "data.train_batch_size=4", "rollout.n=2",
                              "actor.ppo_mini_batch_size=2", "actor.optim.lr=3e-3", "trainer.seed=2",
                              f"reward.custom_function_path={reward_file}"))
    validated = _last_logged(tmp_path / "quickstart_grpo", "quickstart_grpo", "val/score/mean")

    generations = tmp_path / "generations.jsonl"  # generate.py's defaults are validation's: greedy, one sample
    flags = [arg for key, value in lengths.items() for arg in (f"--{key.replace('_', '-')}", value)]
    checkpoint = tmp_path / "ckpt/quickstart_grpo/global_step_2"
    assert_succeeded(torchrun(2, ROOT / "launchers/generate.py", "--model", checkpoint, "--data", test,
                              "--output", generations, "--no-apply-chat-template", *flags, "--reward-function", REWARD))
    mean = _evaluate(generations, tmp_path)["all"]["mean@1"]
    assert 0 < mean < 1  # the scores vary, so equal means say the responses are the same
    assert mean == validated


def test_evaluate_names_a_missing_column(tmp_path):
    generations = tmp_path / "bad.jsonl"
    generations.write_text(json.dumps({"data_source": "arithmetic", "ground_truth": "3", "index": 0}) + "\n")
    result = _run("launchers/evaluate.py", generations)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == f"megarl: {generations}: row 0 lacks response " \
                                                     "(write it with launchers/generate.py)"


def test_generate_names_a_model_that_is_neither_hf_nor_a_checkpoint(tmp_path):
    result = _run("launchers/generate.py", "--model", tmp_path, "--data", tmp_path / "test.parquet",
                  "--output", tmp_path / "out.jsonl", "--backend", "hf")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"megarl: --model {tmp_path}: expected a HuggingFace model directory (with config.json) or a megarl "
        "checkpoint (global_step_N with an actor); not a checkpoint: no manifest.json (the save did not finish)")
