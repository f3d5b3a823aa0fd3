"""bench/async_cost_model.py in its limiting case: no tail, no sync cost, no fixed costs, decode
compute-bound. Then overlapping generation with training gains exactly what the arithmetic says,
computed here by hand from the FLOPs, and partial rollouts (simulated response by response) generate
each step's groups together, as a whole batch does."""

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
