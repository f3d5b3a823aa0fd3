"""Per-rank memory of a ~100M-parameter model's GRPO steps at TP1, TP2, PP2, DP2 and TP2xPP2, by category.

    python bench/memory_scaling.py [--steps 3]

Each layout is one torchrun launch of the real trainer (`RLTrainer`, configs/quickstart.yaml's GRPO
with overrides: fp32, the distributed optimizer, colocated vLLM engines at TP_r=1, one per rank) on
a Qwen2 of h768, 12 layers, GQA 12/4, ffn 3072, untied (104M parameters; the character tokenizer
makes the embeddings negligible). After the steps, every rank reports, in bytes:

- params, grads, optimizer: the distinct storages behind the actor's parameters, its gradient
  buffers and its optimizer state (main parameters, Adam moments), as `MemoryPhases` finds them
  for offload (a storage seen as a parameter counts once, as a parameter);
- activations: the peak RSS during the last step's forward-backward (megatron's pipeline schedule
  over this rank's micro-batches), minus the RSS when it began. Allocations of 64 KiB or more are
  mmap'd (`MALLOC_MMAP_THRESHOLD_`), so freed tensors leave RSS at once and the peak follows live
  tensors: activations, logits, the log-prob kernel's chunks and backward's transient gradients;
- batch held: the step's batch as the trainer hands it to the actor (tokens, lengths and every
  response-aligned tensor); batch share: the rows of it this rank's engine computes on (its DP
  share: the sequences of its micro-batches), which is what a rank holds once batches are DP-owned;
- engine weights: the bytes of the HF tensors the vLLM engine loads in one weight sync (vLLM on CPU
  repacks linear weights into oneDNN handles that hold them out of torch's sight, so its parameters
  cannot be counted as tensors); engine KV cache: the storages of its KV cache tensors, read on its
  worker.

Ratios are to the TP1 run. Targets: params + grads within 10% of 1/(TP*PP), optimizer state within 10%
of 1/(TP*PP*DP) (the distributed optimizer shards it over DP), and the batch within 10% of 1/DP (the
share, and the batch held, which today's trainer keeps whole on every rank). The paper model of
Llama-2 70B PPO (bench/memory_model.py) follows, with the bytes per parameter measured here beside
the ones it assumes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LAYOUTS = {"TP1": (1, 1, 1), "TP2": (2, 1, 2), "PP2": (1, 2, 2), "DP2": (1, 1, 2), "TP2xPP2": (2, 2, 4)}
"""name: (TP, PP, processes); DP = processes / (TP * PP)."""
MODEL_ARGS = ["--family", "qwen2", "--hidden-size", "768", "--ffn-hidden-size", "3072", "--num-layers", "12",
              "--num-heads", "12", "--num-kv-heads", "4", "--no-tied", "--max-shard-size", "200MB"]
PROMPTS, SAMPLES, MAX_RESPONSE, MICRO_BATCH = 8, 2, 16, 4
CATEGORIES = ("params", "grads", "optimizer", "activations", "batch_held", "batch_share", "engine_weights",
              "engine_kv_cache")


# ---- worker (one per rank, inside torchrun) ---------------------------------------------------------

def peak_rss_bytes() -> int:
    """The process's peak resident set since the last reset (VmHWM, Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: this benchmark needs Linux")


def batch_bytes(batch) -> int:
    tensors = [batch.tokens_BT, batch.prompt_lengths_B, batch.response_lengths_B,
               *batch.response_tensors.present().values()]
    return sum(t.nbytes for t in tensors)


