"""Conversion tools: HF -> megarl (TP2) -> HF (PP2) is bit-identical, for mixture-of-experts models
HF -> megarl (EP2) -> HF (TP2xEP2, verified against `transformers`) too; a trained checkpoint's actor and
critic convert to HF directories whose `transformers` logits match the megarl models (<= 1e-4) and
which the vLLM engine loads and serves like `transformers`; the critic, trained with LoRA, also exports as a PEFT
adapter with its value head, on its base the merged critic.
"""

from __future__ import annotations

import json

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForTokenClassification

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, reported, torchrun

TO_HF, FROM_HF = ROOT / "checkpoints_tools/convert_to_hf.py", ROOT / "checkpoints_tools/convert_from_hf.py"


def _weights(directory):
    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def test_hf_to_megarl_to_hf_is_bit_identical(tiny_models, tmp_path):
    source = tiny_models["qwen3-untied"]
    assert_succeeded(torchrun(2, FROM_HF, "--hf", source, "--output", tmp_path / "ckpt", "--tp", 2))
    assert_succeeded(torchrun(2, TO_HF, "--checkpoint", tmp_path / "ckpt/global_step_0", "--output", tmp_path / "hf",
                              "--pp", 2))
    original, converted = _weights(source), _weights(tmp_path / "hf")
    assert sorted(original) == sorted(converted)
    assert all(torch.equal(original[name], converted[name]) for name in original)


def test_moe_hf_to_megarl_at_ep2_to_hf_at_tp2xep2_is_bit_identical(tiny_moe_models, tmp_path):
    source = tiny_moe_models["qwen2-moe"]
    assert_succeeded(torchrun(2, FROM_HF, "--hf", source, "--output", tmp_path / "ckpt", "--ep", 2))
    result = torchrun(2, TO_HF, "--checkpoint", tmp_path / "ckpt/global_step_0", "--output", tmp_path / "hf",
                      "--tp", 2, "--ep", 2, "--etp", 1, "--verify")
    assert_succeeded(result)
    assert "OK" in result.stdout
    original, converted = _weights(source), _weights(tmp_path / "hf")
    assert sorted(original) == sorted(converted) and any(".experts." in name for name in original)
    assert all(torch.equal(original[name], converted[name]) for name in original)


def test_trained_checkpoint_converts_for_transformers_and_vllm(tiny_models, tmp_path):
    # One PPO step makes the checkpoint, with the `hf` engine and no validation: what vLLM serves here is
    # the converted model, and the training run only has to move the weights (the critic's: LoRA adapters and its
    # value head, which trains whole).
    train, _ = make_arithmetic(32, 8, seed=0, out_dir=tmp_path / "data")
    assert_succeeded(torchrun(2, ROOT / "launchers/train_ppo.py", "--config", "configs/quickstart_ppo.yaml",
                              f"model.path={tiny_models['qwen2-tied']}", f"data.train_files=[{train}]",
                              "data.val_files=[]", f"trainer.output_dir={tmp_path}", "rollout.backend=hf",
                              f"trainer.checkpoint_dir={tmp_path}/ckpt", "trainer.total_steps=1", "trainer.save_freq=1",
                              "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
                              "actor.optim.lr=1e-2", "critic.lora.rank=8", "critic.optim.lr=1e-2",
                              f"reward.function={ROOT / 'tests/integration/user_reward.py'}:compute_score"))
    checkpoint = tmp_path / "ckpt/quickstart_ppo/global_step_1"
    for model, extra in (("actor", ()), ("critic", ("--peft-output", tmp_path / "critic_adapter"))):
        result = torchrun(2, TO_HF, "--checkpoint", checkpoint, "--output", tmp_path / model, "--model", model,
                          "--tp", 2, "--verify", *extra)
        assert_succeeded(result)
        assert "OK" in result.stdout
    trained, initial = _weights(tmp_path / "actor"), _weights(tiny_models["qwen2-tied"])
    assert any(not torch.equal(trained[n], initial[n]) for n in initial)  # the step changed the weights
    assert json.loads((tmp_path / "critic/config.json").read_text())["architectures"] == ["Qwen2ForTokenClassification"]
    # PEFT's token-classification model of the base with the critic's adapter is the merged critic: the adapter
    # holds the trained head (a fresh one would be drawn at random).
    tokens = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForTokenClassification.from_pretrained(tiny_models["qwen2-tied"], num_labels=1,
                                                               dtype=torch.float32)
        peft_values = PeftModel.from_pretrained(base, tmp_path / "critic_adapter")(tokens).logits
        merged_values = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic",
                                                                        dtype=torch.float32)(tokens).logits
    assert merged_values.abs().max() > 1e-2  # the step moved the head off zero
    assert (merged_values - peft_values).abs().max() < 1e-4
    result = torchrun(1, ROOT / "tests/distributed/scripts/vllm_loads.py", tmp_path / "actor")
    assert_succeeded(result)
    report = reported(result)
    assert report["tokens_equal"] and report["logprob_diff"] <= 1e-4, report
