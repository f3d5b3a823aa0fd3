"""Where an RL step's time goes: the quick start's GRPO step, phase by phase, on 1 and 2 processes.

    python bench/step_profile.py [--nproc 1 2] [--shapes 16x8 8x8] [--steps 20] [--profile-steps 5] [--model 30m]
                                 [KEY=VALUE ...]

Each run is a torchrun launch of this file that builds the quick start's `RLTrainer` as
`launchers/train_ppo.py` does (configs/quickstart.yaml on the quick start's SFT checkpoint, made first as
`make quickstart` makes it when missing; a shape PxS overrides the prompts per step and the samples per
prompt; KEY=VALUE overrides come last (e.g. actor.max_token_len_per_rank=128; by default the token budget
takes a rank's whole share of these sizes in one micro-batch); `--model 30m` swaps in the benchmarks' ~30M
Qwen2 of bench/common.py, random weights, with bench/trl_vs_megarl.py's lengths: prompts <= 16, responses
<= 8 tokens) and calls its `step` directly, with one substitution: the trainer's `PhaseTimer` also opens a
`torch.profiler` range and, when asked, a cProfile of its own for each phase. Steps:

1. `--warmup` steps, not counted; then the start-up's objects are frozen out of the garbage collector's
   sight, as the trainer's loop does before its first step (`freeze_start_up_objects`);
2. `--steps` steps timed by the trainer's own phase timer, nothing else on: each phase's median and
   its share of the step, and the time between phases (the step's wall clock minus its phases);
3. `--profile-steps` steps under `torch.profiler`: each operator's self CPU time, attributed to the
   phase whose range encloses it;
4. `--profile-steps` steps under cProfile, one per phase: each Python function's self time
   (C functions such as torch's bindings included), and the self time of each source file's functions;
5. `--steps` weight syncs on their own, against their floor: a memcpy of the same weights (every
   training parameter copied into a buffer of its own) plus the weight processing the engine itself
   requires (the time inside its layers' `process_weights_after_loading`: on CPU, the oneDNN repack
   of every linear layer), measured during those syncs. Medians.

Profiling slows the step (Python-heavy phases most), so its milliseconds are for ranking costs
within a phase; the shares come from step 2. Rank 0's numbers are printed. Every process runs one
thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs/bench/step_profile"
RANGE = "megarl phase: "
MARKER = "STEP_PROFILE"
SMALL_PHASE = 0.02
"""Phases under this share of the step get their share only, not their top costs."""


def bench_phase_timer(python_profiles: dict[str, cProfile.Profile]):
    """The trainer's PhaseTimer, each phase also a profiler range and, while `python_profiles` is
    switched on, a cProfile of its own (phases never nest, so one is active at a time)."""
    import torch

    from megarl.tracking.timing import PhaseTimer

    class ProfiledPhaseTimer(PhaseTimer):
        python_on = False

        @contextlib.contextmanager
        def __call__(self, phase: str):
            profile = python_profiles.setdefault(phase, cProfile.Profile()) if self.python_on else None
            with super().__call__(phase), torch.profiler.record_function(RANGE + phase):
                if profile is not None:
                    profile.enable()
                try:
                    yield
                finally:
                    if profile is not None:
                        profile.disable()

    return ProfiledPhaseTimer


def operator_costs(events, steps: int) -> dict[str, dict]:
    """Per phase: ms per step inside its range, of which outside any operator, and the operators'
    self CPU ms per step with their calls per step."""
    phases: dict[str, dict] = defaultdict(
        lambda: {"ms": 0.0, "outside_ops_ms": 0.0, "ops": defaultdict(lambda: [0.0, 0])})
    for event in events:
        if event.name.startswith(RANGE):
            phase = phases[event.name.removeprefix(RANGE)]
            phase["ms"] += event.cpu_time_total / 1e3 / steps
            phase["outside_ops_ms"] += event.self_cpu_time_total / 1e3 / steps
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(RANGE):
            parent = parent.cpu_parent
        name = parent.name.removeprefix(RANGE) if parent is not None else "(outside the phases)"
        cost = phases[name]["ops"][event.name]
        cost[0] += event.self_cpu_time_total / 1e3 / steps
        cost[1] += 1 / steps
    return {name: {**phase, "ops": dict(phase["ops"])} for name, phase in phases.items()}


def short_function(key: tuple[str, int, str]) -> str:
    """'vllm/v1/core/sched/scheduler.py:201(schedule)' for a pstats key; C functions as pstats names them."""
    path, line, name = key
    if path == "~":
        return name
    for root in ("site-packages/", str(ROOT) + "/"):
        path = path.split(root, 1)[-1]
    return f"{path}:{line}({name})"


def python_costs(profiles: dict[str, cProfile.Profile], steps: int, top: int) -> dict[str, dict]:
    """Per phase: the `top` functions by self time, (name, self ms per step, calls per step), and the
    `top` source files by their functions' self time (C functions count apart, as "C functions")."""
    import pstats

    costs = {}
    for phase, profile in profiles.items():
        stats = pstats.Stats(profile).stats
        ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
        files = defaultdict(float)
        for key, (_, _, tottime, _, _) in stats.items():
            files["C functions" if key[0] == "~" else short_function(key).split(":")[0]] += tottime * 1e3 / steps
        costs[phase] = {"functions": [(short_function(key), tottime * 1e3 / steps, calls / steps)
                                      for key, (_, calls, tottime, _, _) in ranked],
                        "files": sorted(files.items(), key=lambda item: -item[1])[:top]}
    return costs