def _kv_cache_bytes(worker) -> int:
    """The vLLM worker's KV cache storages (runs on the worker, through collective_rpc)."""
    caches = {}
    for cache in worker.model_runner.kv_caches:
        for tensor in cache if isinstance(cache, (list, tuple)) else [cache]:
            caches[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
    return sum(caches.values())


class Probe:
    """Watches the actor's training schedule (activation peak, batch held and this rank's share) and
    the rollout engine's weight loads."""

    def __init__(self, actor, engine):
        self.measured: dict[str, int] = {}
        run_schedule, update, load_weights = actor._run_schedule, actor.update, engine.load_weights

        def probed_load_weights(weights):
            def counted():
                for name, tensor in weights:
                    self.measured["engine_weights"] += tensor.nbytes
                    yield name, tensor

            return load_weights(counted())

        def probed_begin_weight_update(step, begin=engine.begin_weight_update):
            self.measured["engine_weights"] = 0
            return begin(step)

        def probed_update(batch, *args, **kwargs):
            self.measured["batch_held"] = batch_bytes(batch)
            return update(batch, *args, **kwargs)

        def probed_schedule(batch, micro, loss_func, forward_only):
            if forward_only:
                return run_schedule(batch, micro, loss_func, forward_only)
            import psutil

            self.measured["batch_share"] = batch_bytes(batch.select(sorted(i for m in micro for i in m)))
            self.measured["process_peak_rss"] = max(self.measured.get("process_peak_rss", 0), peak_rss_bytes())
            Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
            start = psutil.Process().memory_info().rss
            result = run_schedule(batch, micro, loss_func, forward_only)
            self.measured["activations"] = peak_rss_bytes() - start
            return result

        actor.update, actor._run_schedule = probed_update, probed_schedule
        engine.load_weights, engine.begin_weight_update = probed_load_weights, probed_begin_weight_update


def worker(steps: int, overrides: list[str]) -> None:
    from megarl.tracking.console import quiet_third_party_logs

    quiet_third_party_logs()
    import torch
    import torch.distributed as dist

    from megarl.distributed import finish_process
    from megarl.trainer.rl_trainer import RLTrainer
    from megarl.trainer.startup import start_run

    torch.set_num_threads(1)
    trainer = RLTrainer(start_run(overrides, rl=True))
    probe = Probe(trainer.actor, trainer.placement.policy.engine)
    for step in range(1, steps + 1):
        trainer.step(step)
    report = {**trainer.actor.memory.resident_bytes(), **probe.measured,
              "engine_kv_cache": trainer.placement.policy.engine.llm.collective_rpc(_kv_cache_bytes)[0],
              "process_peak_rss": max(probe.measured["process_peak_rss"], peak_rss_bytes()),
              "num_params": sum(p.numel() for p in trainer.actor.module.parameters()),
              "rank": dist.get_rank(), "layout": str(trainer.layout)}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print("MEMORY " + json.dumps(reports), flush=True)
    trainer.placement.shutdown()
    finish_process()


# ---- driver -----------------------------------------------------------------------------------------

def overrides(model: Path, data: tuple[str, str], out: Path, tp: int, pp: int, steps: int) -> list[str]:
    return ["--config", "configs/quickstart.yaml", f"model.path={model}", f"data.train_files=[{data[0]}]",
            "data.val_files=[]", f"actor.tp={tp}", f"actor.pp={pp}", f"trainer.output_dir={out}",
            f"trainer.checkpoint_dir={out}/checkpoints", "trainer.experiment_name=memory_scaling",
            f"trainer.total_steps={steps}", "trainer.loggers=[console]", f"data.train_batch_size={PROMPTS}",
            f"rollout.n={SAMPLES}", f"data.max_response_length={MAX_RESPONSE}",
            f"actor.ppo_mini_batch_size={PROMPTS}", f"actor.micro_batch_size_per_rank={MICRO_BATCH}"]


def ensure_model(root: Path) -> Path:
    import subprocess

    model = root / "outputs/bench/qwen2_100m"
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "checkpoints_tools/make_tiny_model.py", "--out", str(model), *MODEL_ARGS],
                       cwd=root, check=True, capture_output=True)
    return model


