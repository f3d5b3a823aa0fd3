"""A GRPO job on one GPU (bf16, `hf` engine, a checkpoint every step) crashed during the actor update of
step 3 (every process SIGKILLed) and resumed with `resume_mode=auto`: it loads step 2, trains steps 3 and 4
only, and ends where the uninterrupted job ends: the same metrics at every step and a final checkpoint
(weights and Adam state) bitwise equal. One process runs the same kernels on the same bytes; the sampling
and dropout streams come back with the checkpoint's CUDA RNG state."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT
from tests.integration.job_launch import Launch

pytestmark = pytest.mark.gpu

TOTAL_STEPS = 4
WALL_CLOCK = ("timing/", "throughput/")


def _args(model, data, out) -> list[str]:
    train, test = data
    return ["--config", "configs/quickstart.yaml", f"model.path={model}", f"data.train_files=[{train}]",
            f"data.val_files=[{test}]", f"trainer.output_dir={out}", f"trainer.checkpoint_dir={out}/ckpt",
            f"trainer.total_steps={TOTAL_STEPS}", "trainer.save_freq=1", "trainer.test_freq=0", "trainer.log_freq=1",
            "trainer.loggers=[console]", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
            "data.max_val_samples=4", "actor.optim.lr=1e-3", "model.dtype=bfloat16", "rollout.backend=hf",
            f"reward.function={ROOT / 'tests/integration/user_reward.py'}:compute_score"]


def _logged(launch: Launch) -> dict[int, dict[str, str]]:
    """The console's metrics of each step, as printed, without the ones that measure time."""
    lines = re.findall(r"^step (\d+): (.*)$", launch.console(), flags=re.MULTILINE)
    return {int(step): {k: v for k, v in re.findall(r"(\S+)=(\S+)", shown) if not k.startswith(WALL_CLOCK)}
            for step, shown in lines}


def _final_checkpoint(out, scratch) -> dict[str, torch.Tensor]:
    """Every tensor of the actor's last checkpoint (megatron's torch_dist format is a DCP checkpoint)."""
    dcp_to_torch_save(out / "ckpt" / "quickstart_grpo" / f"global_step_{TOTAL_STEPS}" / "actor", scratch)
    return {name: value for name, value in torch.load(scratch, weights_only=False).items()
            if isinstance(value, torch.Tensor)}


def test_a_crashed_job_resumes_exactly(tiny_models, tmp_path):
    data = make_arithmetic(64, 16, seed=0, out_dir=tmp_path / "data")
    model = tiny_models["qwen2-tied"]
    reference = Launch(tmp_path / "uninterrupted", _args(model, data, tmp_path / "uninterrupted"), nproc=1)
    reference.finish()

    out = tmp_path / "crashed"
    crashed = Launch(out, _args(model, data, out), nproc=1)
    crashed.wait_for(lambda: crashed.phase_began(3, "update_actor"))
    crashed.crash()
    assert (out / "ckpt" / "quickstart_grpo" / "latest").read_text() == "global_step_2"
    resumed = Launch(out, _args(model, data, out), nproc=1)
    resumed.finish()

    assert re.search(r"resumed from \S+/global_step_2 \(step 2\)", resumed.console()), resumed.console()[-2000:]
    assert sorted(_logged(resumed)) == [3, 4]  # the steps after the checkpoint, and only those
    expected = _logged(reference)
    assert {step: expected[step] for step in (3, 4)} == _logged(resumed)
    final, resumed_final = (_final_checkpoint(run, tmp_path / f"{run.name}.pt")
                            for run in (tmp_path / "uninterrupted", out))
    assert final.keys() == resumed_final.keys() and len(final) > 10
    differing = [name for name in final if not torch.equal(final[name], resumed_final[name])]
    assert not differing, differing
