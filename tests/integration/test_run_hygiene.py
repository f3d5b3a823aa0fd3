"""What a run leaves behind and how it fails, with the real launcher on 2 CPU processes.

One lineage of launches shares a checkpoint directory: a run saves steps 1 and 2; a shard of step 2
is then truncated to 0 bytes; a run with another output directory (so another mlflow store) resumes
automatically. It must skip the damaged checkpoint for step 1, start a new mlflow run instead of
crashing on the one the checkpoint names, keep only the checkpoint it just wrote, and keep its
mlflow artifacts in its run directory. The first run's console holds no known library notice, and
it leaves nothing in /dev/shm.
Start-up failures (resume_mode=disable into that directory, a reward function with the wrong
signature) print one line once and leave no config.yaml; a reward function returning None stops the
run at its first step.
"""

from __future__ import annotations

import re
import time

import mlflow
import pytest

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, megarl_shared_memory, torchrun

EXPERIMENT = "quickstart_grpo"


@pytest.fixture(scope="module")
def lineage(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("hygiene")
    train, _ = make_arithmetic(64, 16, seed=0, out_dir=root / "data")

    def launch(name, *extra, checkpoints="ckpt"):
        started = time.monotonic()
        result = torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                          f"model.path={tiny_models['qwen2-tied']}", f"data.train_files=[{train}]", "data.val_files=[]",
                          f"trainer.output_dir={root / name}", f"trainer.checkpoint_dir={root / checkpoints}",
                          "trainer.test_freq=0", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                          f"reward.function={ROOT / 'tests/integration/user_reward.py'}:compute_score", *extra,
                          timeout=600)
        result.seconds = time.monotonic() - started
        return result

    launch.root = root
    shared_memory_before = megarl_shared_memory()
    launch.first = launch("first", "trainer.total_steps=2", "trainer.save_freq=1")
    assert_succeeded(launch.first)
    launch.shared_memory_left = megarl_shared_memory() - shared_memory_before
    return launch


def _one_error_line(result) -> str:
    """The launcher's error, checked to be printed once although both ranks raised it."""
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("megarl: ")]
    assert len(lines) == 1, lines
    return lines[0]


def _store(run_dir):
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    return client, client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])


def test_a_run_prints_no_library_notice_it_has_no_use_for(lineage):
    """The first run's console (2 processes, each with a vLLM engine): none of the notices vLLM and torch
    log at every CPU start (about Triton, eager mode, LD_PRELOAD, the seed, megarl's VLLM_DIST_IDENT),
    no deprecation warning, and no error at exit."""
    output = lineage.first.stdout + lineage.first.stderr
    for notice in ("Triton", "Enforce eager", "Inductor", "LD_PRELOAD", "global random seed", "VLLM_DIST_IDENT",
                   "SSM cache", "set_num_threads", "FutureWarning", "Traceback", "terminate called"):
        assert notice not in output, output
    assert "step 2: reward/mean=" in output


def test_a_run_leaves_nothing_in_shared_memory(lineage):
    """The first run's 2 processes on 2 cores gather and reduce through a shared-memory segment
    (`megarl.distributed.shared_memory`): once it has ended, /dev/shm holds no file of it."""
    assert not lineage.shared_memory_left


def test_disable_into_a_directory_with_checkpoints_refuses_before_building_anything(lineage):
    result = lineage("disabled", "trainer.resume_mode=disable", "trainer.total_steps=1", "trainer.save_freq=1")
    message = _one_error_line(result)
    assert "trainer.resume_mode=disable" in message and "global_step_1, global_step_2" in message
    assert "trainer.experiment_name" in message and "trainer.checkpoint_dir" in message
    assert not (lineage.root / "disabled" / EXPERIMENT / "config.yaml").exists()
    assert sorted(p.name for p in (lineage.root / "ckpt" / EXPERIMENT).iterdir()) == [
        "global_step_1", "global_step_2", "latest"]


def test_a_reward_function_with_the_wrong_signature_fails_before_any_engine(lineage, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(solution_str):\n    return 1.0\n")
    result = lineage("signature", "trainer.total_steps=1", f"reward.function={reward}:compute_score")
    message = _one_error_line(result)
    assert message.startswith(f"megarl: reward.function='{reward}:compute_score' has the signature")
    assert "vllm" not in (result.stdout + result.stderr).lower()  # no engine was started
    assert not (lineage.root / "signature" / EXPERIMENT).exists()  # no config.yaml, no mlflow store
    print(f"wrong reward signature reported after {result.seconds:.1f} s")


def test_a_reward_function_returning_none_stops_the_run_at_its_first_step(lineage, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return None\n")
    result = lineage("none", "trainer.total_steps=2", f"reward.function={reward}:compute_score", "rollout.backend=hf",
                     checkpoints="none")  # any engine's responses do; `hf` starts faster than vLLM
    message = _one_error_line(result)
    assert re.fullmatch(r"megarl: all 32 reward calls failed \(32 errors, 0 timeouts\); first: \S+/train\.parquet: "
                        r"row \d+ \(data_source 'arithmetic'\): ValueError: compute_score must return a finite number "
                        r"or a dict with 'score', got None", message), message
    assert "step 1:" not in result.stdout  # no step was logged, let alone trained on zero rewards


def test_resume_elsewhere_skips_a_truncated_shard_starts_a_new_mlflow_run_and_keeps_its_artifacts(lineage):
    checkpoints = lineage.root / "ckpt" / EXPERIMENT
    shard = max((checkpoints / "global_step_2" / "actor").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(b"")
    _, [first_run] = _store(lineage.root / "first" / EXPERIMENT)

    result = lineage("second", "trainer.total_steps=3", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=1")
    assert_succeeded(result)
    output = result.stdout + result.stderr
    assert f"global_step_2: actor/{shard.relative_to(checkpoints / 'global_step_2' / 'actor')} has 0 bytes" in output
    assert f"resumed from {checkpoints / 'global_step_1'} (step 1)" in output
    assert f"mlflow run {first_run.info.run_id}, named by the checkpoint, is not in the store" in output

    # Retention kept only the checkpoint just written, and `latest` names it.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step_3", "latest"]
    assert (checkpoints / "latest").read_text() == "global_step_3"

    run_dir = lineage.root / "second" / EXPERIMENT
    client, [run] = _store(run_dir)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [2, 3]
    artifacts = run_dir / "mlartifacts" / run.info.run_id / "artifacts"
    assert sorted(p.name for p in artifacts.iterdir()) == ["config.yaml", "curves.png"]
    assert not (ROOT / "mlruns" / "1" / run.info.run_id).exists()
    # The first run's store still holds one run that logged steps 1 and 2 only.
    first_client, [unchanged] = _store(lineage.root / "first" / EXPERIMENT)
    assert [m.step for m in first_client.get_metric_history(unchanged.info.run_id, "reward/mean")] == [1, 2]
