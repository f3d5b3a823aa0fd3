"""The benchmarks' shared model: a ~30M-parameter untied Qwen2 (h512, 10 layers, GQA 8/4), made once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_MODEL = ROOT / "outputs/bench/qwen2_30m"


def ensure_bench_model() -> Path:
    if not (BENCH_MODEL / "config.json").is_file():
        subprocess.run([sys.executable, "checkpoints_tools/make_tiny_model.py", "--family", "qwen2",
                        "--out", str(BENCH_MODEL), "--hidden-size", "512", "--ffn-hidden-size", "1536",
                        "--num-layers", "10", "--num-heads", "8", "--num-kv-heads", "4", "--no-tied",
                        "--max-shard-size", "40MB"],
                       cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True, capture_output=True)
    return BENCH_MODEL
