"""On CPU, a KV block is the smallest multiple of 32 tokens that holds a whole sequence, at most vLLM's 128."""

from __future__ import annotations

import pytest

from megarl.rollout.vllm_backend import cpu_block_size


@pytest.mark.parametrize(("max_model_len", "block"), [(1, 32), (24, 32), (32, 32), (33, 64), (100, 128), (128, 128),
                                                      (4096, 128)])
def test_a_kv_block_holds_a_whole_sequence_in_multiples_of_32_up_to_128(max_model_len, block):
    assert cpu_block_size(max_model_len) == block
