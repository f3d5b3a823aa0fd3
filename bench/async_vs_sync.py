"""Asynchronous GRPO on split placement against colocated synchronous GRPO, side by side in one run.

    python bench/async_vs_sync.py                  # 2 processes: colocated, split 1+1 at staleness 0, 1, 2
    python bench/async_vs_sync.py --nproc 2 4      # also 4 processes: colocated, split 2+2 at 0, 1, 2

The quick start's GRPO task (configs/quickstart.yaml: the tiny Qwen2 after its SFT warm start, made
as `make quickstart` makes it when missing; "a+b=" prompts, 16 x 8 samples a step, <= 8 response
tokens), the same seed and steps for every contender: colocated synchronous on every process
(`trainer.placement=colocated`), and split placement with half the processes training and half
generating (`trainer.placement=split rollout.num_ranks=N/2`) at `trainer.max_staleness` 0, 1 and 2.
Held-out greedy accuracy on the 500 test prompts before training, every --eval-every steps and at
the end; evaluation is outside the timed steps.

Per contender: tokens/s (response tokens trained, the loss's, over the seconds of the timed steps,
the first --warmup-steps left out), the trainer's wait for a batch (`timing/wait_for_rollout`), the
rollout ranks' idle time (`timing/rollout_idle`) and generation time (`timing/rollout_generate`; the
colocated run's `timing/rollout`) per step, the training seconds to the first evaluation at or above
--threshold, and the final accuracy; ratios against colocated synchronous at the same process count.
--override KEY=VALUE ... adds config overrides to every contender (e.g.
algorithm.rollout_correction.preset=token_tis). Every process runs one thread; each process count's logs,
mlflow stores and numbers (results.json) are in outputs/bench/async_vs_sync/<N>proc[_<overrides>]/.
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
    """One placement at one process count; `staleness` None: colocated synchronous."""

    nproc: int
    staleness: int | None

    @property
    def name(self) -> str:
        if self.staleness is None:
            return f"colocated {self.nproc}, sync"
        half = self.nproc // 2
        return f"split {half}+{half}, staleness {self.staleness}"

    @property
    def experiment(self) -> str:
        return f"colocated_{self.nproc}" if self.staleness is None else f"split_{self.nproc}_k{self.staleness}"

    def overrides(self) -> list[str]:
        if self.staleness is None:
            return ["trainer.placement=colocated"]
        return ["trainer.placement=split", f"rollout.num_ranks={self.nproc // 2}",
                f"trainer.max_staleness={self.staleness}"]


@dataclass
class Result:
    """One contender's run: per-step lists in step order (step 1 first)."""

    name: str
    nproc: int
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

    lines = [f"{'contender':26} {'steps':>5} {'tokens/s':>8} {'x sync':>6} {'wait s':>6} {'idle s':>6} "
             f"{'gen s':>6} {f'train s to {threshold:.0%}':>16} {'x sync':>6} {'final':>6} {'process s':>9}"]
    for result in results:
        reference = next(r for r in results if r.colocated and r.nproc == result.nproc)
        reached, reference_reached = result.seconds_to(threshold), reference.seconds_to(threshold)
        sooner = reference_reached[1] / reached[1] if reached and reference_reached else None
        to_threshold = f"{reached[1]:.0f} (step {reached[0]})" if reached else "not reached"
        lines.append(
            f"{result.name:26} {len(result.step_seconds):5} {result.tokens_per_second(warmup):8.0f} "
            f"{result.tokens_per_second(warmup) / reference.tokens_per_second(warmup):6.2f} "
            f"{number(mean_after(result.trainer_wait, warmup), 3):>6} "
            f"{number(mean_after(result.rollout_idle, warmup), 3):>6} "
            f"{number(mean_after(result.rollout_generate, warmup), 3):>6} {to_threshold:>16} "
            f"{number(sooner, 2):>6} {100 * result.accuracy[-1][1]:5.1f}% {result.wall_seconds:9.0f}")
    return lines


