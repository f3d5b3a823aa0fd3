"""Partial rollouts across a weight update: a response begun on version 0 and finished on version 1 keeps,
token by token, the version that sampled it and its log-prob under that version, and the trainer's
importance weights divide by exactly those. Checked against full forward passes of each version's
weights (not the engine's incremental decoding), on the `hf` engine in a world of one process. Requests kept
in the engine through the update (`rollout.keep_kv`) go on over the KV cache the old weights computed.
Multi-turn trajectories in flight resume from a saved state exactly, their environments replayed."""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch
import torch.distributed as dist

from megarl.agent.environment import Observation
from megarl.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, correct_rollout
from megarl.config.loader import load_config
from megarl.data.synthetic import make_arithmetic
from megarl.generation.inputs import RunInputs
from megarl.generation.partial import PartialRollouts
from megarl.rollout.hf_backend import HFRollout
from tests.conftest import ROOT

FIRST_TOKENS, LIMIT = 2, 6
"""Engine steps on version 0, and the responses' length limit."""


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


def _across_an_update(tiny_models, tmp_path, keep: bool):
    """Responses begun on version 0 (random weights 0.2 away) and finished on version 1, the requests kept
    through the weight update or not; the engine is left at version 1. Also the state saved at the pause, as a
    checkpoint holds it."""
    train, test = make_arithmetic(16, 4, seed=0, out_dir=tmp_path)
    config = load_config(str(ROOT / "configs/quickstart.yaml"), [
        f"model.path={tiny_models['qwen2-tied']}", f"data.train_files=[{train}]", f"data.val_files=[{test}]",
        "trainer.placement=split", "rollout.num_ranks=1", "trainer.max_staleness=1", "rollout.backend=hf",
        "rollout.partial=true", f"data.max_response_length={LIMIT}", "data.train_batch_size=2",
        "rollout.n=2"])
    inputs = RunInputs.open(config)
    engine = HFRollout(config.model.path, "float32")
    weights = {0: {name: p.detach().clone() for name, p in engine.model.named_parameters()}}
    generator = torch.Generator().manual_seed(0)
    weights[1] = {name: w + 0.2 * torch.randn(w.shape, generator=generator) for name, w in weights[0].items()}
    partial = PartialRollouts(config, inputs.tokenizer, inputs.rewards, inputs.train_data, inputs.sampler, engine)

    for _ in range(FIRST_TOKENS):  # every response's first tokens on version 0, towards step 2's batch
        partial.advance(step=2, version=0)
    partial.pause(keep)  # as the rollout ranks do before a weight sync
    saved = json.loads(json.dumps(partial.state_dict()))
    engine.begin_weight_update(1)
    engine.load_weights(weights[1].items())
    engine.end_weight_update()
    rollouts, indices, metrics = partial.take(step=2, version=1)  # finished on version 1
    assert len(rollouts) == 4 and len(set(indices)) == 2
    return config, inputs, engine, weights, rollouts, metrics, saved


def test_a_response_spanning_two_versions_keeps_each_tokens_behaviour_logprob(tiny_models, tmp_path, world_of_one):
    config, inputs, engine, weights, rollouts, metrics, saved = _across_an_update(tiny_models, tmp_path, keep=False)
    assert metrics["rollout/kept_requests"] == 0
    temperature = config.rollout.temperature
    spanning = 0
    for prompt, ids, logprobs, versions in zip(rollouts.prompts, rollouts.response_ids, rollouts.rollout_logprobs,
                                               rollouts.token_versions):
        first = min(FIRST_TOKENS, len(ids))
        assert versions == [0] * first + [1] * (len(ids) - first)
        spanning += len(ids) > FIRST_TOKENS
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

    # Resumed from the state saved at the pause (a checkpoint's), on version 1: the same responses, token for token.
    resumed_inputs = RunInputs.open(config)
    resumed = PartialRollouts(config, resumed_inputs.tokenizer, resumed_inputs.rewards, resumed_inputs.train_data,
                              resumed_inputs.sampler, engine)
    resumed.load_state_dict(saved)
    again, _, _ = resumed.take(step=2, version=1)
    for column in ("response_ids", "rollout_logprobs", "token_versions"):
        assert getattr(again, column) == getattr(rollouts, column), column


