"""Asynchronous GRPO on split placement against colocated synchronous GRPO, side by side in one run.

    python bench/async_vs_sync.py                  # 2 processes: colocated, split 1+1 at staleness 0, 1, 2
    python bench/async_vs_sync.py --nproc 2 4      # also 4 processes: colocated, split 2+2 at 0, 1, 2
    python bench/async_vs_sync.py --task long-tail --seeds 3   # long responses: colocated, split at 2, partial rollouts
    python bench/async_vs_sync.py --task agent             # multi-turn with the calculator: colocated, split, partial

The quick start's GRPO task (configs/quickstart.yaml: the tiny Qwen2 after its SFT warm start, made
as `make quickstart` makes it when missing; "a+b=" prompts, 16 x 8 samples a step, <= 8 response
tokens), the same seed and steps for every contender: colocated synchronous on every process
(`trainer.placement=colocated`), and split placement with half the processes training and half
generating (`trainer.placement=split rollout.num_ranks=N/2`) at `trainer.max_staleness` 0, 1 and 2.
Held-out greedy accuracy (the long-tailed task's: sampled at temperature 1) on the 500 test prompts
before training, every --eval-every steps and at the end; evaluation is outside the timed steps.

--task long-tail: the same task with responses of long-tailed length, as reasoning runs have (the quick start's
answers are all a few tokens long, which hides what asynchrony is for): the warm start (the quick start's, taught
by 100 more SFT steps) follows the sum with a log-normal number of dots (median 12, 10% over 64, 1% over 250, at
most 400; `bench/common.py`), and responses may be 416 tokens long. The reward reads the sum, so RL leaves the
lengths' tail as it is. Contenders: colocated synchronous, split at staleness 2, and split at staleness 2 with
partial rollouts.
--task agent: the agent quick start (configs/agent_quickstart.yaml: "a*b" answered with the calculator tool, 8
prompts x 8 trajectories of at most 3 model turns a step, the SFT warm start made as `make agent-quickstart`
makes it when missing; accuracy on 100 held-out prompts), where a trajectory's tool calls run between its turns.
Contenders: colocated synchronous, split at staleness 1 (whole trajectories) and split at staleness 2 with
partial rollouts. Trained tokens count the environment's tokens in
each trajectory too (they are in the sequence, out of the loss).
--seeds N runs every contender with trainer.seed 0 .. N-1 and prints, per contender, the mean training
seconds to the threshold and the final accuracy with their spread over the seeds. --keep-kv adds, after each
partial rollouts contender, the same with its requests kept in the engine through syncs (`rollout.keep_kv`).

Per contender: tokens/s (response tokens trained, the loss's, over the seconds of the timed steps,
the first --warmup-steps left out), the trainer's wait for a batch (`timing/wait_for_rollout`), the
rollout ranks' idle time (`timing/rollout_idle`) and generation time (`timing/rollout_generate`; the
colocated run's `timing/rollout`) per step, the training seconds to the first evaluation at or above
--threshold, and the final accuracy; ratios against colocated synchronous at the same process count.
--override KEY=VALUE ... adds config overrides to every contender (e.g. algorithm.rollout_correction.preset=none:
without the token weights the default gives the split contenders at staleness >= 1). Every process runs one
thread; each process count's logs, mlflow stores and numbers (results.json) are in
outputs/bench/async_vs_sync/<N>proc[_<overrides>]/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs/bench/async_vs_sync"
STALENESS = (0, 1, 2)


@dataclass(frozen=True)
class Contender:
    """One placement at one process count; `staleness` None: colocated synchronous; `partial`: partial rollouts
    (split placement), `keep_kv`: their requests kept in the engine through syncs; `seed`: trainer.seed (None:
    the config's)."""

    nproc: int
    staleness: int | None
    partial: bool = False
    seed: int | None = None
    keep_kv: bool = False

    @property
    def name(self) -> str:
        if self.staleness is None:
            return f"colocated {self.nproc}, sync"
        half = self.nproc // 2
        partial = (", partial" if self.partial else "") + (", KV kept" if self.keep_kv else "")
        return f"split {half}+{half}, staleness {self.staleness}{partial}"

    @property
    def experiment(self) -> str:
        name = f"colocated_{self.nproc}" if self.staleness is None else f"split_{self.nproc}_k{self.staleness}"
        return name + ("_partial" if self.partial else "") + ("_keepkv" if self.keep_kv else "") + (
            f"_seed{self.seed}" if self.seed is not None else "")

    def overrides(self) -> list[str]:
        seed = [f"trainer.seed={self.seed}"] if self.seed is not None else []
        if self.staleness is None:
            return ["trainer.placement=colocated", *seed]
        return ["trainer.placement=split", f"rollout.num_ranks={self.nproc // 2}",
                f"trainer.max_staleness={self.staleness}", f"rollout.partial={str(self.partial).lower()}",
                f"rollout.keep_kv={str(self.keep_kv).lower()}", *seed]


@dataclass
class Result:
    """One contender's run: per-step lists in step order (step 1 first)."""

    name: str
    nproc: int
    seed: int | None
    colocated: bool
    step_seconds: list[float]
    step_tokens: list[float]
    trainer_wait: list[float]
    """`timing/wait_for_rollout`; empty when colocated (no side waits for the other)."""
    rollout_idle: list[float]
    rollout_generate: list[float]
    accuracy: list[tuple[int, float]]
    """(step, held-out greedy accuracy), step 0 before training."""
    wall_seconds: float

    def tokens_per_second(self, warmup: int) -> float:
        return sum(self.step_tokens[warmup:]) / sum(self.step_seconds[warmup:])

    def seconds_to(self, threshold: float) -> tuple[int, float] | None:
        """(step, training seconds up to and including it, warm-up included) of the first evaluation
        after training began at or above `threshold`; None if none reached it."""
        step = next((s for s, accuracy in self.accuracy if s > 0 and accuracy >= threshold), None)
        return None if step is None else (step, sum(self.step_seconds[:step]))


def mean_after(values: list[float], warmup: int) -> float | None:
    return statistics.mean(values[warmup:]) if values[warmup:] else None


def table(results: list[Result], threshold: float, warmup: int) -> list[str]:
    """The comparison, one line per result, with ratios against the colocated result of the same
    process count: tokens/s over its, and its seconds to `threshold` over this one's (> 1: sooner)."""
    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"{'contender':40} {'steps':>5} {'tokens/s':>8} {'x sync':>6} {'wait s':>6} {'idle s':>6} "
             f"{'gen s':>6} {f'train s to {threshold:.0%}':>16} {'x sync':>6} {'final':>6} {'process s':>9}"]
    for result in results:
        reference = next(r for r in results if r.colocated and r.nproc == result.nproc and r.seed == result.seed)
        reached, reference_reached = result.seconds_to(threshold), reference.seconds_to(threshold)
        sooner = reference_reached[1] / reached[1] if reached and reference_reached else None
        to_threshold = f"{reached[1]:.0f} (step {reached[0]})" if reached else "not reached"
        lines.append(
            f"{result.name:40} {len(result.step_seconds):5} {result.tokens_per_second(warmup):8.0f} "
            f"{result.tokens_per_second(warmup) / reference.tokens_per_second(warmup):6.2f} "
            f"{number(mean_after(result.trainer_wait, warmup), 3):>6} "
            f"{number(mean_after(result.rollout_idle, warmup), 3):>6} "
            f"{number(mean_after(result.rollout_generate, warmup), 3):>6} {to_threshold:>16} "
            f"{number(sooner, 2):>6} {100 * result.accuracy[-1][1]:5.1f}% {result.wall_seconds:9.0f}")
    return lines


