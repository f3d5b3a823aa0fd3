"""A PEFT adapter directory that does not fit actor.lora, or is not plain LoRA (rsLoRA, DoRA, trained biases), is
refused in one line naming the file."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.models.lora import LoRASettings
from megarl.models.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, check_peft_config

SETTINGS = LoRASettings(rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj"))


def _adapter(directory, **config):
    (directory / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                      "target_modules": ["v_proj", "q_proj"], **config}))
    (directory / WEIGHTS_FILE).write_bytes(b"")
    return directory


def test_an_adapter_of_the_configured_rank_alpha_and_targets_is_accepted(tmp_path):
    check_peft_config(_adapter(tmp_path), SETTINGS, experts=False)  # the targets' order does not matter


@pytest.mark.parametrize("config, fragment", [
    ({"r": 16}, "rank 16, alpha 16 on ['q_proj', 'v_proj']; actor.lora asks for rank 8"),
    ({"lora_alpha": 32}, "alpha 32"),
    ({"target_modules": ["q_proj"]}, "on ['q_proj']; actor.lora asks for rank 8, alpha 16 on ['q_proj', 'v_proj']"),
    ({"peft_type": "IA3"}, "a IA3 adapter"),
])
def test_an_adapter_for_another_rank_alpha_targets_or_method_names_its_file(tmp_path, config, fragment):
    with pytest.raises(ValueError) as error:
        check_peft_config(_adapter(tmp_path, **config), SETTINGS, experts=False)
    message = str(error.value)
    assert message.startswith(f"{tmp_path / CONFIG_FILE}: ") and fragment in message and "\n" not in message


def test_a_directory_without_an_adapter_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"config key 'actor.lora.adapter_path' = .*: expected a PEFT adapter"):
        check_peft_config(tmp_path, SETTINGS, experts=False)


def _peft_adapter(directory, **settings):
    """A real PEFT adapter of SETTINGS' rank, alpha and targets on a tiny Qwen2, with PEFT's `settings`."""
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                                **settings))
    model.save_pretrained(directory)
    return directory


def test_a_plain_peft_lora_adapter_is_accepted(tmp_path):
    check_peft_config(_peft_adapter(tmp_path), SETTINGS, experts=False)


@pytest.mark.parametrize("settings, fragment", [
    ({"use_rslora": True}, "use_rslora = true"),  # scaled alpha / sqrt(r), not alpha / r
    ({"use_dora": True}, "use_dora = true"),  # lora_magnitude_vector tensors
    ({"bias": "all"}, 'bias = "all"'),  # the targets' and other biases trained
    ({"bias": "lora_only"}, 'bias = "lora_only"'),
    ({"lora_bias": True}, "lora_bias = true"),  # lora_B's bias
    ({"modules_to_save": ["lm_head"]}, "modules_to_save = ["),  # a module trained whole
])
def test_an_adapter_that_is_not_plain_lora_names_its_file_and_setting(tmp_path, settings, fragment):
    with pytest.raises(ValueError) as error:
        check_peft_config(_peft_adapter(tmp_path, **settings), SETTINGS, experts=False)
    message = str(error.value)
    assert message.startswith(f"{tmp_path / CONFIG_FILE}: ") and fragment in message and "\n" not in message
    assert "actor.lora.adapter_path" in message
