"""What the benchmarks share: their ~30M-parameter Qwen2, the quick start's SFT checkpoint, launching
torchrun workers that report one marked JSON line, and reading a run's metrics back from mlflow.
Benchmarks run as `python bench/X.py`, so this folder is first on sys.path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_MODEL = ROOT / "outputs/bench/qwen2_30m"
QUICKSTART = ROOT / "outputs/quickstart"
AGENT = ROOT / "outputs/agent_quickstart"
WORKER_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def ensure_bench_model() -> Path:
    """An untied Qwen2 of h512, 10 layers, GQA 8/4 (~30M parameters), made once."""
    if not (BENCH_MODEL / "config.json").is_file():
        subprocess.run([sys.executable, "checkpoints_tools/make_tiny_model.py", "--family", "qwen2",
                        "--out", str(BENCH_MODEL), "--hidden-size", "512", "--ffn-hidden-size", "1536",
                        "--num-layers", "10", "--num-heads", "8", "--num-kv-heads", "4", "--no-tied",
                        "--max-shard-size", "40MB"],
                       cwd=ROOT, env=WORKER_ENV, check=True, capture_output=True)
    return BENCH_MODEL


LONG_TAIL = ROOT / "outputs/bench/long_tail"
LONG_TAIL_DOTS = ["--dots-median", "12", "--dots-sigma", "1.3", "--dots-max", "400"]
"""Warm-start targets of the long-tailed workload: the sum, then log-normal dots of median 12 tokens (10% over
64, 1% over 250, at most 400): a step's responses mostly end within a few dozen tokens while its longest runs
for hundreds, so generation, not training, sets the step, as in reasoning runs."""
LONG_TAIL_RESPONSE_LENGTH = 416
"""data.max_response_length of the long-tailed workload: the longest warm-start target (sum, space, dots)."""


def ensure_quickstart_model(log_dir: Path) -> Path:
    """The quick start's SFT checkpoint (and its data), made as `make quickstart` makes them when missing. The
    logs of making them go to `log_dir`."""
    return _ensure_sft_model(QUICKSTART / "quickstart_sft/hf", log_dir, "quick start", (
        ("make_model", [sys.executable, "checkpoints_tools/make_tiny_model.py", "--family", "qwen2",
                        "--out", str(QUICKSTART / "base")]),
        ("make_data", [sys.executable, "-m", "megarl.data.synthetic", "--task", "arithmetic", "--out-dir",
                       str(QUICKSTART / "data"), "--num-train", "20000", "--num-test", "500", "--seed", "0"]),
        ("sft", torchrun(2) + ["launchers/train_sft.py", "--config", "configs/quickstart_sft.yaml"])))


def ensure_long_tail_model(log_dir: Path) -> Path:
    """The long-tailed workload's warm start, in outputs/bench/long_tail: the quick start's SFT checkpoint taught
    by 100 more SFT steps to follow the sum with a long-tailed number of dots (`LONG_TAIL_DOTS`). It starts from the
    quick start's checkpoint because from the base model, in the quick start's 400 steps, the dots' tokens crowd
    the sum out of the loss and the warm start answers few prompts."""
    quickstart = ensure_quickstart_model(log_dir)
    return _ensure_sft_model(LONG_TAIL / "quickstart_sft/hf", log_dir, "long-tailed task", (
        ("make_data", [sys.executable, "-m", "megarl.data.synthetic", "--task", "arithmetic", "--out-dir",
                       str(LONG_TAIL / "data"), "--num-train", "20000", "--num-test", "500", "--seed", "0",
                       *LONG_TAIL_DOTS]),
        ("sft", torchrun(2) + [
            "launchers/train_sft.py", "--config", "configs/quickstart_sft.yaml", f"model.path={quickstart}",
            f"data.train_files=[{LONG_TAIL}/data/train.parquet]",
            f"data.max_response_length={LONG_TAIL_RESPONSE_LENGTH}", f"trainer.output_dir={LONG_TAIL}",
            "trainer.total_steps=100", "actor.optim.lr_warmup_steps=10"])))


def ensure_agent_model(log_dir: Path) -> Path:
    """The agent quick start's SFT checkpoint (and its data), made as `make agent-quickstart` makes them when
    missing."""
    return _ensure_sft_model(AGENT / "agent_quickstart_sft/hf", log_dir, "agent quick start", (
        ("make_model", [sys.executable, "checkpoints_tools/make_tiny_model.py", "--family", "qwen2",
                        "--out", str(AGENT / "base")]),
        ("make_data", [sys.executable, "-m", "megarl.data.synthetic", "--task", "multiplication", "--out-dir",
                       str(AGENT / "data"), "--num-train", "4000", "--num-test", "200", "--seed", "0"]),
        ("sft", torchrun(2) + ["launchers/train_sft.py", "--config", "configs/agent_quickstart_sft.yaml"])))


def _ensure_sft_model(model: Path, log_dir: Path, task: str, steps: tuple[tuple[str, list[str]], ...]) -> Path:
    """`model`, made by running `steps` (name, command) when missing; each step's log goes to `log_dir`."""
    if (model / "config.json").is_file():
        return model
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"making the {task}'s SFT checkpoint (as its make target does) ...", flush=True)
    for name, command in steps:
        output = subprocess.run(command, cwd=ROOT, env=WORKER_ENV, capture_output=True, text=True)
        (log_dir / f"{name}.log").write_text(output.stdout + output.stderr)
        if output.returncode != 0:
            sys.exit(f"{' '.join(command)} failed (exit {output.returncode}); see {log_dir / name}.log")
    return model


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def launch(command: list[str], marker: str) -> object:
    """Run a worker command; the JSON after `marker` on its first line starting with it. Exits with
    the command's output tail when it fails or prints no such line."""
    output = subprocess.run(command, cwd=ROOT, env=WORKER_ENV, capture_output=True, text=True)
    lines = [line for line in output.stdout.splitlines() if line.startswith(marker + " ")]
    if output.returncode != 0 or not lines:
        sys.exit(f"{' '.join(command)} failed:\n{output.stdout[-3000:]}\n{output.stderr[-5000:]}")
    return json.loads(lines[0].removeprefix(marker + " "))


def metric_history(store: Path, experiment: str, extra: tuple[str, ...] = ()) -> dict[str, list]:
    """Per-step values from a run's mlflow store, in step order: the step's tokens (prompt + response,
    every DP rank's), its seconds and every other `timing/` phase it logged, the `extra` metrics, and
    (step, value) pairs of the held-out accuracy."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    run_id = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0].info.run_id
    keys = ["throughput/tokens", *extra] + [k for k in client.get_run(run_id).data.metrics if k.startswith("timing/")]

    def ordered(key: str) -> list:
        return sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)

    history = {key: [m.value for m in ordered(key)] for key in keys}
    history["val/score/mean"] = [(m.step, m.value) for m in ordered("val/score/mean")]
    return history
