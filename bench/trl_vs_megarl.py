"""End to end against TRL: GRPO on the same task, checkpoint and settings, in one run on this machine.

    python bench/trl_vs_megarl.py                                   # everything, ~20-25 min on 2 cores
    python bench/trl_vs_megarl.py --sizes 1m --shapes 16x8 --steps 100 --timing-steps 20   # a quick look
    python bench/trl_vs_megarl.py --sizes 1m --shapes 8x8 --timing-steps 200 --rounds 3   # one cell, paired rounds

For every model size (--sizes) and step shape (--shapes, prompts x samples per step), three
contenders train GRPO from the same checkpoint with the same prompts per step, samples per prompt,
response length (<= 8 tokens), learning rate (constant), loss (token mean, no KL), precision
(--dtype: float32, or bfloat16 as in TRL's default bf16 autocast) and one optimizer step per batch:
TRL's `GRPOTrainer` in one process (HF generate; installed only in the bench environment .venv-bench,
created on first use from bench/requirements-trl.txt), megarl in one process and megarl in two
(torchrun, colocated vLLM). megarl runs configs/quickstart.yaml, which sets no engine tuning key: prompt
sharing, gradient buckets, micro-batches (a rank's whole share in one, as TRL's one batch, at the default
token budget) and the rest are the defaults a user's own config gets; the overrides below set only the
task, the step's shape and the settings above that both sides share.

Sizes: `1m`, the quick start's tiny Qwen2 (h128, 4 layers, head dim 32, 0.8M parameters) from the
quick start's SFT checkpoint; `30m`, the benchmarks' Qwen2 of bench/common.py (h512, 10 layers, GQA
8/4, 31M parameters), random weights (its responses are mostly full length: this size measures speed
only). Both use the character tokenizer and the quick start's synthetic "a+b=" data. The SFT checkpoint
and the data are made as `make quickstart` makes them when outputs/quickstart lacks them, and kept:
runs on other days and other code start from the same weights. (Made anew, the warm start moves with
the float rounding of the code that makes it: its 400 steps end half-way through the task's learning
transition, where the held-out accuracy of the same SFT on the same inputs was 14.6%, 34.4% and 43.2%
with three ways of rounding the same products and Adam updates; bench/README.md.)

The 1m model at the quick start's 16 x 8 runs --steps steps with held-out greedy accuracy every
--eval-every steps (the learning curves); every other combination runs --timing-steps steps
without evaluation, --rounds times: each round runs TRL, then megarl at 1 and 2 processes, and its ratios
compare these runs only, so that the machine's drift from round to round (its speed moves by up to 40%
within an hour) enters no ratio. The first --warmup-steps steps of every run are left out of its numbers.

Prints one table: s/step (median), tokens/s (prompt + response tokens of the timed steps over their seconds),
the ratio to TRL of the same size, shape and round, and the targets (issue 41: megarl at 2 processes >= 2.5x
TRL's tokens/s at 1 process everywhere; issue 19: megarl at 1 process >= TRL), after the machine's own ceiling
for 2 processes (how much more matmul work 2 single-thread processes do than 1); next to each 2-process ratio,
its ceiling: the 1-process ratio times that scaling, what 2 processes would reach if they scaled as the machine
does. With --rounds above 1, each ratio's median over the rounds follows. Then every contender's mean seconds
per phase and the learning curves. Everything is also written to outputs/bench/trl_vs_megarl/results.json.
Every process runs one thread (OMP_NUM_THREADS=1); the logs of every run are under
outputs/bench/trl_vs_megarl/<size>_<shape>_<dtype>/ (rounds after the first: <size>_<shape>_<dtype>_round<k>/).
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
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from common import QUICKSTART, ROOT, ensure_bench_model, ensure_quickstart_model, metric_history, torchrun

OUT = ROOT / "outputs/bench/trl_vs_megarl"
BENCH_ENV = ROOT / ".venv-bench"
REQUIREMENTS = ROOT / "bench/requirements-trl.txt"
RESPONSE_LENGTH, PROMPT_LENGTH, LR, SEED = 8, 16, 1e-4, 0
NUM_TEST = 500
SHAPES = {"16x8": (16, 8), "8x8": (8, 8)}
"""Prompts x samples per step: the quick start's, and issue 19's."""
TRL = "TRL GRPOTrainer"
PRECISION = {"float32": "float32 throughout",
             "bfloat16": "bfloat16 (TRL: bf16 autocast over fp32 weights, its default; megarl: bf16 weights, "
                         "fp32 main weights and gradients in the optimizer, bf16 vLLM)"}
"""--dtype: every contender's precision. TRL's GRPOConfig defaults to bf16 autocast; float32 turns it off."""
CURVE = ("1m", "16x8")
"""The quick start's size and shape: the one combination that also measures the learning curve."""


