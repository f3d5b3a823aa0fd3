"""The plain-transformers backend started with dummy weights: it refuses to generate until a weight
update completes, then generates what the model loaded from its weight files does. `submit` starts one
response and refuses a Sampling of several.

The two are separate instances (built from config vs from weight files): the same bytes, but not
necessarily the same kernels or memory layouts, so log-probs agree to fp32 rounding, not bitwise
(~5e-7 apart on an AMD EPYC, equal on Intel AVX-512).
"""

from __future__ import annotations

import json
import shutil

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
    assert dummy.eos_token_ids == loaded.eos_token_ids
    updated, reference = dummy.generate(prompts, greedy), loaded.generate(prompts, greedy)
    # Greedy tokens of this random model are far from ties, so they match exactly; fp32 log-probs after
    # 4 layers of width 128 differ by a few ulps of the accumulated sums (~1e-6), well under 1e-5.
    assert updated.response_ids == reference.response_ids
    assert updated.finish_reasons == reference.finish_reasons
    torch.testing.assert_close(torch.tensor(updated.logprobs), torch.tensor(reference.logprobs), rtol=0, atol=1e-5)


def test_submit_refuses_several_samples(tiny_models):
    engine = HFRollout(str(tiny_models["llama-untied"]), "float32")
    with pytest.raises(ValueError, match=r"submit\(\) starts one response: got Sampling with n=2"):
        engine.submit("a", [5, 9, 13], Sampling(n=2))
    assert not engine.submitted
    engine.submit("a", [5, 9, 13], Sampling(n=1, max_tokens=1))
    assert [advance.key for advance in engine.step()] == ["a"]


def test_moe_outputs_carry_the_experts_each_fed_token_was_routed_to(tiny_moe_models):
    engine = HFRollout(str(tiny_moe_models["qwen3-moe"]), "float32")
    prompts = [[5, 9, 13], [7, 2]]
    output = engine.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=5, seed=3))
    assert engine.routed_experts_shape == (4, 2)
    for i, (response, routing) in enumerate(zip(output.response_ids, output.routed_experts)):
        fed = prompts[i // 2] + response[:-1]  # the last sampled token is never fed back
        with torch.no_grad():
            router_logits = engine.model(torch.tensor([fed]), output_router_logits=True).router_logits
        expected_NLk = torch.stack([logits.topk(2).indices.sort(-1).values for logits in router_logits], 1)
        assert routing.dtype == torch.int16 and routing.shape == (len(fed), 4, 2)
        assert torch.equal(routing.long().sort(-1).values, expected_NLk)


def test_a_generation_config_with_several_eos_ids_stops_on_each(tiny_models, tmp_path):
    # Llama 3's and Qwen 2.5 instruct's generation configs list their EOS ids. Greedy responses of the model stop
    # wherever the list's second id is the token drawn.
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_models["llama-untied"], model_dir)
    prompts, greedy = [[5, 9, 13], [7, 2]], Sampling(temperature=0.0, max_tokens=6)
    first_tokens = [response[0] for response in HFRollout(str(model_dir), "float32").generate(prompts, greedy)
                    .response_ids]
    config = json.loads((model_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [99, first_tokens[0]]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    output = HFRollout(str(model_dir), "float32").generate(prompts, greedy)
    assert output.response_ids[0] == [first_tokens[0]] and output.finish_reasons[0] == "stop"
