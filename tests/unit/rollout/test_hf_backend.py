"""The plain-transformers backend started with dummy weights: it refuses to generate until a weight
update completes, then generates what the model loaded from its weight files does.

The two are separate instances (built from config vs from weight files): the same bytes, but not
necessarily the same kernels or memory layouts, so log-probs agree to fp32 rounding, not bitwise
(~5e-7 apart on an AMD EPYC, equal on Intel AVX-512).
"""

from __future__ import annotations

import pytest
import torch

from megarl.rollout.base import Sampling
from megarl.rollout.hf_backend import HFRollout


def test_dummy_weights_serve_only_after_an_update(tiny_models):
    model_dir = str(tiny_models["llama-untied"])
    loaded, dummy = HFRollout(model_dir, "float32"), HFRollout(model_dir, "float32", dummy_weights=True)
    prompts, greedy = [[5, 9, 13], [7, 2]], Sampling(temperature=0.0, max_tokens=6)
    with pytest.raises(RuntimeError, match="dummy weights"):
        dummy.generate(prompts, greedy)
    dummy.begin_weight_update(step=0)
    dummy.load_weights(loaded.model.state_dict().items())
    dummy.end_weight_update()
    assert dummy.eos_token_id == loaded.eos_token_id
    updated, reference = dummy.generate(prompts, greedy), loaded.generate(prompts, greedy)
    # Greedy tokens of this random model are far from ties, so they match exactly; fp32 log-probs after
    # 4 layers of width 128 differ by a few ulps of the accumulated sums (~1e-6), well under 1e-5.
    assert updated.response_ids == reference.response_ids
    assert updated.finish_reasons == reference.finish_reasons
    torch.testing.assert_close(torch.tensor(updated.logprobs), torch.tensor(reference.logprobs), rtol=0, atol=1e-5)