def sync_costs(trainer, syncs: int) -> dict[str, float]:
    """Median ms of a weight sync, of a memcpy of the weights it moves, and of the engine's own weight
    processing inside the sync (timed by wrapping each processing method the engine's layers use)."""
    import torch

    model = trainer.placement.policy.engine.llm.collective_rpc(lambda worker: worker.model_runner.model)[0]
    methods = {type(module.quant_method) for module in model.modules() if hasattr(module, "quant_method")}
    processing = []

    def timed(original):
        def process_weights_after_loading(self, layer):
            start = time.perf_counter()
            try:
                return original(self, layer)
            finally:
                processing[-1] += time.perf_counter() - start
        return process_weights_after_loading

    originals = {method: method.process_weights_after_loading for method in methods}
    for method, original in originals.items():
        method.process_weights_after_loading = timed(original)
    sync_seconds = []
    for step in range(syncs):
        processing.append(0.0)
        sync_seconds.append(trainer.placement.policy.sync.sync(10**6 + step).seconds)
    for method, original in originals.items():
        method.process_weights_after_loading = original
    params = [p.detach() for p in trainer.actor.module.parameters()]
    buffers = [torch.empty_like(p) for p in params]
    copy_seconds = []
    for _ in range(syncs):
        start = time.perf_counter()
        for buffer, param in zip(buffers, params):
            buffer.copy_(param)
        copy_seconds.append(time.perf_counter() - start)
    return {"sync": 1e3 * statistics.median(sync_seconds), "memcpy": 1e3 * statistics.median(copy_seconds),
            "processing": 1e3 * statistics.median(processing),
            "bytes": sum(p.numel() * p.element_size() for p in params)}


def worker(overrides: list[str], warmup: int, steps: int, profile_steps: int, top: int) -> None:
    import torch
    import torch.distributed as dist

    from megarl.distributed import finish_process
    from megarl.distributed.process import freeze_start_up_objects
    from megarl.tracking.console import quiet_third_party_logs

    quiet_third_party_logs()
    from megarl.trainer import rl_trainer
    from megarl.trainer.startup import start_run

    python_profiles: dict[str, cProfile.Profile] = {}
    timer_class = rl_trainer.PhaseTimer = bench_phase_timer(python_profiles)
    trainer = rl_trainer.RLTrainer(start_run(overrides, rl=True))
    step_numbers = iter(range(1, warmup + steps + 2 * profile_steps + 1))

    def timed_step() -> tuple[float, dict[str, float]]:
        dist.barrier()
        start = time.perf_counter()
        metrics = trainer.step(next(step_numbers))
        return time.perf_counter() - start, metrics

    for _ in range(warmup):
        timed_step()
    freeze_start_up_objects()  # as the trainer's loop does before its first step
    walls, phases = [], defaultdict(list)
    for _ in range(steps):
        wall, metrics = timed_step()
        walls.append(wall)
        for key, seconds in metrics.items():
            if key.startswith("timing/") and key != "timing/step":
                phases[key.removeprefix("timing/")].append(seconds)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(profile_steps):
            timed_step()
    operators = operator_costs(profiler.events(), profile_steps)
    timer_class.python_on = True
    for _ in range(profile_steps):
        timed_step()
    timer_class.python_on = False
    syncs = sync_costs(trainer, steps)
    if trainer.layout.rank == 0:
        print(MARKER + " " + json.dumps({
            "layout": str(trainer.layout), "walls": walls, "phases": phases, "operators": operators,
            "python": python_costs(python_profiles, profile_steps, top), "syncs": syncs}), flush=True)
    trainer.tracker.close()
    trainer.placement.shutdown()
    finish_process()