@dataclass(frozen=True)
class Size:
    description: str
    timing_steps: int
    """Steps of a timing run when --timing-steps is not given (a 30m step costs seconds)."""


SIZES = {"1m": Size("Qwen2 h128x4 layers, 0.8M parameters, SFT warm start", 100),
         "30m": Size("Qwen2 h512x10 layers GQA 8/4, 31M parameters, random weights", 12)}
TARGET_2PROC = 2.5
"""Issue 41's target: megarl at 2 processes over TRL at 1, tokens/s, at every size and shape, at the defaults."""
TARGET_1PROC = 1.0
"""Issue 19's target: megarl at 1 process over TRL at 1, tokens/s, at every size and shape."""


@dataclass
class Contender:
    size: str
    shape: str
    name: str
    nproc: int
    step_seconds: list[float]
    """Every step's seconds, warm-up steps included."""
    step_tokens: list[float]
    accuracy: list[tuple[int, float]]
    """(step, held-out greedy accuracy), step 0 before training; empty for a timing run."""
    wall_seconds: float
    phases: dict[str, float]
    """Mean seconds per phase over the timed steps."""
    warmup: int
    round: int
    """Which round of its size and shape (--rounds) it ran in; 0 for the first."""

    def seconds_per_step(self) -> float:
        return statistics.median(self.step_seconds[self.warmup:])

    def tokens_per_second(self) -> float:
        return sum(self.step_tokens[self.warmup:]) / sum(self.step_seconds[self.warmup:])

    def seconds_to(self, threshold: float) -> tuple[int, float] | None:
        """(step, training seconds, warm-up included) of the first evaluation at or above `threshold`."""
        step = next((s for s, accuracy in self.accuracy if s > 0 and accuracy >= threshold), None)
        return None if step is None else (step, sum(self.step_seconds[:step]))


def run(command: list[str], log: Path, env: dict | None = None) -> float:
    """Run to completion with output to `log`; the wall seconds. Exits naming the log on failure."""
    start = time.perf_counter()
    with log.open("w") as file:
        status = subprocess.run(command, cwd=ROOT, stdout=file, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {})))
    if status.returncode != 0:
        sys.exit(f"{' '.join(map(str, command))} failed (exit {status.returncode}); see {log}")
    return time.perf_counter() - start


def bench_python() -> Path:
    """The bench environment's interpreter (TRL beside CPU torch), installed when missing or stale."""
    python, stamp = BENCH_ENV / "bin/python", BENCH_ENV / ".installed"
    if not stamp.is_file() or stamp.stat().st_mtime < REQUIREMENTS.stat().st_mtime:
        print(f"installing the bench environment {BENCH_ENV} from {REQUIREMENTS.name} ...", flush=True)
        (ROOT / "outputs/bench").mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_ENV)], check=True)
        with (ROOT / "outputs/bench/bench_env_install.log").open("w") as log:
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(REQUIREMENTS)], check=True,
                           stdout=log, stderr=subprocess.STDOUT)
        stamp.touch()
    return python


@dataclass(frozen=True)
class Setting:
    """One size and shape, the steps to run and how often to evaluate (0: never)."""

    size: str
    shape: str
    model: Path
    data: Path
    steps: int
    eval_every: int
    warmup: int
    dtype: str
    round: int

    @property
    def prompts(self) -> int:
        return SHAPES[self.shape][0]

    @property
    def samples(self) -> int:
        return SHAPES[self.shape][1]

    @property
    def directory(self) -> Path:
        return OUT / (f"{self.size}_{self.shape}_{self.dtype}" + (f"_round{self.round + 1}" if self.round else ""))