def test_requests_kept_through_an_update_go_on_over_their_cache(tiny_models, tmp_path, world_of_one):
    # rollout.keep_kv: the requests stay in the engine through the weight update, so each token version 1
    # samples comes from version 1's weights over the KV cache version 0 computed for the tokens before the
    # update: checked against one forward pass of version 1 over the continuation, fed version 0's cache.
    config, inputs, engine, weights, rollouts, metrics, _ = _across_an_update(tiny_models, tmp_path, keep=True)
    temperature = config.rollout.temperature
    continued = [i for i, ids in enumerate(rollouts.response_ids) if len(ids) > FIRST_TOKENS]
    assert metrics["rollout/kept_requests"] == len(continued) >= 2
    for row in continued:
        prompt, ids = rollouts.prompts[row].prompt_ids, rollouts.response_ids[row]
        assert rollouts.token_versions[row] == [0] * FIRST_TOKENS + [1] * (len(ids) - FIRST_TOKENS)
        with torch.no_grad():
            for name, param in engine.model.named_parameters():
                param.copy_(weights[0][name])
            # the cache version 0 left: the prompt and every token it sampled but the last (not yet fed)
            cache = engine.model(torch.tensor([prompt + ids[:FIRST_TOKENS - 1]]), use_cache=True).past_key_values
            for name, param in engine.model.named_parameters():
                param.copy_(weights[1][name])
            logits = engine.model(torch.tensor([ids[FIRST_TOKENS - 1:-1]]), past_key_values=cache).logits[0]
        expected = torch.log_softmax(logits.float() / temperature, -1).gather(
            1, torch.tensor(ids[FIRST_TOKENS:])[:, None])[:, 0]
        kept = torch.tensor(rollouts.rollout_logprobs[row][FIRST_TOKENS:])
        torch.testing.assert_close(kept, expected, rtol=0, atol=1e-4)
        recomputed = _logprobs(engine.model, prompt, ids, temperature)[FIRST_TOKENS:]
        assert (kept - recomputed).abs().max() > 1e-2  # not what a request prefilled anew would give


def test_every_group_admitted_is_trained_within_the_staleness_bound(tiny_models, tmp_path, world_of_one, caplog):
    # Split placement's order of calls at trainer.max_staleness=1 with more groups in flight than a batch holds:
    # B_s taken after the sync to version s - 1, B_(s+1) filled while the trainer trains, then the next sync.
    # Every batch keeps the bound and no group is thrown away: the prompts trained on and those still waiting
    # are the sampler's first prompts, each once.
    train, test = make_arithmetic(16, 4, seed=0, out_dir=tmp_path)
    config = load_config(str(ROOT / "configs/quickstart.yaml"), [
        f"model.path={tiny_models['qwen2-tied']}", f"data.train_files=[{train}]", f"data.val_files=[{test}]",
        "trainer.placement=split", "rollout.num_ranks=1", "trainer.max_staleness=1", "rollout.backend=hf",
        "rollout.partial=true", "data.max_response_length=8", "data.train_batch_size=2", "rollout.n=2",
        "rollout.partial_groups=3"])
    inputs = RunInputs.open(config)
    partial, engine = _partial(config, inputs)
    assert [r.message.split(":")[0] for r in caplog.records if r.name == "megarl.generation.partial"] == [
        "partial rollouts at trainer.max_staleness=1"]  # the start-up notice: at 1 they generate whole batches
    trained = []
    for step in range(1, 6):
        rollouts, indices, metrics = partial.take(step, version=step - 1)
        assert min(v for versions in rollouts.token_versions for v in versions) >= step - 2
        assert metrics["rollout/restarted_groups"] == 0
        trained += indices
        partial.fill(step + 1, version=step - 1)
        partial.pause(keep=False)
        _update(engine, step)
    waiting = [group.index for group in partial.finished + partial.in_flight]
    sampler, served = RunInputs.open(config).sampler, []
    while len(served) < partial.admitted:
        served += sampler.next_batch()
    served = served[:partial.admitted]
    assert len(trained) == 10 and sorted(trained + waiting) == sorted(served)


class CountTurns:
    """An environment with state: it answers the model's k-th turn with "turn k"."""

    def __init__(self, toolbox):
        self.tools, self.turns = [], 0

    def reset(self, sample) -> list[dict]:
        return [{"role": "user", "content": f"{sample.ground_truth}?"}]

    def step(self, assistant_text: str) -> Observation:
        self.turns += 1
        return Observation([{"role": "user", "content": f"turn {self.turns}"}])


class AnswerDifferentlyOnReplay:
    """An environment whose answers are random (not only a function of its sample and the model's turns): a
    replay cannot give the run's answers back."""

    def __init__(self, toolbox):
        self.tools = []

    def reset(self, sample) -> list[dict]:
        return [{"role": "user", "content": f"{sample.ground_truth}?"}]

    def step(self, assistant_text: str) -> Observation:
        return Observation([{"role": "user", "content": os.urandom(2).hex()}])


