"""Resharding and colocated rollout on CPU: a ~30M-parameter Qwen2 at TP2xPP2 -> vLLM engines at TP_r.

    python bench/resharding.py [--engine-tp 2]

Prints, measured in one run on this machine:
- resharding time per sync (split into moving bytes and vLLM's own weight processing),
- bytes moved / lower bound (target 1.00),
- transfer time / one all-gather of the same bytes on the same 4 ranks (target <= 1.5),
- peak extra memory / bucket size: the bytes a rank allocates for one bucket (its engine shards and
  staging copies), as counted where they are allocated (target: at most one bucket, or the plan's
  largest bucket where a single decoder layer or global tensor exceeds one),
- megarl rollout tokens/s / standalone vLLM tokens/s on the same prompts (target >= 0.95): both in
  one process each, the same engine settings and sampling seeds.
The sync measurements are also written to outputs/bench/resharding.json for the cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from common import BENCH_MODEL as MODEL, ROOT, ensure_bench_model, launch, torchrun

NUM_PROMPTS, NEW_TOKENS = 32, 64
RESULTS = ROOT / "outputs/bench/resharding.json"  # read by bench/resharding_cost_model.py


def prompts() -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randint(5, 100, (16,), generator=generator).tolist() for _ in range(NUM_PROMPTS)]


def sampling():
    from megarl.rollout.base import Sampling

    return Sampling(temperature=1.0, max_tokens=NEW_TOKENS, seed=11)


def sync_worker(bucket_mib: int, engine_tp: int) -> None:
    """Under torchrun (4 processes, TP2xPP2): time syncs and an all-gather of the same bytes."""
    import torch
    import torch.distributed as dist

    from megarl.config.schema import EngineConfig, ModelConfig
    from megarl.distributed import finish_process, init_layout
    from megarl.engine.megatron_engine import MegatronEngine
    from megarl.resharding.executor import WeightSync
    from megarl.rollout.vllm_backend import VLLMRollout

    layout = init_layout(tp=2, pp=2)
    actor = MegatronEngine(layout, ModelConfig(path=str(MODEL)), EngineConfig())
    engine = VLLMRollout(str(MODEL), "float32", engine_tp, max_model_len=256, kv_cache_bytes=64 << 20,
                         gpu_memory_utilization=0.3, seed=0)
    sync = WeightSync(actor.module, actor.arch, layout, engine, engine_tp=engine_tp, bucket_bytes=bucket_mib << 20)
    sync.sync(step=0)  # warm-up
    runs = [sync.sync(step=s) for s in range(1, 4)]
    received = torch.tensor([runs[-1].bytes_received], dtype=torch.float64)
    dist.all_reduce(received, op=dist.ReduceOp.MAX)
    # One all-gather in which every rank receives as many bytes as the busiest rank did in a sync.
    per_rank = int(received.item()) // 4 // (dist.get_world_size() - 1)
    chunk = torch.ones(per_rank)
    out = torch.empty(per_rank * dist.get_world_size())
    dist.all_gather_into_tensor(out, chunk)
    start = time.perf_counter()
    for _ in range(3):
        dist.all_gather_into_tensor(out, chunk)
    gather_seconds = (time.perf_counter() - start) / 3
    stats = {
        "seconds": sum(r.seconds for r in runs) / len(runs),
        "load_seconds": sum(r.load_seconds for r in runs) / len(runs),
        "bytes_received": runs[-1].bytes_received,
        "lower_bound": runs[-1].lower_bound,
        "peak_extra_bytes": max(r.peak_extra_bytes for r in runs),
        "largest_bucket_bytes": sync.largest_bucket_bytes,
        "all_gather_seconds": gather_seconds,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    if dist.get_rank() == 0:
        print("SYNC " + json.dumps(gathered), flush=True)
    engine.shutdown()
    finish_process()


def rollout_worker(kind: str) -> None:
    """One process: tokens/s of megarl's rollout (after a sync) or of a plain `vllm.LLM`."""
    from megarl.rollout.vllm_backend import VLLMRollout

    if kind == "megarl":
        from megarl.config.schema import EngineConfig, ModelConfig
        from megarl.distributed import finish_process, init_layout
        from megarl.engine.megatron_engine import MegatronEngine
        from megarl.resharding.executor import WeightSync

        layout = init_layout()
        actor = MegatronEngine(layout, ModelConfig(path=str(MODEL)), EngineConfig())
        engine = VLLMRollout(str(MODEL), "float32", 1, max_model_len=256, kv_cache_bytes=64 << 20,
                             gpu_memory_utilization=0.3, seed=0)
        WeightSync(actor.module, actor.arch, layout, engine, engine_tp=1, bucket_bytes=64 << 20).sync(step=1)
        generate = engine.generate
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=str(MODEL), dtype="float32", enforce_eager=True, max_model_len=256,
                  kv_cache_memory_bytes=64 << 20, seed=0, logprobs_mode="processed_logprobs")

        def generate(batch, s):
            params = [SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens, seed=s.seed + i, logprobs=0)
                      for i in range(len(batch))]
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
            return [len(o.outputs[0].token_ids) for o in outputs]

    generate(prompts()[:2], sampling())  # warm-up
    start = time.perf_counter()
    result = generate(prompts(), sampling())
    seconds = time.perf_counter() - start
    tokens = sum(map(len, result.response_ids)) if kind == "megarl" else sum(result)
    print("ROLLOUT " + json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)
    if kind == "megarl":
        engine.shutdown()
        finish_process()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--engine-tp", type=int, default=1, choices=[1, 2, 4], help="TP_r of the synced engines")
    parser.add_argument("--worker", choices=["sync", "megarl", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "sync":
        return sync_worker(args.bucket_mib, args.engine_tp)
    if args.worker:
        return rollout_worker(args.worker)

    ensure_bench_model()
    ranks = launch(torchrun(4) + [__file__, "--worker", "sync", "--bucket-mib", str(args.bucket_mib),
                                  "--engine-tp", str(args.engine_tp)], "SYNC")
    megarl = launch(torchrun(1) + [__file__, "--worker", "megarl"], "ROLLOUT")
    standalone = launch([sys.executable, __file__, "--worker", "vllm"], "ROLLOUT")

    busiest = max(ranks, key=lambda r: r["bytes_received"])
    seconds = max(r["seconds"] for r in ranks)
    transfer = max(r["seconds"] - r["load_seconds"] for r in ranks)
    gather = max(r["all_gather_seconds"] for r in ranks)
    bucket = args.bucket_mib << 20
    print(f"model: {MODEL.name}, training TP2xPP2 (4 CPU processes) -> {4 // args.engine_tp} vLLM engines at "
          f"TP {args.engine_tp}, bucket {args.bucket_mib} MiB")
    print(f"resharding time per sync: {seconds:.3f} s (moving bytes {transfer:.3f} s, vLLM weight processing "
          f"{seconds - transfer:.3f} s)")
    ratio = busiest["bytes_received"] / busiest["lower_bound"]
    print(f"bytes moved / lower bound (busiest rank): {busiest['bytes_received']:,} / {busiest['lower_bound']:,} = "
          f"{ratio:.2f} (target 1.00: {'met' if ratio == 1 else 'MISSED'})")
    print(f"transfer time / all-gather of the same bytes: {transfer:.3f} / {gather:.3f} = {transfer / gather:.2f} "
          f"(target <= 1.5: {'met' if transfer / gather <= 1.5 else 'MISSED'}); whole sync / all-gather = "
          f"{seconds / gather:.2f}")
    peak = max(r["peak_extra_bytes"] for r in ranks)
    limit = max(bucket, ranks[0]["largest_bucket_bytes"])
    print(f"peak extra memory / bucket size (allocated per bucket, busiest rank): {peak / bucket:.4f} "
          f"({peak:,} bytes; target <= {limit / bucket:.4f}, one bucket or the largest unit: "
          f"{'met' if peak <= limit else 'MISSED'})")
    RESULTS.write_text(json.dumps({"ranks": ranks, "bucket_bytes": bucket, "transfer_seconds": transfer,
                                   "all_gather_seconds": gather, "seconds": seconds}, indent=1))
    ours, theirs = megarl["tokens"] / megarl["seconds"], standalone["tokens"] / standalone["seconds"]
    print(f"rollout tokens/s: megarl {ours:.0f} / standalone vLLM {theirs:.0f} = {ours / theirs:.2f} "
          f"(target >= 0.95: {'met' if ours / theirs >= 0.95 else 'MISSED'}); "
          f"{NUM_PROMPTS} prompts x {NEW_TOKENS} tokens")


if __name__ == "__main__":
    main()
