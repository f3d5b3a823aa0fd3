"""bench/async_cost_model.py in its limiting case: no tail, no sync cost, no fixed costs, decode
compute-bound. Then overlapping generation with training gains exactly what the arithmetic says,
computed here by hand from the FLOPs, and partial rollouts (simulated response by response) generate
each step's groups together, as a whole batch does. Then how the simulation trains a long group within the
staleness bound, and its KV recomputation, traced by hand on a workload of scripted lengths."""

from dataclasses import dataclass, field

import pytest

from bench.async_cost_model import (
    SCHEDULES,
    Cluster,
    Efficiency,
    Gpu,
    Model,
    Pricing,
    ResponseLengths,
    Workload,
    simulate_partial_rollouts,
    step,
)


def test_no_tail_no_sync_overlap_gain_is_the_arithmetic():
    model = Model("tiny", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                  ffn_hidden_size=128, vocab_size=100)
    peak, free = 1e12, 1e30  # links and HBM so fast that only FLOPs cost time
    gpu = Gpu("compute only", bf16_flops=peak, hbm_bytes_per_s=free, memory_bytes=1e12, nvlink_bytes_per_s=free,
              network_bytes_per_s=free)
    efficiency = Efficiency(decode_flops=0.5, hbm=1.0, iteration_overhead_s=0.0, prefill_mfu=0.5, train_mfu=0.25,
                            colocated_switch_s=0.0, engine_load_s=0.0, link=1.0)
    length, prompts, samples, gpus = 100, 16, 4, 16
    workload = Workload(prompts, samples, prompt_length=0, responses=ResponseLengths(length, 0.0, 1000))
    pricing = Pricing(model, workload, Cluster(gpu, gpus), efficiency)

    h, q, kv, f, v, layers = 64, 64, 32, 128, 100, 2
    matmul = layers * (h * q + 2 * h * kv + q + 2 * kv + q * h + 3 * h * f + 2 * h) + h + v * h
    sequences = prompts * samples

    def generate(num_gpus):  # each engine (one GPU) decodes its sequences together, context 0 -> length
        batch = sequences // num_gpus
        flops = 2 * matmul * batch * length + 2 * layers * q * batch * length**2  # attention integrated over context
        return flops / (peak * 0.5)

    def train(num_gpus):  # 3 forward passes of every sequence, causal attention over half its length
        flops = 3 * sequences * length * (2 * matmul + 4 * layers * q * length / 2)
        return flops / (num_gpus * peak * 0.25)

    scoring = train(gpus) / 3  # the old log-probs' forward pass
    assert step(pricing, SCHEDULES[0], 0).seconds == pytest.approx(generate(gpus) + scoring + train(gpus), rel=1e-9)
    assert step(pricing, SCHEDULES[1], 0).seconds == pytest.approx(generate(gpus) + train(gpus), rel=1e-9)
    half = gpus // 2
    assert step(pricing, SCHEDULES[2], half).seconds == pytest.approx(
        generate(half) + train(half) / 3 + train(half), rel=1e-9)
    for schedule in SCHEDULES[3:]:  # staleness 1 and 2, whole batches and partial: no tail to hide
        trainer = train(half) * (4 / 3 if schedule.recompute_old_logprobs else 1)
        split = step(pricing, schedule, half)
        assert split.rollout_busy == pytest.approx(generate(half), rel=1e-9), schedule.name
        assert split.seconds == pytest.approx(max(generate(half), trainer), rel=1e-9), schedule.name


@dataclass(frozen=True)
class ScriptedLengths(ResponseLengths):
    """The lengths of `script` in order, then 1 for every response after them."""

    script: list[int] = field(default_factory=list)

    def draw(self, rng) -> int:
        return self.script.pop(0) if self.script else 1


@pytest.mark.parametrize("staleness, keep_kv, recomputed", [
    (1, False, None),  # the long group is trained at batch 2, before any sync
    (2, False, 4),  # it continues at batch 3 (its 4 tokens' cache recomputed after the sync), trained there
    (2, True, None),  # kept in the engine through the sync: nothing to recompute
])
def test_partial_rollouts_train_a_long_group_by_its_last_batch(staleness, keep_kv, recomputed):
    # One engine, 2 groups of one response in flight, 2 trained per batch: the first response (group A) runs
    # 100 tokens, every other one 1. Every group is admitted on version 0 until batch 3, so its last batch is
    # 1 + staleness. Batch 1 trains the two 1-token groups that finish at iterations 1 and 2; A pauses with 2
    # tokens. At staleness 1 batch 2 must take A: one short group is admitted beside it (a second could not be
    # trained in time), and the engine runs A alone to its end. At staleness 2 batch 2 trains two more short
    # groups and A pauses with 4 tokens; batch 3 (version 1) must take A, continued after the sync (its KV
    # cache of the prompt and 4 tokens recomputed, unless kept), and short groups are admitted beside it until
    # they fill the rest of batches 3 and 4. Either way 8 groups are trained in 4 batches, A among them.
    model = Model("tiny", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                  ffn_hidden_size=128, vocab_size=100)
    gpu = Gpu("any", bf16_flops=1e12, hbm_bytes_per_s=1e12, memory_bytes=1e12, nvlink_bytes_per_s=1e12,
              network_bytes_per_s=1e12)
    prompt = 10
    workload = Workload(prompts=2, samples=1, prompt_length=prompt,
                        responses=ScriptedLengths(median=1, sigma=0.0, max_length=100, script=[100]))
    pricing = Pricing(model, workload, Cluster(gpu, 1), Efficiency())
    steps = simulate_partial_rollouts(pricing, num_gpus=1, staleness=staleness, keep_kv=keep_kv, steps=4, warmup=0)
    assert steps.trained_length == (100 + 7) / 8
    expected = pricing.prefill_seconds([prompt + recomputed]) / 4 if recomputed else 0.0
    assert steps.recompute_seconds == pytest.approx(expected, rel=1e-12)
