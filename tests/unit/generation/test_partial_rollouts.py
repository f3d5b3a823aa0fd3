"""Partial rollouts across a weight update: a response begun on version 0 and finished on version 1 keeps,
token by token, the version that sampled it and its log-prob under that version, and the trainer's
importance weights divide by exactly those. Checked against full forward passes of each version's
weights (not the engine's incremental decoding), on the `hf` engine in a world of one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megarl.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, correct_rollout
from megarl.config.loader import load_config
from megarl.data.synthetic import make_arithmetic
from megarl.generation.inputs import RunInputs
from megarl.generation.partial import PartialRollouts
from megarl.rollout.hf_backend import HFRollout
from tests.conftest import ROOT

SEGMENT, LIMIT = 2, 6


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log pi(response_t | prompt, response_<t) from one forward pass over the whole sequence."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_a_response_spanning_two_versions_keeps_each_tokens_behaviour_logprob(tiny_models, tmp_path, world_of_one):
    train, test = make_arithmetic(16, 4, seed=0, out_dir=tmp_path)
    config = load_config(str(ROOT / "configs/quickstart.yaml"), [
        f"model.path={tiny_models['qwen2-tied']}", f"data.train_files=[{train}]", f"data.val_files=[{test}]",
        "trainer.placement=split", "rollout.num_ranks=1", "trainer.max_staleness=1", "rollout.backend=hf",
        f"rollout.partial_tokens={SEGMENT}", f"data.max_response_length={LIMIT}", "data.train_batch_size=2",
        "rollout.n=2"])
    inputs = RunInputs.open(config)
    engine = HFRollout(config.model.path, "float32")
    weights = {0: {name: p.detach().clone() for name, p in engine.model.named_parameters()}}
    generator = torch.Generator().manual_seed(0)
    weights[1] = {name: w + 0.2 * torch.randn(w.shape, generator=generator) for name, w in weights[0].items()}
    partial = PartialRollouts(config, inputs.tokenizer, inputs.rewards, inputs.train_data, inputs.sampler, engine)

    partial.run_round(version=0)  # every response's first tokens on version 0
    engine.begin_weight_update(1)
    engine.load_weights(weights[1].items())
    engine.end_weight_update()
    rollouts, indices, _ = partial.take(step=2, version=1)  # finished on version 1

    assert len(rollouts) == 4 and len(set(indices)) == 2
    temperature = config.rollout.temperature
    spanning = 0
    for prompt, ids, logprobs, versions in zip(rollouts.prompts, rollouts.response_ids, rollouts.rollout_logprobs,
                                               rollouts.token_versions):
        first = min(SEGMENT, len(ids))
        assert versions == [0] * first + [1] * (len(ids) - first)
        spanning += len(ids) > SEGMENT
        expected = torch.empty(len(ids))
        other = torch.empty(len(ids))
        for version in (0, 1):
            with torch.no_grad():
                for name, param in engine.model.named_parameters():
                    param.copy_(weights[version][name])
            under = _logprobs(engine.model, prompt.prompt_ids, ids, temperature)
            mine = torch.tensor([v == version for v in versions])
            expected[mine], other[~mine] = under[mine], under[~mine]
        torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=0, atol=1e-4)
        assert (torch.tensor(logprobs) - other).abs().max() > 1e-2  # the two versions are told apart
    assert spanning >= 2

    # The trainer's importance weights (token TIS), with the trainer's log-probs those of version 1:
    # 1 on the tokens version 1 sampled, exp(train - version 0's) on the others.
    batch = rollouts.to_batch(inputs.tokenizer.pad_token_id)
    response_BR = batch.response_mask_BR > 0
    train_BR = torch.zeros_like(batch.response_tensors.rollout_logprobs_BR)
    for row, (prompt, ids) in enumerate(zip(rollouts.prompts, rollouts.response_ids)):
        train_BR[row, :len(ids)] = _logprobs(engine.model, prompt.prompt_ids, ids, temperature)
    corrected = correct_rollout(ROLLOUT_CORRECTIONS.get("token_tis"), train_BR,
                                batch.response_tensors.rollout_logprobs_BR, batch.response_mask_BR)
    for row, versions in enumerate(rollouts.token_versions):
        weights_T = corrected.weights_BR[row][response_BR[row]]
        old_T = torch.tensor([v == 0 for v in versions])
        torch.testing.assert_close(weights_T[~old_T], torch.ones(int((~old_T).sum())), rtol=0, atol=1e-3)
        ratio_T = (train_BR[row, :len(versions)][old_T] - torch.tensor(rollouts.rollout_logprobs[row])[old_T]).exp()
        torch.testing.assert_close(weights_T[old_T], ratio_T.clamp(max=2.0), rtol=1e-4, atol=1e-5)
        assert not math.isclose(float(weights_T[old_T].min()), 1.0, abs_tol=1e-3)
