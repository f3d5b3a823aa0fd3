"""Checkpoints that never lose work: SIGKILL during training or during a save, then resume=auto,
gives the same per-step losses and rewards as an uninterrupted run (bitwise on CPU); a run saved
at TP2 resumes at PP2; retention and damaged checkpoints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import mlflow
import pytest

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, torchrun

METRICS = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "response_length/mean")


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    return make_arithmetic(64, 16, seed=0, out_dir=tmp_path_factory.mktemp("data"))


def _args(model, data, out, *extra):
    train, test = data
    return ["--config", "configs/quickstart.yaml", f"model.path={model}", f"data.train_files=[{train}]",
            f"data.val_files=[{test}]", f"trainer.output_dir={out}", f"trainer.checkpoint_dir={out}/ckpt",
            "trainer.total_steps=4", "trainer.save_freq=1", "trainer.test_freq=0", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2", "data.max_val_samples=4", "actor.optim.lr=1e-3",
            f"reward.function={ROOT / 'tests/integration/user_reward.py'}:compute_score", *extra]


def _metrics(out) -> dict[str, dict[int, float]]:
    """The last value logged for each step (a resumed run logs the steps after its checkpoint again)."""
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{out}/quickstart_grpo/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("quickstart_grpo").experiment_id])
    assert len(runs) == 1, "a resumed job must continue its mlflow run"
    return {name: {m.step: m.value for m in sorted(client.get_metric_history(runs[0].info.run_id, name),
                                                    key=lambda m: m.timestamp)} for name in METRICS}


def _start(*args) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "launchers/train_ppo.py", *map(str, args)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _kill_when(process: subprocess.Popen, condition, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, "the run ended before the moment to kill it"
        assert time.time() < deadline, "timed out waiting for the moment to kill"
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, arithmetic, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py", *_args(tiny_models["qwen2-tied"], arithmetic, out)))
    metrics = _metrics(out)
    assert sorted(metrics["actor/pg_loss"]) == [1, 2, 3, 4]
    assert len(set(metrics["actor/grad_norm"].values())) > 1  # the weights really move
    return metrics


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_sigkill_during_training_then_auto_resume_is_bitwise_identical(tiny_models, arithmetic, tmp_path,
                                                                       uninterrupted, async_save):
    # With async saves the shards are written by background processes while step 3 trains.
    args = _args(tiny_models["qwen2-tied"], arithmetic, tmp_path, f"trainer.async_save={async_save}")
    checkpoints = tmp_path / "ckpt/quickstart_grpo"
    process = _start(*args)
    _kill_when(process, lambda: (checkpoints / "latest").is_file()
               and (checkpoints / "latest").read_text() == "global_step_2")
    assert not (checkpoints / "global_step_4").exists()
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py", *args))
    assert _metrics(tmp_path) == uninterrupted


def test_sigkill_during_a_save_leaves_no_checkpoint_that_looks_complete(tiny_models, arithmetic, tmp_path,
                                                                        uninterrupted):
    args = _args(tiny_models["qwen2-tied"], arithmetic, tmp_path)
    checkpoints = tmp_path / "ckpt/quickstart_grpo"
    process = _start(*args)
    _kill_when(process, lambda: (checkpoints / ".global_step_3.partial").is_dir())
    assert not (checkpoints / "global_step_3").exists()
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py", *args))
    assert _metrics(tmp_path) == uninterrupted


def test_saved_at_tp2_resumes_at_pp2(tiny_models, arithmetic, tmp_path, uninterrupted):
    model = tiny_models["qwen2-tied"]
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py",
                              *_args(model, arithmetic, tmp_path, "actor.tp=2", "trainer.total_steps=2")))
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py", *_args(model, arithmetic, tmp_path, "actor.pp=2")))
    resumed = _metrics(tmp_path)
    # The same weights generate the same responses; losses differ only by fp32 reduction order.
    assert resumed["reward/mean"] == uninterrupted["reward/mean"]
    for name in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        for step, value in uninterrupted[name].items():
            assert resumed[name][step] == pytest.approx(value, abs=1e-4), (name, step)
