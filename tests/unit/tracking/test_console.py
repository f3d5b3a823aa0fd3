"""The console of a run (megarl.tracking.console): which steps print a line, the progress bar, and
the quieting of third-party logs; mlflow still receives every step (megarl.tracking.Tracker)."""

from __future__ import annotations

import logging
import subprocess
import sys

from megarl.tracking import Tracker
from megarl.tracking.console import Console


def test_lines_every_log_freq_steps_at_validation_and_the_last_step(capsys):
    console = Console(enabled=True, log_freq=3, last_step=7)
    for step in range(8):
        metrics = {"reward/mean": step / 10, **({"val/score/mean": 0.5} if step == 4 else {})}
        console.show(metrics, step)
    lines = capsys.readouterr().out.splitlines()
    # By hand: multiples of 3 (0, 3, 6), step 4 (validation), step 7 (the last).
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 3", "step 4", "step 6", "step 7"]
    assert lines[2] == "step 4: reward/mean=0.4  val/score/mean=0.5"


def test_progress_bar_counts_from_a_resumed_step_with_rate_and_eta(capsys):
    console = Console(enabled=True, log_freq=1, last_step=6)
    steps = []
    for step in console.progress(range(4, 7)):  # a run resumed after step 3 of 6
        steps.append(step)
        console.show({"reward/mean": 1.0}, step)
    captured = capsys.readouterr()
    assert steps == [4, 5, 6]
    assert captured.out.splitlines() == ["step 4: reward/mean=1", "step 5: reward/mean=1", "step 6: reward/mean=1"]
    final = captured.err.split("\r")[-1]
    assert "6/6" in final and "<00:00" in final and "step/s" in final, captured.err  # count, ETA, rate


def test_disabled_console_prints_nothing(capsys):
    console = Console(enabled=False, log_freq=1, last_step=2)
    assert list(console.progress(range(1, 3))) == [1, 2]
    console.show({"reward/mean": 1.0}, 2)
    assert capsys.readouterr() == ("", "")


def test_mlflow_gets_every_step_while_the_console_shows_some(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    tracker = Tracker(["console", "mlflow"], tmp_path, "console_test", "", {"a": 1}, is_writer=True,
                      log_freq=2, last_step=5)
    for step in range(1, 6):
        tracker.log({"reward/mean": float(step)}, step)
    tracker.close()
    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    history = client.get_metric_history(tracker.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 6)]
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert shown == ["step 2: reward/mean=2", "step 4: reward/mean=4", "step 5: reward/mean=5"]


def test_known_library_warnings_are_filtered_and_others_kept():
    """In a fresh process: megatron-core's import-time warnings about absent TE/Apex are gone, a
    warning of another kind still shows; vLLM's CPU worker's notice about LD_PRELOAD is dropped, its
    other notices and another unknown vLLM variable still show; vLLM is told to log at WARNING and
    mlflow does."""
    code = (
        "import os, warnings\n"
        "from megarl.tracking.console import quiet_third_party_logs\n"
        "quiet_third_party_logs()\n"
        "quiet_third_party_logs()  # a second call adds nothing\n"
        "import megatron.core.optimizer\n"
        "warnings.warn('an unknown warning')\n"
        "import logging, mlflow\n"
        "worker = logging.getLogger('vllm.v1.worker.cpu_worker')\n"
        "worker.warning('%s is not found in LD_PRELOAD. For best performance, ...', 'libtcmalloc')\n"
        "worker.warning('an unknown notice')\n"
        "variables = logging.getLogger('vllm.platforms.interface')\n"
        "for name in ('VLLM_DIST_IDENT', 'VLLM_TYPO'):\n"
        "    variables.warning('Unknown vLLM environment variable detected: %s', name)\n"
        "print(os.environ['VLLM_LOGGING_LEVEL'], logging.getLogger('mlflow').getEffectiveLevel(),\n"
        "      len(worker.filters))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Apex" not in result.stderr and "Transformer Engine" not in result.stderr, result.stderr
    assert "an unknown warning" in result.stderr
    assert "LD_PRELOAD" not in result.stderr and "an unknown notice" in result.stderr
    assert "VLLM_DIST_IDENT" not in result.stderr and "detected: VLLM_TYPO" in result.stderr
    assert result.stdout.split() == ["WARNING", str(logging.WARNING), "1"]