def _multi_turn(tiny_models, tmp_path, environment: str) -> tuple[RunInputs, object]:
    train, test = make_arithmetic(16, 4, seed=0, out_dir=tmp_path)
    config = load_config(str(ROOT / "configs/quickstart.yaml"), [
        f"model.path={tiny_models['qwen2-tied']}", f"data.train_files=[{train}]", f"data.val_files=[{test}]",
        "trainer.placement=split", "rollout.num_ranks=1", "trainer.max_staleness=2", "rollout.backend=hf",
        "rollout.partial=true", "data.train_batch_size=2", "rollout.n=2", "rollout.partial_groups=3",
        "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=3", "rollout.multi_turn.reward=function",
        "rollout.multi_turn.max_tokens_per_turn=5", "data.max_response_length=76", "data.max_prompt_length=32",
        f"rollout.multi_turn.environment={environment}"])
    return RunInputs.open(config), config


def _partial(config, inputs: RunInputs) -> tuple[PartialRollouts, HFRollout]:
    engine = HFRollout(config.model.path, "float32")
    return PartialRollouts(config, inputs.tokenizer, inputs.rewards, inputs.train_data, inputs.sampler, engine), engine


def _update(engine: HFRollout, version: int) -> None:
    generator = torch.Generator().manual_seed(version)
    engine.begin_weight_update(version)
    engine.load_weights([(name, p.detach() + 0.2 * torch.randn(p.shape, generator=generator))
                         for name, p in engine.model.named_parameters()])
    engine.end_weight_update()


ENGINE_STEPS = 8
"""On version 0, before the save: past the first turns' cap of 5 tokens."""


def test_a_multi_turn_trajectory_in_flight_resumes_where_it_was(tiny_models, tmp_path, world_of_one):
    """Trajectories advance a model token an engine step within a turn; the environment answers each ended turn.
    Saved mid-flight, a new PartialRollouts replays the conversations into new environments and finishes the
    batch exactly as the one never interrupted, on weights updated after the save; an environment that answers
    the replay otherwise has its group generated anew."""
    environment = f"{__file__}:CountTurns"
    inputs, config = _multi_turn(tiny_models, tmp_path, environment)
    partial, engine = _partial(config, inputs)
    for _ in range(ENGINE_STEPS):
        partial.advance(step=2, version=0)
    saved = json.loads(json.dumps(partial.state_dict()))  # as a checkpoint holds it
    in_flight = [r for group in saved["in_flight"] for r in group["responses"] if r["finish_reason"] is None]
    assert any(r["turn"]["num_turns"] >= 1 for r in in_flight)  # answered turns to replay
    partial.pause(keep=False)
    _update(engine, 1)
    rollouts, indices, _ = partial.take(step=2, version=1)

    resumed_inputs, _ = _multi_turn(tiny_models, tmp_path, environment)
    resumed, resumed_engine = _partial(config, resumed_inputs)
    resumed.load_state_dict(saved)
    _update(resumed_engine, 1)
    again, again_indices, metrics = resumed.take(step=2, version=1)
    assert again_indices == indices and metrics["rollout/restarted_groups"] == 0
    for column in ("response_ids", "rollout_logprobs", "token_versions", "loss_masks", "scores", "trajectory_stats"):
        assert getattr(again, column) == getattr(rollouts, column), column
    assert [p.prompt_ids for p in again.prompts] == [p.prompt_ids for p in rollouts.prompts]

    # What was trained on: the environment's answers out of the loss, each model turn within its cap, and
    # trajectories begun on version 0 and finished on version 1.
    spanning = 0
    for ids, mask, versions, turns in zip(rollouts.response_ids, rollouts.loss_masks, rollouts.token_versions,
                                          rollouts.trajectory_stats["turns"]):
        runs = [len(list(run)) for model, run in itertools.groupby(mask) if model]
        assert len(runs) == turns and max(runs) <= 5 and mask[-1] == 1
        answers = inputs.tokenizer.decode([token for token, model in zip(ids, mask) if not model])
        assert [f"turn {k}" in answers for k in (1, 2)] == [turns > 1, turns > 2], answers
        spanning += versions[0] == 0 and versions[-1] == 1
    assert spanning >= 1

    # An environment that cannot replay: its group starts again from the prompt.
    inputs, config = _multi_turn(tiny_models, tmp_path, f"{__file__}:AnswerDifferentlyOnReplay")
    partial, _ = _partial(config, inputs)
    for _ in range(ENGINE_STEPS):
        partial.advance(step=2, version=0)
    saved = json.loads(json.dumps(partial.state_dict()))
    resumed, _ = _partial(config, _multi_turn(tiny_models, tmp_path, f"{__file__}:AnswerDifferentlyOnReplay")[0])
    resumed.load_state_dict(saved)
    answered = {group["index"] for group in saved["in_flight"]
                if any(r["turn"]["num_turns"] and r["finish_reason"] is None for r in group["responses"])}
    assert answered and resumed.restarted == len(answered) and set(resumed.waiting[:len(answered)]) == answered