def run_trl(setting: Setting) -> Contender:
    record = setting.directory / "trl.json"
    wall = run([str(bench_python()), "bench/trl_grpo_worker.py", "--model", str(setting.model),
                "--train", str(setting.data / "train.parquet"), "--test", str(setting.data / "test.parquet"),
                "--output", str(record), "--steps", str(setting.steps), "--eval-every", str(setting.eval_every),
                "--prompts-per-step", str(setting.prompts), "--samples", str(setting.samples),
                "--max-response-length", str(RESPONSE_LENGTH), "--lr", str(LR), "--seed", str(SEED),
                "--dtype", setting.dtype],
               setting.directory / "trl.log")
    result = json.loads(record.read_text())
    timed = slice(setting.warmup, None)
    generation = statistics.mean(result["generation_seconds"][timed])
    phases = {"generate+reward+advantage": generation,
              "forward+backward+optimizer": statistics.mean(result["step_seconds"][timed]) - generation}
    return Contender(setting.size, setting.shape, TRL, 1, result["step_seconds"],
                     result["step_tokens"], [tuple(a) for a in result["accuracy"]], wall, phases, setting.warmup,
                     setting.round)


def run_megarl(setting: Setting, nproc: int) -> Contender:
    name = f"megarl_{nproc}proc"
    run_directory = setting.directory / name
    shutil.rmtree(run_directory, ignore_errors=True)  # a previous run's checkpoints or metrics must not be reused
    validation = ([f"data.val_files=[{setting.data / 'test.parquet'}]", f"trainer.test_freq={setting.eval_every}"]
                  if setting.eval_every else ["data.val_files=[]"])
    wall = run(torchrun(nproc) + [
        "launchers/train_ppo.py", "--config", "configs/quickstart.yaml", f"model.path={setting.model}",
        f"data.train_files=[{setting.data / 'train.parquet'}]", *validation,
        f"data.train_batch_size={setting.prompts}", f"actor.ppo_mini_batch_size={setting.prompts}",
        f"rollout.n={setting.samples}", f"data.max_response_length={RESPONSE_LENGTH}",
        f"data.max_prompt_length={PROMPT_LENGTH}", f"model.dtype={setting.dtype}", f"actor.optim.lr={LR}",
        f"data.max_val_samples={NUM_TEST}",
        f"trainer.total_steps={setting.steps}", f"trainer.seed={SEED}",
        f"trainer.output_dir={setting.directory}", f"trainer.experiment_name={name}"],
        setting.directory / f"{name}.log")
    history = metric_history(run_directory / "mlflow.db", name)
    step_seconds, tokens = history.pop("timing/step"), history.pop("throughput/tokens")
    accuracy = history.pop("val/score/mean")
    phases = {key.removeprefix("timing/"): statistics.mean(values[setting.warmup:]) for key, values in history.items()}
    phases["between phases"] = statistics.mean(step_seconds[setting.warmup:]) - sum(phases.values())
    return Contender(setting.size, setting.shape, "megarl GRPO", nproc, step_seconds, tokens, accuracy, wall, phases,
                     setting.warmup, setting.round)


PROBE_MATMUL = (320, 512, 1536)
"""The probe's float32 matmul, (tokens, hidden) @ (hidden, ffn): about the 30m model's MLP in its update."""
PROBE_ROUNDS = 3
"""Alternating rounds of 1 and 2 processes; the probe takes medians (one window moves by 10% with the machine)."""


