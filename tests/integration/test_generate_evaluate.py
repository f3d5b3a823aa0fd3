"""launchers/generate.py then launchers/evaluate.py on a tiny HF model (one process each); and around a
real training run (2 processes) from an SFT'd model whose tokenizer prepends BOS, where they reproduce
the trainer's validation before training (the SFT'd model) and after it (the run's checkpoint).

A tiny model never solves arithmetic after a few steps, so all steps score with the parity reward of
tests/integration/user_reward.py, which gives 0 or 1 depending on the response text; the test
recomputes it from the written responses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict

import mlflow
import pyarrow.parquet as pq
import pytest

import make_tiny_model
from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, torchrun

REWARD = f"{ROOT / 'tests/integration/user_reward.py'}:compute_score"
ENVIRONMENT = f"{ROOT / 'tests/integration/user_environment.py'}:AnswerEveryTurn"


def _run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))


def _load_evaluate():
    """launchers/evaluate.py as a module, to run in this process: one launch less per table (its command
    line's error path runs in a process of its own: test_evaluate_names_a_missing_column)."""
    spec = importlib.util.spec_from_file_location("evaluate", ROOT / "launchers/evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    return evaluate


evaluate = _load_evaluate()


def _evaluate(generations, tmp_path) -> dict:
    """The table evaluate.py writes with --json."""
    table_file = tmp_path / f"{generations.stem}.json"
    evaluate.main([str(generations), f"reward.function={REWARD}", "--json", str(table_file)])
    return json.loads(table_file.read_text())


def _parity(response: str) -> float:
    """user_reward.py's score, written out again."""
    return float(sum(map(ord, response)) % 2)


def _expected_table(rows: list[dict]) -> tuple[float, float]:
    """mean@k and pass@k of generated rows, from their response texts."""
    by_prompt = defaultdict(list)
    for row in rows:
        by_prompt[row["index"]].append(_parity(row["response"]))
    scores = [score for group in by_prompt.values() for score in group]
    return sum(scores) / len(scores), sum(max(group) >= 1.0 for group in by_prompt.values()) / len(by_prompt)


def test_generate_then_evaluate_samples(tiny_models, tmp_path):
    _, test = make_arithmetic(8, 6, seed=0, out_dir=tmp_path / "data")
    sampled = tmp_path / "sampled.parquet"
    assert_succeeded(_run("launchers/generate.py", "--output", sampled, f"model.path={tiny_models['qwen2-tied']}",
                          f"data.val_files=[{test}]", "data.max_response_length=8", f"reward.function={REWARD}",
                          "rollout.backend=hf", "rollout.val_n=4", "rollout.val_temperature=1.0"))
    rows = pq.read_table(sampled).to_pylist()
    assert len(rows) == 24 and sorted(row["index"] for row in rows) == sorted(list(range(6)) * 4)
    assert [row["score"] for row in rows] == [_parity(row["response"]) for row in rows]
    mean, pass_at_4 = _expected_table(rows)
    assert 0 < mean < 1 and pass_at_4 > mean  # some prompt has mixed samples, so the two differ
    table = _evaluate(sampled, tmp_path)
    assert table["all"]["mean@4"] == pytest.approx(mean) and table["all"]["pass@4"] == pytest.approx(pass_at_4)
    assert table["arithmetic"]["prompts"] == 6 and table["arithmetic"]["pass@4"] == pytest.approx(pass_at_4)


def test_generate_writes_trajectories_that_evaluate_scores(tiny_models, tmp_path):
    # Two turns, the environment answering the first (tests/integration/user_environment.py): each row holds
    # the conversation, its response is the last assistant turn, which the reward function scored.
    _, test = make_arithmetic(8, 3, seed=0, out_dir=tmp_path / "data")
    trajectories = tmp_path / "trajectories.jsonl"
    assert_succeeded(_run("launchers/generate.py", "--output", trajectories, f"model.path={tiny_models['qwen2-tied']}",
                          f"data.val_files=[{test}]", "data.max_response_length=40", f"reward.function={REWARD}",
                          "rollout.backend=hf", "rollout.val_n=2", "rollout.val_temperature=1.0",
                          "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=2",
                          "rollout.multi_turn.max_tokens_per_turn=6", "rollout.multi_turn.reward=function",
                          f"rollout.multi_turn.environment={ENVIRONMENT}"))
    rows = [json.loads(line) for line in trajectories.read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[0]["content"] == f"{row['ground_truth']}?" and messages[2]["content"] == "go on"
        assert row["response"] == messages[3]["content"] and len(row["response"]) <= 6
        assert row["score"] == _parity(row["response"])
    mean, _ = _expected_table(rows)
    assert evaluate.main([str(trajectories), f"reward.function={REWARD}"])["all"]["mean@2"] == pytest.approx(mean)


def _logged(run_dir, experiment: str, metric: str) -> dict[int, float]:
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0]
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, metric)}


