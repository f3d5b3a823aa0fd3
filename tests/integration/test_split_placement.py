"""Split placement at staleness 0 is the colocated run, moved: the real launcher for 3 GRPO steps with a DP2
trainer + 1 rollout rank (`hf` engine, multi-turn trajectories with an environment; each trainer rank receives
its share of the batch alone) and with a LoRA-adapted TP2 trainer + 2 rollout ranks (one vLLM engine at TP2),
each against the colocated run of the same trainer layout and engine. Every
prompt samples with its own seed and the engine holds the trainer's weights of the previous step, so the
responses and rewards are the colocated run's exactly, and the losses agree (same kernels, same bytes). Every
sync moves what the engines need and no more. (Staleness 1 and exact resume: test_checkpoint_resume.py.)
"""

from __future__ import annotations

import mlflow
import pytest

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, torchrun
from tests.integration import user_environment

STEPS = 3
CASES = {  # name: (processes, overrides shared by both runs, split placement's own)
    # Trajectories of three turns, the environment answering the first two.
    "dp2+1-hf-multi-turn": (2, ["rollout.backend=hf", *user_environment.overrides()], ["rollout.num_ranks=1"]),
    # LoRA: the colocated engine takes the adapted linears alone after its first sync, the split one whole merged
    # weights.
    "tp2+2-vllm-tp2-lora": (2, ["actor.tp=2", "rollout.tp=2", "actor.lora.rank=8", "actor.optim.lr=1e-2"],
                            ["rollout.num_ranks=2"]),
}


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    return make_arithmetic(64, 16, seed=0, out_dir=tmp_path_factory.mktemp("data"))


def _run(nproc: int, model, data, out, *overrides: str) -> dict[str, list[float]]:
    train, test = data
    result = torchrun(nproc, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart.yaml",
                      f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{test}]",
                      f"trainer.output_dir={out}", f"trainer.total_steps={STEPS}", "trainer.val_before_train=false",
                      "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "data.max_val_samples=4",
                      f"reward.function={ROOT / 'tests/integration/user_reward.py'}:compute_score", *overrides)
    assert_succeeded(result)
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{out}/quickstart_grpo/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("quickstart_grpo").experiment_id])[0]
    return {name: [m.value for m in sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)]
            for name in run.data.metrics}


@pytest.mark.parametrize("name", CASES)
def test_split_at_staleness_0_is_the_colocated_run(tiny_models, arithmetic, tmp_path, name):
    nproc, shared, split = CASES[name]
    model = tiny_models["qwen2-tied"]
    colocated = _run(nproc, model, arithmetic, tmp_path / "colocated", *shared)
    moved = _run(nproc + int(split[0].split("=")[1]), model, arithmetic, tmp_path / "split", *shared, *split,
                 "trainer.placement=split")
    assert moved["reward/mean"] == colocated["reward/mean"] and len(moved["reward/mean"]) == STEPS
    assert moved["val/score/mean"] == colocated["val/score/mean"]
    for metric in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "mismatch/logprob_abs_diff_mean"):
        assert moved[metric] == pytest.approx(colocated[metric], rel=1e-5, abs=1e-7), metric
    assert moved["rollout/staleness"] == [0.0] * STEPS
    if "rollout.multi_turn.enable=true" in shared:
        assert moved["agent/turns"] == colocated["agent/turns"] == [3.0] * STEPS
        assert moved["agent/environment_tokens"] == colocated["agent/environment_tokens"]
    assert moved["sync/bytes_over_lower_bound"] == [1.0] * STEPS