def run_contender(contender: Contender, model: Path, args: argparse.Namespace) -> Result:
    from common import torchrun

    directory = run_directory(contender.nproc, args)
    shutil.rmtree(directory / contender.experiment, ignore_errors=True)  # never read a previous run's metrics
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / f"{contender.experiment}.log"
    command = torchrun(contender.nproc) + [
        "launchers/train_ppo.py", "--config", TASKS[args.task].config, f"model.path={model}",
        f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.eval_every}",
        f"trainer.output_dir={directory}", f"trainer.experiment_name={contender.experiment}",
        *workload(args), *contender.overrides(), *args.override]
    start = time.perf_counter()
    with log.open("w") as file:
        status = subprocess.run(command, cwd=ROOT, stdout=file, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    if status.returncode != 0:
        sys.exit(f"{contender.name} failed (exit {status.returncode}); see {log}")
    return read_result(contender, directory, time.perf_counter() - start)


def read_result(contender: Contender, directory: Path, wall_seconds: float) -> Result:
    """A finished run's numbers from its mlflow store. Trained tokens are the responses' (the loss's
    tokens): the mean response length times the step's sequences."""
    import yaml

    from common import metric_history

    run = directory / contender.experiment
    config = yaml.safe_load((run / "config.yaml").read_text())
    sequences = config["data"]["train_batch_size"] * config["rollout"]["n"]
    history = metric_history(run / "mlflow.db", contender.experiment, extra=("response_length/mean",))
    colocated = contender.staleness is None
    return Result(
        contender.name, contender.nproc, contender.seed, colocated, history["timing/step"],
        [sequences * length for length in history["response_length/mean"]],
        [] if colocated else history["timing/wait_for_rollout"],
        [] if colocated else history["timing/rollout_idle"],
        history["timing/rollout" if colocated else "timing/rollout_generate"],
        history["val/score/mean"], wall_seconds)


@dataclass(frozen=True)
class Task:
    config: str
    description: str
    placements: tuple[tuple[int | None, bool], ...]
    """(staleness, partial rollouts) of each contender; None: colocated synchronous."""


TASKS = {
    "quickstart": Task("configs/quickstart.yaml", "the quick start (16 prompts x 8 samples, <= 8 response tokens)",
                       ((None, False), *((k, False) for k in STALENESS))),
    "long-tail": Task("configs/quickstart.yaml", "the long-tailed task (16 prompts x 8 samples, the answer "
                      "followed by dots of log-normal number)", ((None, False), (2, False), (2, True))),
    "agent": Task("configs/agent_quickstart.yaml", "the agent quick start (8 prompts x 8 trajectories, <= 3 model "
                  "turns with the calculator, <= 160 response tokens)", ((None, False), (1, False), (2, True))),
}


def workload(args: argparse.Namespace) -> list[str]:
    """The config overrides of the task beyond its config file: the long-tailed variant's."""
    from common import LONG_TAIL, LONG_TAIL_RESPONSE_LENGTH

    if args.task != "long-tail":
        return []
    # The KV cache holds every sequence of a step at full length, partial rollouts' groups in flight too.
    # Greedy decoding writes dots to the length limit (a dot is always the likeliest next token): validation samples.
    return [f"data.train_files=[{LONG_TAIL}/data/train.parquet]", f"data.val_files=[{LONG_TAIL}/data/test.parquet]",
            f"data.max_response_length={LONG_TAIL_RESPONSE_LENGTH}", "rollout.kv_cache_mib=256",
            "rollout.val_temperature=1.0"]


def contenders(nproc: int, args: argparse.Namespace) -> list[Contender]:
    seeds = range(args.seeds) if args.seeds else [None]
    return [Contender(nproc, k, partial, seed, keep_kv)
            for seed in seeds for k, partial in TASKS[args.task].placements
            for keep_kv in ([False, True] if partial and args.keep_kv else [False])]


def run_directory(nproc: int, args: argparse.Namespace) -> Path:
    """Where one process count's runs go; other tasks' and runs with overrides apart."""
    task = [] if args.task == "quickstart" else [args.task.replace("-", "_")]
    return OUT / "_".join([*task, f"{nproc}proc", *args.override])


def seed_summary(results: list[Result], threshold: float) -> list[str]:
    """Per contender over its seeds: mean training seconds to `threshold` (when every seed reached it), its
    ratio to colocated synchronous's at the same process count, and the final accuracy's mean and range."""
    lines = [f"{'contender':40} {'seeds':>5} {f'train s to {threshold:.0%}':>16} {'x sync':>6} {'final %':>8} "
             f"{'range':>11}"]
    names = list(dict.fromkeys((r.nproc, r.name) for r in results))

    def mean_seconds(nproc: int, name: str) -> float | None:
        reached = [r.seconds_to(threshold) for r in results if (r.nproc, r.name) == (nproc, name)]
        return None if None in reached else statistics.mean(seconds for _, seconds in reached)

    for nproc, name in names:
        runs = [r for r in results if (r.nproc, r.name) == (nproc, name)]
        finals = [100 * r.accuracy[-1][1] for r in runs]
        seconds = mean_seconds(nproc, name)
        reference = mean_seconds(nproc, next(n for p, n in names if p == nproc and n.startswith("colocated")))
        ratio = f"{reference / seconds:.2f}" if seconds and reference else "-"
        lines.append(f"{name:40} {len(runs):5} {'not all' if seconds is None else f'{seconds:.0f}':>16} "
                     f"{ratio:>6} {statistics.mean(finals):8.1f} {f'{min(finals):.1f}-{max(finals):.1f}':>11}")
    return lines


def report(results: list[Result], args: argparse.Namespace) -> None:
    print(f"\nGRPO on {TASKS[args.task].description}, {args.steps} steps, "
          f"1 thread per process{', ' + ' '.join(args.override) if args.override else ''}")
    print(f"tokens/s: response tokens trained over the seconds of the timed steps (first {args.warmup_steps} left "
          "out); wait s / idle s / gen s: mean seconds per step of the trainer's wait for a batch, the rollout "
          "ranks' idle time and their generation (colocated: its rollout phase); train s: training seconds, "
          "evaluation left out; x sync: against colocated synchronous at the same process count (tokens/s "
          "ratio; its seconds to the threshold over this one's); process s: the whole run, start-up included")
    print("\n".join(table(results, args.threshold, args.warmup_steps)))
    print("\nheld-out greedy accuracy (%):")
    steps = [s for s, _ in results[0].accuracy]
    print(f"  {'step':40} " + " ".join(f"{s:>5}" for s in steps))
    for result in results:
        seed = f" seed {result.seed}" if result.seed is not None else ""
        print(f"  {result.name + seed:40} " + " ".join(f"{100 * a:5.1f}" for _, a in result.accuracy))
    if args.seeds:
        print(f"\nover {args.seeds} seeds:")
        print("\n".join(seed_summary(results, args.threshold)))
    for nproc in args.nproc:
        (run_directory(nproc, args) / "results.json").write_text(
            json.dumps([asdict(r) for r in results if r.nproc == nproc], indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2], choices=[2, 4],
                        help="process counts to compare at (4 oversubscribes a 2-core machine)")
    parser.add_argument("--steps", type=int, default=300, help="RL steps of every contender")
    parser.add_argument("--eval-every", type=int, default=25, help="held-out evaluation period, in steps")
    parser.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the per-step numbers")
    parser.add_argument("--threshold", type=float, default=0.5, help="held-out greedy accuracy")
    parser.add_argument("--task", choices=TASKS, default="quickstart", help="the workload (module docstring)")
    parser.add_argument("--seeds", type=int, default=0, help="run every contender with trainer.seed 0 .. N-1 "
                        "(0: the config's seed, once)")
    parser.add_argument("--keep-kv", action="store_true",
                        help="a contender more for partial rollouts: the same with rollout.keep_kv=true")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every contender, e.g. algorithm.rollout_correction.preset=none")
    args = parser.parse_args()
    if args.steps <= args.warmup_steps:
        sys.exit(f"--steps {args.steps}: none left after --warmup-steps {args.warmup_steps}")
    from common import ensure_agent_model, ensure_long_tail_model, ensure_quickstart_model

    model = {"agent": ensure_agent_model, "long-tail": ensure_long_tail_model,
             "quickstart": ensure_quickstart_model}[args.task](OUT)
    cores = len(os.sched_getaffinity(0))
    results = []
    for nproc in args.nproc:
        if nproc > cores:
            print(f"note: {nproc} processes on {cores} cores: generation and training share the cores, so "
                  "overlapping them gains no compute here", flush=True)
        for contender in contenders(nproc, args):
            print(f"{contender.name}: {args.steps} steps ...", flush=True)
            results.append(run_contender(contender, model, args))
    report(results, args)


if __name__ == "__main__":
    main()