def test_generate_reproduces_the_validation_of_an_sft_warm_start_and_of_a_checkpoint(tmp_path):
    # The tokenizer prepends BOS to raw text (data.apply_chat_template=false): SFT, the trainer's
    # validation and generate.py must give the model the same prompts (tests/unit/data/test_tokenization.py
    # checks the ids), so the greedy responses, hence the scores, agree. Greedy responses vary in
    # length and characters, so the parity reward varies; at a learning rate of 3e-3 (and, since rollouts
    # are seeded per prompt, 1e-3) the two RL steps collapse every greedy response to one parity (mean
    # 1.0 or 0.0), so the test trains at 3e-4.
    base = tmp_path / "base"
    make_tiny_model.main(["--out", str(base), "--bos", "--seed", "3"])
    train, test = make_arithmetic(64, 16, seed=0, out_dir=tmp_path / "data")
    lengths = {"max_prompt_length": 16, "max_response_length": 5}  # the same for validation and generate.py
    common = [f"data.train_files=[{train}]", f"data.val_files=[{test}]", f"trainer.output_dir={tmp_path}",
              "data.apply_chat_template=false", f"reward.function={REWARD}",
              *(f"data.{key}={value}" for key, value in lengths.items())]
    assert_succeeded(torchrun(1, ROOT / "launchers/train_sft.py", "--config", "configs/quickstart_sft.yaml",
                              f"model.path={base}", *common, "trainer.total_steps=20", "data.train_batch_size=16",
                              "actor.micro_batch_size_per_rank=16", "actor.optim.lr_warmup_steps=2"))
    sft = tmp_path / "quickstart_sft/hf"
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                              f"model.path={sft}", *common, f"trainer.checkpoint_dir={tmp_path}/ckpt",
                              "trainer.total_steps=2", "trainer.save_freq=2", "trainer.test_freq=0",
                              "trainer.val_before_train=true", "data.train_batch_size=4", "rollout.n=2",
                              "actor.ppo_mini_batch_size=2", "actor.optim.lr=3e-4"))
    validated = _logged(tmp_path / "quickstart_grpo", "quickstart_grpo", "val/score/mean")
    assert sorted(validated) == [0, 2]

    checkpoint = tmp_path / "ckpt/quickstart_grpo/global_step_2"
    for step, model in ((0, sft), (2, checkpoint)):  # the run's own config: its validation's prompts and sampling
        generations = tmp_path / f"generations_{step}.jsonl"
        assert_succeeded(torchrun(2, ROOT / "launchers/generate.py", "--config", "configs/quickstart.yaml",
                                  "--output", generations, f"model.path={model}", *common))
        rows = [json.loads(line) for line in generations.read_text().splitlines()]
        assert len(rows) == 16 and {"data_source", "prompt", "response", "ground_truth", "score"} <= set(rows[0])
        mean, pass_at_1 = _expected_table(rows)
        table = _evaluate(generations, tmp_path)
        assert table["all"]["mean@1"] == pytest.approx(mean) and table["all"]["pass@1"] == pytest.approx(pass_at_1)
        assert 0 < mean < 1, step  # the scores vary, so equal means say the responses are the same
        assert table["all"]["mean@1"] == validated[step], step  # the same engine on the same weights and prompts


def test_evaluate_names_a_missing_column(tmp_path):
    generations = tmp_path / "bad.jsonl"
    generations.write_text(json.dumps({"data_source": "arithmetic", "ground_truth": "3", "index": 0}) + "\n")
    result = _run("launchers/evaluate.py", generations)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == f"megarl: {generations}: row 0 lacks response " \
                                                     "(write it with launchers/generate.py)"


def test_generate_names_a_model_that_is_neither_hf_nor_a_checkpoint(tmp_path):
    result = _run("launchers/generate.py", "--output", tmp_path / "out.jsonl", f"model.path={tmp_path}",
                  f"data.val_files=[{tmp_path / 'test.parquet'}]", "rollout.backend=hf")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"megarl: config key 'model.path' = '{tmp_path}': expected a HuggingFace model directory (with config.json) "
        "or a megarl checkpoint (global_step_N with an actor); not a checkpoint: no manifest.json (the save did not "
        "finish)")
