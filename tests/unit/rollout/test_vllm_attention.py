"""`model.dtype=float32` on CUDA: vLLM's first-choice attention backends (FlashAttention, FlashInfer) take
float16 and bfloat16 only, so the engine is pinned to one that takes float32; elsewhere vLLM chooses.
Checked against the installed vLLM's backend classes (the CPU build ships the same Python sources)."""

from __future__ import annotations

import pytest
import torch

from megarl import device
from megarl.rollout.vllm_backend import FP32_CUDA_ATTENTION, attention_config


@pytest.mark.parametrize(("cuda", "dtype", "pinned"), [
    (True, "float32", True), (True, "bfloat16", False), (True, "float16", False), (False, "float32", False)])
def test_float32_on_cuda_is_pinned_to_an_attention_backend_that_takes_it(monkeypatch, cuda, dtype, pinned):
    monkeypatch.setattr(device, "cuda", lambda: cuda)
    assert attention_config(dtype) == ({"backend": FP32_CUDA_ATTENTION} if pinned else {})


def test_the_pinned_backend_takes_float32_where_vllms_first_choices_do_not(monkeypatch):
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(device, "cuda", lambda: True)
    pinned = AttentionConfig(**attention_config("float32")).backend  # what LLM(attention_config=...) makes of it
    assert pinned == AttentionBackendEnum.TRITON_ATTN and pinned.get_class().supports_dtype(torch.float32)
    assert not AttentionBackendEnum.FLASH_ATTN.get_class().supports_dtype(torch.float32)
