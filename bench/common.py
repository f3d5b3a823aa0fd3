"""What the benchmarks share: their ~30M-parameter Qwen2, and launching torchrun workers that report
one marked JSON line. Benchmarks run as `python bench/X.py`, so this folder is first on sys.path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_MODEL = ROOT / "outputs/bench/qwen2_30m"
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