def run_contender(contender: Contender, model: Path, args: argparse.Namespace) -> Result:
    from common import torchrun

    directory = run_directory(contender.nproc, args.override)
    shutil.rmtree(directory / contender.experiment, ignore_errors=True)  # never read a previous run's metrics
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / f"{contender.experiment}.log"
    command = torchrun(contender.nproc) + [
        "launchers/train_ppo.py", "--config", "configs/quickstart.yaml", f"model.path={model}",
        f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.eval_every}",
        f"trainer.output_dir={directory}", f"trainer.experiment_name={contender.experiment}",
        *contender.overrides(), *args.override]
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
        contender.name, contender.nproc, colocated, history["timing/step"],
        [sequences * length for length in history["response_length/mean"]],
        [] if colocated else history["timing/wait_for_rollout"],
        [] if colocated else history["timing/rollout_idle"],
        history["timing/rollout" if colocated else "timing/rollout_generate"],
        history["val/score/mean"], wall_seconds)


def run_directory(nproc: int, overrides: list[str]) -> Path:
    """Where one process count's runs go; runs with overrides apart from the plain ones."""
    return OUT / "_".join([f"{nproc}proc", *overrides])


def report(results: list[Result], args: argparse.Namespace) -> None:
    print(f"\nGRPO on the quick start (16 prompts x 8 samples, <= 8 response tokens), {args.steps} steps, "
          f"1 thread per process{', ' + ' '.join(args.override) if args.override else ''}")
    print(f"tokens/s: response tokens trained over the seconds of the timed steps (first {args.warmup_steps} left "
          "out); wait s / idle s / gen s: mean seconds per step of the trainer's wait for a batch, the rollout "
          "ranks' idle time and their generation (colocated: its rollout phase); train s: training seconds, "
          "evaluation left out; x sync: against colocated synchronous at the same process count (tokens/s "
          "ratio; its seconds to the threshold over this one's); process s: the whole run, start-up included")
    print("\n".join(table(results, args.threshold, args.warmup_steps)))
    print("\nheld-out greedy accuracy (%):")
    steps = [s for s, _ in results[0].accuracy]
    print(f"  {'step':26} " + " ".join(f"{s:>5}" for s in steps))
    for result in results:
        print(f"  {result.name:26} " + " ".join(f"{100 * a:5.1f}" for _, a in result.accuracy))
    for nproc in args.nproc:
        (run_directory(nproc, args.override) / "results.json").write_text(
            json.dumps([asdict(r) for r in results if r.nproc == nproc], indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2], choices=[2, 4],
                        help="process counts to compare at (4 oversubscribes a 2-core machine)")
    parser.add_argument("--steps", type=int, default=300, help="RL steps of every contender")
    parser.add_argument("--eval-every", type=int, default=25, help="held-out evaluation period, in steps")
    parser.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the per-step numbers")
    parser.add_argument("--threshold", type=float, default=0.5, help="held-out greedy accuracy")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every contender, e.g. algorithm.rollout_correction.preset=token_tis")
    args = parser.parse_args()
    if args.steps <= args.warmup_steps:
        sys.exit(f"--steps {args.steps}: none left after --warmup-steps {args.warmup_steps}")
    from common import ensure_quickstart_model

    model = ensure_quickstart_model(OUT)
    cores = len(os.sched_getaffinity(0))
    results = []
    for nproc in args.nproc:
        if nproc > cores:
            print(f"note: {nproc} processes on {cores} cores: generation and training share the cores, so "
                  "overlapping them gains no compute here", flush=True)
        for contender in [Contender(nproc, None)] + [Contender(nproc, k) for k in STALENESS]:
            print(f"{contender.name}: {args.steps} steps ...", flush=True)
            results.append(run_contender(contender, model, args))
    report(results, args)


if __name__ == "__main__":
    main()
