"""End to end against TRL: GRPO on the same task, checkpoint and settings, in one run on this machine.

    python bench/trl_vs_megarl.py

1. Makes a tiny Qwen2 (h128, 4 layers, head dim 32) and "a+b=" data with megarl's tools, and
   warm-starts it with megarl's SFT.
2. Trains GRPO from that checkpoint three times, with the same prompts per step, samples per prompt,
   response length, learning rate (constant), loss (token mean, no KL) and one optimizer step per
   batch: TRL's `GRPOTrainer` in one process (HF generate; installed only in the bench environment
   .venv-bench, created on first use from bench/requirements-trl.txt), megarl in one process and
   megarl in two (torchrun, colocated vLLM).
3. Prints s/step, tokens/s (prompt + response tokens per second of training step, evaluation
   excluded), held-out greedy accuracy and the training time to reach --threshold, the ratios to TRL
   (target: megarl's tokens/s >= 2x TRL's at one process each), and megarl's time per phase.

Every process runs one thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import ROOT, torchrun

OUT = ROOT / "outputs/bench/trl_vs_megarl"
BENCH_ENV = ROOT / ".venv-bench"
REQUIREMENTS = ROOT / "bench/requirements-trl.txt"
PROMPTS_PER_STEP, SAMPLES, RESPONSE_LENGTH, PROMPT_LENGTH, LR, SEED = 16, 8, 8, 16, 1e-4, 0
NUM_TEST = 500


@dataclass
class Contender:
    name: str
    step_seconds: list[float]
    step_tokens: list[float]
    accuracy: list[tuple[int, float]]
    """(step, held-out greedy accuracy), step 0 before training."""
    wall_seconds: float
    phases: dict[str, float] | None = None

    def tokens_per_second(self) -> float:
        return sum(self.step_tokens) / sum(self.step_seconds)

    def seconds_to(self, threshold: float) -> tuple[int, float] | None:
        """(step, training seconds) of the first evaluation at or above `threshold`."""
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


def prepare() -> Path:
    """Tiny base model, data, and the SFT warm start every contender starts from."""
    OUT.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "checkpoints_tools/make_tiny_model.py", "--family", "qwen2", "--out", str(OUT / "base")],
        OUT / "make_model.log")
    run([sys.executable, "-m", "megarl.data.synthetic", "--task", "arithmetic", "--out-dir", str(OUT / "data"),
         "--num-train", "20000", "--num-test", str(NUM_TEST), "--seed", "0"], OUT / "make_data.log")
    run(torchrun(2) + ["launchers/train_sft.py", "--config", "configs/quickstart_sft.yaml",
                       f"model.path={OUT / 'base'}", f"data.train_files=[{OUT / 'data/train.parquet'}]",
                       f"trainer.output_dir={OUT}", "trainer.experiment_name=sft", "trainer.loggers=[console]"],
        OUT / "sft.log")
    return OUT / "sft/hf"


def run_trl(model: Path, steps: int, eval_every: int) -> Contender:
    record = OUT / "trl.json"
    wall = run([str(bench_python()), "bench/trl_grpo_worker.py", "--model", str(model),
                "--train", str(OUT / "data/train.parquet"), "--test", str(OUT / "data/test.parquet"),
                "--output", str(record), "--steps", str(steps), "--eval-every", str(eval_every),
                "--prompts-per-step", str(PROMPTS_PER_STEP), "--samples", str(SAMPLES),
                "--max-response-length", str(RESPONSE_LENGTH), "--lr", str(LR), "--seed", str(SEED)], OUT / "trl.log")
    result = json.loads(record.read_text())
    generation = statistics.mean(result["generation_seconds"])
    phases = {"generate+reward+advantage": generation,
              "forward+backward+optimizer": statistics.mean(result["step_seconds"]) - generation}
    return Contender("TRL GRPOTrainer, 1 process", result["step_seconds"], result["step_tokens"],
                     [tuple(a) for a in result["accuracy"]], wall, phases)


def run_megarl(model: Path, nproc: int, steps: int, eval_every: int) -> Contender:
    name = f"megarl_{nproc}proc"
    wall = run(torchrun(nproc) + [
        "launchers/train_ppo.py", "--config", "configs/quickstart.yaml", f"model.path={model}",
        f"data.train_files=[{OUT / 'data/train.parquet'}]", f"data.val_files=[{OUT / 'data/test.parquet'}]",
        f"data.train_batch_size={PROMPTS_PER_STEP}", f"actor.ppo_mini_batch_size={PROMPTS_PER_STEP}",
        f"actor.micro_batch_size_per_rank={PROMPTS_PER_STEP * SAMPLES}",  # one micro-batch, as TRL's one batch
        f"rollout.n={SAMPLES}", f"data.max_response_length={RESPONSE_LENGTH}",
        f"data.max_prompt_length={PROMPT_LENGTH}", f"actor.optim.lr={LR}", f"data.max_val_samples={NUM_TEST}",
        f"trainer.total_steps={steps}", f"trainer.test_freq={eval_every}", f"trainer.seed={SEED}",
        f"trainer.output_dir={OUT}", f"trainer.experiment_name={name}"], OUT / f"{name}.log")
    history = metric_history(OUT / name / "mlflow.db", name)
    step_seconds = history["timing/step"]
    tokens = [rate * seconds for rate, seconds in zip(history["throughput/tokens_per_s"], step_seconds)]
    phases = {key.removeprefix("timing/"): statistics.mean(values) for key, values in history.items()
              if key.startswith("timing/") and key != "timing/step"}
    return Contender(f"megarl GRPO, {nproc} process{'es' if nproc > 1 else ''}", step_seconds, tokens,
                     history["val/score/mean@steps"], wall, phases)


def metric_history(store: Path, experiment: str) -> dict:
    """Per-step values of the run's metrics from its mlflow store, in step order."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    run_id = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0].info.run_id
    history = {}
    for key in ("timing/step", "throughput/tokens_per_s", "timing/reshard", "timing/rollout", "timing/score",
                "timing/advantage", "timing/update_actor"):
        history[key] = [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
    validation = sorted(client.get_metric_history(run_id, "val/score/mean"), key=lambda m: m.step)
    history["val/score/mean@steps"] = [(m.step, m.value) for m in validation]
    return history


def report(contenders: list[Contender], threshold: float) -> None:
    trl = contenders[0]
    print(f"\nGRPO on a+b= from the same SFT checkpoint: {PROMPTS_PER_STEP} prompts x {SAMPLES} samples per step, "
          f"<= {RESPONSE_LENGTH} response tokens, lr {LR:g}, {len(trl.step_seconds)} steps, 1 thread per process")
    print(f"{'':30} {'s/step':>7} {'tokens/s':>9} {'x TRL':>6} {'acc@0':>6} {'acc@end':>8} {'best':>6} "
          f"{f'train s to {threshold:.0%}':>16} {'x TRL':>6} {'process s':>10}")
    trl_time = trl.seconds_to(threshold)
    for c in contenders:
        reached = c.seconds_to(threshold)
        to_threshold = f"{reached[1]:.0f} (step {reached[0]})" if reached else "not reached"
        speedup = f"{trl_time[1] / reached[1]:.2f}" if reached and trl_time else "-"
        print(f"{c.name:30} {statistics.median(c.step_seconds):7.3f} {c.tokens_per_second():9.0f} "
              f"{c.tokens_per_second() / trl.tokens_per_second():6.2f} {c.accuracy[0][1]:6.3f} "
              f"{c.accuracy[-1][1]:8.3f} {max(a for _, a in c.accuracy):6.3f} {to_threshold:>16} {speedup:>6} "
              f"{c.wall_seconds:10.0f}")
    ratio = contenders[1].tokens_per_second() / trl.tokens_per_second()
    print(f"target megarl/TRL tokens/s >= 2 at one process each: {ratio:.2f} ({'met' if ratio >= 2 else 'MISSED'})")
    for c in contenders:
        print(f"{c.name} mean seconds per phase: " + ", ".join(f"{k} {v:.3f}" for k, v in c.phases.items()))
    (OUT / "results.json").write_text(json.dumps([c.__dict__ for c in contenders], indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--threshold", type=float, default=0.58, help="held-out greedy accuracy")
    args = parser.parse_args()
    bench_python()
    model = prepare()
    contenders = [run_trl(model, args.steps, args.eval_every)]
    for nproc in (1, 2):
        contenders.append(run_megarl(model, nproc, args.steps, args.eval_every))
    report(contenders, args.threshold)


if __name__ == "__main__":
    main()
