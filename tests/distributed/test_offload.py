"""`actor.offload`/`critic.offload` in the RL trainer at TP2 (bf16, without the distributed optimizer),
PP2 (bf16) and DP2 (fp32 with the distributed optimizer, whose main parameters are views of DDP's
parameter buffer), 2 processes each.

One launch per layout runs PPO (actor, reference for the KL reward, critic) for three steps with a
validation after the first and the last, offload off then on (tests/distributed/scripts/offload_checks.py).
Checks:
- the metrics of every step (losses, rewards, KL, grad norms, ...) and the final weights and
  optimizer states are bitwise equal with and without offload (same program, same bytes);
- with offload, the actor, reference and critic hold no device storage while the engine is created
  and while it generates, and only the actor's parameters during the weight sync; after each step
  they hold exactly what the run without offload holds;
- the rollout engine's phase calls come in the order that lets each part fit: created then put to
  sleep; per rollout, weights woken before the sync, KV cache after it, asleep again afterwards;
- a validation's sync is the next step's: the engine sleeps keeping its weights and the step after
  it loads none (one weight update fewer).
bf16 without the distributed optimizer (TP2) is the case whose weights used never to leave. bf16 at
PP2 keeps fp32 layer norms on the second stage, whose weight sync used to assume the first
parameter's dtype for every tensor.
"""

from __future__ import annotations

import pytest

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, reported, torchrun

SCRIPT = ROOT / "tests/distributed/scripts/offload_checks.py"
LAYOUTS = {"tp2": ["actor.tp=2", "model.dtype=bfloat16", "actor.use_distributed_optimizer=false",
                   "critic.use_distributed_optimizer=false"],
           "pp2": ["actor.pp=2", "model.dtype=bfloat16"], "dp2": []}
ROLLOUT = ["wake_up weights", "begin_weight_update", "end_weight_update", "wake_up kv_cache", "generate", "sleep"]
VALIDATION = ROLLOUT[:-1] + ["sleep keeping weights"]
REUSED = ["wake_up weights", "wake_up kv_cache", "generate", "sleep"]  # no weight update
EXPECTED_PHASES = ["create", "sleep"] + ROLLOUT + VALIDATION + REUSED + ROLLOUT + VALIDATION


def _phases(events):
    """Phase names with repeats collapsed (a rollout generates more than once)."""
    names = [name for name, _ in events]
    return [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]


def offload_args(models: dict, tmp_path) -> list[str]:
    """PPO (actor, reference, critic) for three steps on the tiny Qwen2, offload_checks' arguments."""
    train, test = make_arithmetic(32, 8, seed=0, out_dir=tmp_path / "data")
    return ["--config", "configs/quickstart_ppo.yaml", f"model.path={models['qwen2-tied']}",
            f"data.train_files=[{train}]", f"data.val_files=[{test}]", f"trainer.output_dir={tmp_path}",
            f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", "trainer.loggers=[]", "trainer.total_steps=3",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
            "data.max_val_samples=4", "rollout.backend=recording-hf",
            f"reward.function={ROOT / 'tests/integration/user_reward.py'}:compute_score"]


def assert_offload_report(result) -> None:
    """offload_checks' REPORT: bitwise the same training, nothing held while the engine works, phases in order."""
    assert_succeeded(result)
    report = reported(result)
    assert report["compared"] > 100 and report["differing"] == []
    assert all(pg_loss != 0 and vf_loss != 0 for pg_loss, vf_loss in report["losses"])  # training moves
    for rank in report["ranks"]:
        assert rank["bitwise_equal"] == {"actor params": True, "actor optimizer": True,
                                         "critic params": True, "critic optimizer": True}
        assert _phases(rank["events_off"]) == _phases(rank["events_on"]) == EXPECTED_PHASES
        full = rank["after_steps_off"][0]
        assert all(nbytes > 0 for nbytes in full)  # actor params, actor grads + optimizer, reference, critic
        assert rank["after_steps_on"] == rank["after_steps_off"] == [full] * 3
        for (name, held_off), (_, held_on) in zip(rank["events_off"], rank["events_on"]):
            assert all(nbytes > 0 for nbytes in held_off)  # without offload, everything stays
            during_sync = name in ("wake_up weights", "begin_weight_update", "end_weight_update")
            assert held_on == ([held_off[0], 0, 0, 0] if during_sync else [0, 0, 0, 0]), (name, held_on)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_keeps_training_bitwise_and_frees_the_device_during_rollout(tiny_models, tmp_path, layout):
    assert_offload_report(torchrun(2, SCRIPT, *offload_args(tiny_models, tmp_path), *LAYOUTS[layout], timeout=600))
