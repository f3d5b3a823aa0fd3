"""The plain-transformers backend started with dummy weights: it refuses to generate until a weight
update completes, then generates exactly what the model loaded from its weight files does."""

from __future__ import annotations

import pytest

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
    assert dummy.generate(prompts, greedy) == loaded.generate(prompts, greedy)
