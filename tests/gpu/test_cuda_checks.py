"""One process on one GPU: the collectives and the weight sync every RL step depends on, on CUDA.

The CPU tests run gloo alone and every tensor on the CPU; here the default group is NCCL beside gloo,
and the training weights live on the GPU. Checked: that group takes CUDA and CPU tensors (the step's
bookkeeping is on the CPU), and a weight sync leaves the `hf` engine's CUDA tensors bit-identical to
the training model's HF export, copies into them without a load once they are known, and gives its
greedy tokens the trainer's log-probs. One rank: NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, assert_succeeded, reported, torchrun

pytestmark = pytest.mark.gpu

SCRIPT = ROOT / "tests/gpu/scripts/cuda_checks.py"
VALUES = [1.5, -2.25, 3.0]  # distinct, exact in fp32: a wrong element or a doubled sum shows


def test_nccl_group_and_hf_engine_weight_sync(tiny_models, tmp_path):
    """Log-prob bound 1e-5: fp32 with TF32 off on both sides, so the engine (transformers) and the
    trainer (megatron's local layers, the log-prob kernel) differ only in the order of fp32 sums. On
    CPU the same script measured 1.0e-6 and 1.1e-6 (tiny qwen2, tied and untied), and vLLM's log-probs
    matched the trainer's within ~1e-5. What the bound must catch is far larger: a sync that wrote
    nothing leaves them ~2 off (measured on CPU), and TF32 rounds each GEMM input by up to 2^-11
    relative against fp32's 2^-24."""
    result = torchrun(1, SCRIPT, "--hf", tiny_models["qwen2-untied"], "--out", tmp_path, "--values", *VALUES)
    assert_succeeded(result)
    report = reported(result)

    # One rank: a sum is the tensor itself, a broadcast from rank 0 too; each stays where it was.
    assert report["backend"] == "cuda:nccl,cpu:gloo" and report["compute_device"] == "cuda:0", report
    for where, on in (("compute", "cuda:0"), ("cpu", "cpu")):
        assert report[f"{where}_all_reduce"] == report[f"{where}_broadcast"] == VALUES, report
        assert report[f"{where}_devices_after"] == [on], report
    assert report["megarl_all_reduce"] == VALUES, report
    assert report["bridge_timeout_s"] == report["collective_timeout_s"], report  # not NCCL's own 10 min

    # The engine holds the trained weights (not the checkpoint's) bit for bit, on the GPU.
    assert report["synced_differs_from_checkpoint"], report
    assert all(report[f"bit_identical_after_sync_{step}"] for step in (1, 2, 3)), report
    assert report["engine_param_devices"] == ["cuda:0"], report
    # The first sync is one load; the next ones (with or without training between) copy straight into
    # the engine's own parameters, the places that load named.
    assert report["loads_per_sync"] == [1, 0, 0] and report["places_are_engine_params"], report

    assert report["tokens_scored"] >= 4, report  # 4 prompts, at least one token each
    assert report["engine_vs_trainer_logprob_diff"] <= 1e-5, report
