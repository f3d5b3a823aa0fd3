"""A real 2-process start-up: both ranks join TP2, rank 0 writes the resolved config."""

from __future__ import annotations

from megarl.config import load_config
from tests.conftest import ROOT, assert_succeeded, torchrun


def test_start_run_joins_layout_and_writes_resolved_config(tiny_models, tmp_path):
    model = tiny_models["qwen2-tied"]
    result = torchrun(2, ROOT / "tests/distributed/scripts/start_run.py", "--config", "configs/tiny_cpu.yaml",
                      f"model.path={model}", "actor.tp=2", f"trainer.output_dir={tmp_path}", "trainer.seed=7")
    assert_succeeded(result)
    assert "rank 0: TP2xPP1xDP1 tp_rank=0" in result.stdout and "rank 1: TP2xPP1xDP1 tp_rank=1" in result.stdout
    written = load_config(str(tmp_path / "tiny_cpu" / "config.yaml"))
    assert (written.actor.tp, written.trainer.seed, written.model.path) == (2, 7, str(model))