def run_logged(command: list[str], log: Path) -> str:
    """Run to completion with output to `log`, one thread per process; its output. Exits naming the log on failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    output = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    log.write_text(output.stdout + output.stderr)
    if output.returncode != 0:
        sys.exit(f"{' '.join(map(str, command))} failed (exit {output.returncode}); see {log}")
    return output.stdout


def profile_run(nproc: int, prompts: int, samples: int, args) -> dict:
    from common import ensure_bench_model, torchrun

    name = f"{args.model}_{prompts}x{samples}_{nproc}proc"
    overrides = ["--config", "configs/quickstart.yaml", f"data.train_batch_size={prompts}",
                 f"actor.ppo_mini_batch_size={prompts}",
                 f"rollout.n={samples}", f"trainer.total_steps={args.warmup + args.steps + 2 * args.profile_steps}",
                 f"trainer.output_dir={OUT}", f"trainer.experiment_name={name}", "trainer.loggers=[console]"]
    if args.model == "30m":
        overrides += [f"model.path={ensure_bench_model()}", "data.max_prompt_length=16", "data.max_response_length=8"]
    overrides += args.overrides
    command = torchrun(nproc) + [__file__, "--worker", json.dumps(overrides), "--warmup", str(args.warmup),
                                 "--steps", str(args.steps), "--profile-steps", str(args.profile_steps),
                                 "--top", str(args.top)]
    stdout = run_logged(command, OUT / f"{name}.log")
    line = next(line for line in stdout.splitlines() if line.startswith(MARKER + " "))
    return json.loads(line.removeprefix(MARKER + " ")) | {"name": name}


def report(result: dict, prompts: int, samples: int, nproc: int, args) -> None:
    walls = result["walls"]
    phase_ms = {phase: 1e3 * statistics.mean(values) for phase, values in result["phases"].items()}
    step_ms = 1e3 * statistics.mean(walls)
    between_ms = step_ms - sum(phase_ms.values())
    settings = " ".join(args.overrides) or "the default micro-batches"
    print(f"\n{args.model} model, {prompts} prompts x {samples} samples, {nproc} process{'es' if nproc > 1 else ''} "
          f"({result['layout']}, {settings}), rank 0: {len(walls)} steps after "
          f"{args.warmup} warm-up, step {step_ms:.1f} ms mean, {1e3 * statistics.median(walls):.1f} ms median")
    print(f"  {'phase':<16} {'ms mean':>8} {'median':>8} {'share':>6}")
    for phase, ms in phase_ms.items():
        median = 1e3 * statistics.median(result["phases"][phase])
        print(f"  {phase:<16} {ms:8.1f} {median:8.1f} {ms / step_ms:6.1%}")
    print(f"  {'between phases':<16} {between_ms:8.1f} {'':>8} {between_ms / step_ms:6.1%}")
    print(f"  top costs per phase, ms per step ({args.profile_steps} steps under torch.profiler, then "
          f"{args.profile_steps} under cProfile; both slow the step):")
    for phase, ms in sorted(phase_ms.items(), key=lambda item: -item[1]):
        if ms / step_ms < SMALL_PHASE:
            continue
        operators = result["operators"].get(phase, {"ms": 0.0, "outside_ops_ms": 0.0, "ops": {}})
        print(f"  {phase}: {operators['ms']:.1f} ms under torch.profiler, {operators['outside_ops_ms']:.1f} ms "
              f"of it outside torch operators")
        ranked = sorted(operators["ops"].items(), key=lambda item: -item[1][0])[:args.top]
        for name, (self_ms, calls) in ranked:
            print(f"    op  {self_ms:7.2f} ms {calls:7.0f} calls  {name}")
        python = result["python"].get(phase, {"functions": [], "files": []})
        for name, self_ms, calls in python["functions"]:
            print(f"    py  {self_ms:7.2f} ms {calls:7.0f} calls  {name}")
        print("    py by file: " + ", ".join(f"{name} {self_ms:.1f}" for name, self_ms in python["files"]))
    syncs = result["syncs"]
    floor = syncs["memcpy"] + syncs["processing"]
    print(f"  weight sync alone ({len(walls)} syncs, medians): sync {syncs['sync']:.2f} ms, memcpy of its "
          f"{syncs['bytes'] / 2**20:.1f} MiB of weights {syncs['memcpy']:.2f} ms, the engine's own weight processing "
          f"{syncs['processing']:.2f} ms: sync / (memcpy + processing) = {syncs['sync'] / floor:.2f} (target <= 3)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=["16x8", "8x8"], help="prompts x samples per prompt")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=6, help="costs listed per phase, of each kind")
    parser.add_argument("--model", choices=("1m", "30m"), default="1m",
                        help="1m: the quick start's SFT checkpoint; 30m: the benchmarks' ~30M Qwen2")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, after the bench's own")
    parser.add_argument("--worker", metavar="OVERRIDES_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker), args.warmup, args.steps, args.profile_steps, args.top)
    from common import ensure_quickstart_model

    ensure_quickstart_model(OUT)
    start = time.perf_counter()
    for prompts, samples in (map(int, shape.split("x")) for shape in args.shapes):
        for nproc in args.nproc:
            report(profile_run(nproc, prompts, samples, args), prompts, samples, nproc, args)
    print(f"\nwall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