def size(category: str, nbytes: float) -> str:
    """MiB, or KiB for the (small) batch."""
    return f"{nbytes / 2**10:9.1f}" if category.startswith("batch") else f"{nbytes / 2**20:9.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="RL steps per layout (activations: the last one)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        return worker(args.steps, rest)

    from common import ROOT, launch, torchrun

    from megarl.data.synthetic import make_arithmetic

    import common

    common.WORKER_ENV["MALLOC_MMAP_THRESHOLD_"] = "65536"  # see "activations" above
    model = ensure_model(ROOT)
    out = ROOT / "outputs/bench/memory_scaling"
    data = make_arithmetic(256, 16, seed=0, out_dir=out / "data")
    results = {}
    for name in args.layouts:
        tp, pp, nproc = LAYOUTS[name]
        command = torchrun(nproc) + [__file__, "--worker", "--steps", str(args.steps),
                                     *overrides(model, data, out / name, tp, pp, args.steps)]
        results[name] = launch(command, "MEMORY")
    print_table(results, model)
    print_check_of_paper_model(results)


def print_table(results: dict, model: Path) -> None:
    base = results["TP1"][0]
    print(f"model {model.name} ({json.loads((model / 'config.json').read_text())['num_hidden_layers']} layers), "
          f"fp32, GRPO {PROMPTS} prompts x {SAMPLES} samples, <= {MAX_RESPONSE} response tokens, "
          f"micro-batches of {MICRO_BATCH}; MiB per rank, KiB for the batch (ratio to TP1)")
    print(f"{'layout':>8} {'rank':>4} " + " ".join(f"{c:>18}" for c in CATEGORIES) + f" {'process peak':>12}")
    verdicts = []
    for name, reports in results.items():
        tp, pp, nproc = LAYOUTS[name]
        dp = nproc // (tp * pp)
        for report in reports:
            cells = [f"{size(c, report[c])} ({report[c] / base[c]:5.2f})" for c in CATEGORIES]
            print(f"{name:>8} {report['rank']:>4} " + " ".join(cells) + f" {size('', report['process_peak_rss'])}")
            model_state = report["params"] + report["grads"]
            verdicts.append((name, report["rank"], "params+grads", model_state / (base["params"] + base["grads"]),
                             1 / (tp * pp)))
            verdicts.append((name, report["rank"], "optimizer", report["optimizer"] / base["optimizer"],
                             1 / (tp * pp * dp)))
            verdicts.append((name, report["rank"], "batch share", report["batch_share"] / base["batch_share"], 1 / dp))
            verdicts.append((name, report["rank"], "batch held", report["batch_held"] / base["batch_held"], 1 / dp))
    print("layouts as built: " + ", ".join(f"{name} = {reports[0]['layout']}" for name, reports in results.items()))
    for category in ("params+grads", "optimizer", "batch share", "batch held"):
        rows = [(name, rank, ratio, target) for name, rank, c, ratio, target in verdicts if c == category]
        worst = max(rows, key=lambda row: abs(row[2] / row[3] - 1))
        met = all(abs(ratio / target - 1) <= 0.10 for _, _, ratio, target in rows)
        print(f"{category}: worst {worst[0]} rank {worst[1]} ratio {worst[2]:.3f} vs target {worst[3]:.3f} "
              f"(within 10% everywhere: {'met' if met else 'MISSED'})")


def print_check_of_paper_model(results: dict) -> None:
    """The 70B table, and the bytes per parameter it assumes against those measured here (fp32)."""
    import memory_model

    print("\nbytes per parameter this rank holds, measured (fp32 weights: no separate main parameters):")
    for name, reports in results.items():
        tp, pp, nproc = LAYOUTS[name]
        dp = nproc // (tp * pp)
        for report in reports:
            per_param = {c: report[c] / report["num_params"] for c in ("params", "grads", "optimizer")}
            print(f"  {name:>8} rank {report['rank']}: " + ", ".join(f"{c} {v:.3f}" for c, v in per_param.items())
                  + f" (memory model at fp32: 4, 4, {memory_model.ADAM_BYTES / dp:g})")
    print("the 70B model takes bf16 weights (2), fp32 gradients (4) and fp32 main parameters + Adam "
          f"({memory_model.MAIN_PARAM_BYTES} + {memory_model.ADAM_BYTES}) / DP, each divided over TP x PP "
          "as measured above\n")
    memory_model.main()


if __name__ == "__main__":
    main()