def two_process_scaling(seconds: float = 2.0) -> float:
    """Matmuls that 2 single-thread processes do at once over those of 1 alone, in the same seconds: how
    much the machine lets 2 processes gain over 1 (2.0 on two free cores), medians of PROBE_ROUNDS. Each
    process imports torch, then waits for a common start time, so that the timed windows coincide."""
    tokens, hidden, ffn = PROBE_MATMUL
    code = ("import sys, time, torch\n"
            f"a, b = torch.randn({tokens}, {hidden}), torch.randn({hidden}, {ffn})\n"
            "start = float(sys.argv[1])\n"
            "time.sleep(max(start - time.time(), 0))\n"
            f"count, end = 0, start + {seconds}\n"
            "while time.time() < end:\n"
            "    a @ b\n"
            "    count += 1\n"
            "print(count)\n")

    def matmuls(num_processes: int) -> int:
        start = str(time.time() + 6)  # after every process's import of torch
        processes = [subprocess.Popen([sys.executable, "-c", code, start], stdout=subprocess.PIPE, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1")) for _ in range(num_processes)]
        return sum(int(process.communicate()[0]) for process in processes)

    alone, together = zip(*((matmuls(1), matmuls(2)) for _ in range(PROBE_ROUNDS)))
    return statistics.median(together) / statistics.median(alone)


def target(nproc: int) -> float:
    return TARGET_2PROC if nproc == 2 else TARGET_1PROC


def partner(contenders: list[Contender], of: Contender, name: str, nproc: int) -> Contender | None:
    """The contender `name` at `nproc` processes of `of`'s size, shape and round."""
    return next((c for c in contenders if (c.size, c.shape, c.round, c.name, c.nproc)
                 == (of.size, of.shape, of.round, name, nproc)), None)


def report(contenders: list[Contender], threshold: float, dtype: str, scaling: float) -> None:
    print(f"\nGRPO on a+b=: <= {RESPONSE_LENGTH} response tokens, lr {LR:g} constant, token-mean loss, no KL, "
          f"one optimizer step per batch, {PRECISION[dtype]}, 1 thread per process")
    print(f"this machine: 2 single-thread processes do {scaling:.2f}x the float32 matmuls of 1 "
          f"({' x '.join(map(str, PROBE_MATMUL[:2]))} @ {' x '.join(map(str, PROBE_MATMUL[1:]))}, medians of "
          f"{PROBE_ROUNDS} rounds): what 2 processes can gain over 1 here (2.00 on two free cores)")
    print("s/step: median; tokens/s: prompt + response tokens over the seconds of the timed steps (warm-up left out); "
          "x TRL: tokens/s over TRL's at the same size, shape and round; process s: the whole run, start-up included")
    print("ceiling: a 2-process row's x TRL if its 2 processes gained over its 1 what the machine's do")
    print(f"{'size':5} {'shape':5} {'round':>5} {'contender':28} {'steps':>5} {'s/step':>7} {'tokens/s':>9} "
          f"{'x TRL':>6} {'ceiling':>7} {'target':>7} {'met':>4} {'process s':>9}")
    ratios = defaultdict(list)
    for c in contenders:
        trl, one = partner(contenders, c, TRL, 1), partner(contenders, c, c.name, 1)
        ratio = c.tokens_per_second() / trl.tokens_per_second()
        ceiling = (f"{scaling * one.tokens_per_second() / trl.tokens_per_second():7.2f}"
                   if c.nproc == 2 and one is not None else "")
        goal = "" if c is trl else f">={target(c.nproc):.1f}x"
        met = "" if c is trl else ("yes" if ratio >= target(c.nproc) else "NO")
        if c is not trl:
            ratios[c.size, c.shape, c.name, c.nproc].append(ratio)
        print(f"{c.size:5} {c.shape:5} {c.round + 1:5} {f'{c.name}, {c.nproc} proc':28} {len(c.step_seconds):5} "
              f"{c.seconds_per_step():7.3f} {c.tokens_per_second():9.0f} {ratio:6.2f} {ceiling:>7} {goal:>7} "
              f"{met:>4} {c.wall_seconds:9.0f}")
    repeated = {key: values for key, values in ratios.items() if len(values) > 1}
    if repeated:
        print("\nx TRL, median over the rounds (each round's ratio within the round):")
    for (size, shape, name, nproc), values in repeated.items():
        median = statistics.median(values)
        print(f"  {size:4} {shape:5} {name}, {nproc} proc: {median:.2f} (rounds: "
              f"{', '.join(f'{value:.2f}' for value in values)}; target >={target(nproc):.1f}x: "
              f"{'met' if median >= target(nproc) else 'NO'})")
    print("\nmean seconds per phase over the timed steps (megarl: its phase timer, and the time between its phases;"
          " TRL: its _generate_and_score_completions, and the rest of its step):")
    for c in contenders:
        print(f"  {c.size:4} {c.shape:5} {c.name}, {c.nproc} proc: "
              + ", ".join(f"{k} {v:.3f}" for k, v in c.phases.items()))
    curves = [c for c in contenders if c.accuracy]
    if curves:
        report_curves(curves, threshold)
    (OUT / "results.json").write_text(json.dumps([asdict(c) for c in contenders], indent=1))


def report_curves(curves: list[Contender], threshold: float) -> None:
    print(f"\nheld-out greedy accuracy ({NUM_TEST} test prompts; {CURVE[0]} at {CURVE[1]}, "
          "evaluation outside the steps):")
    steps = [s for s, _ in curves[0].accuracy]
    print(f"  {'step':22} " + " ".join(f"{s:>5}" for s in steps) + f"   train s to {threshold:.0%}")
    for c in curves:
        reached = c.seconds_to(threshold)
        to_threshold = f"{reached[1]:.0f} (step {reached[0]})" if reached else "not reached"
        print(f"  {f'{c.name}, {c.nproc} proc':22} " + " ".join(f"{100 * a:5.1f}" for _, a in c.accuracy)
              + f"   {to_threshold}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, default=400,
                        help=f"steps of the learning-curve run ({' at '.join(CURVE)})")
    parser.add_argument("--eval-every", type=int, default=25, help="evaluation period of the learning-curve run")
    parser.add_argument("--timing-steps", type=int, default=None,
                        help="steps of every other run (default per size: "
                             + ", ".join(f"{k} {v.timing_steps}" for k, v in SIZES.items()) + ")")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timing runs of every size and shape but the learning curve's, each round TRL then megarl")
    parser.add_argument("--warmup-steps", type=int, default=2, help="first steps of every run left out of its numbers")
    parser.add_argument("--threshold", type=float, default=0.58, help="held-out greedy accuracy")
    parser.add_argument("--dtype", choices=tuple(PRECISION), default="float32",
                        help="every contender's precision (default float32)")
    args = parser.parse_args()
    if args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: expected at least 1")
    sizes, shapes = parse_choice(args.sizes, SIZES, "--sizes"), parse_choice(args.shapes, SHAPES, "--shapes")
    bench_python()
    quickstart_sft = ensure_quickstart_model(OUT)  # and its data: the task of every size
    data = QUICKSTART / "data"
    contenders = []
    for size in sizes:
        model = ensure_bench_model() if size == "30m" else quickstart_sft  # every contender of the size starts here
        for shape in shapes:
            curve = (size, shape) == CURVE
            steps = args.steps if curve else args.timing_steps or SIZES[size].timing_steps
            if steps <= args.warmup_steps:
                sys.exit(f"{size} at {shape}: {steps} steps leave none after --warmup-steps {args.warmup_steps}")
            rounds = 1 if curve else args.rounds
            for round_ in range(rounds):
                setting = Setting(size, shape, model, data, steps, args.eval_every if curve else 0, args.warmup_steps,
                                  args.dtype, round_)
                setting.directory.mkdir(parents=True, exist_ok=True)
                print(f"{size} at {shape}: {steps} steps per contender"
                      + (f", round {round_ + 1} of {rounds}" if rounds > 1 else "") + " ...", flush=True)
                contenders.append(run_trl(setting))
                contenders += [run_megarl(setting, nproc) for nproc in (1, 2)]
    report(contenders, args.threshold, args.dtype, two_process_scaling())


def parse_choice(text: str, choices: dict, flag: str) -> list[str]:
    chosen = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in choices]
    if unknown or not chosen:
        sys.exit(f"{flag} {text!r}: expected a comma-separated subset of {', '.join(choices)}")
    return chosen


if __name__ == "__main__":
    main()
