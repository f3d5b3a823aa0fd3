"""Running untrusted Python (the model's code) in a confined child process.

Each call gets a fresh interpreter (`sandbox_child.py`, which confines itself before running the code)
in a new scratch directory that is deleted afterwards, with a wall-clock timeout that kills its whole
process group, and an empty environment. Output goes to files in the scratch directory, so the file-size
limit bounds it and the parent reads only its head. What this does and does not protect against is in
docs/running.md, "Sandbox".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from megarl.config.schema import SandboxConfig

CHILD = Path(__file__).with_name("sandbox_child.py")
SCRATCH_PREFIX = "megarl-sandbox-"
"""Scratch directories are named <prefix><pid of the process that made it>-<random>."""
SIGNAL_REASONS = {signal.SIGXCPU: "CPU time limit exceeded", signal.SIGXFSZ: "file size limit exceeded",
                  signal.SIGKILL: "killed (out of memory or process limit)", signal.SIGSEGV: "crashed (segfault)"}


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    error: str | None
    """None when the code ran to its end with exit status 0; otherwise why it did not."""
    timed_out: bool = False


def run_python(code: str, limits: SandboxConfig, timeout_seconds: float, max_output_chars: int) -> SandboxResult:
    """Run `code` in a confined fresh interpreter; never raises for anything the code does."""
    scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    try:
        with open(os.path.join(scratch, ".stdout"), "wb+") as stdout, \
                open(os.path.join(scratch, ".stderr"), "wb+") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-I", str(CHILD), scratch, json.dumps(asdict(limits)), str(os.getpid())],
                stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, cwd=scratch, start_new_session=True,
                env={})  # none of the trainer's environment (tokens, paths) reaches the code
            timed_out = False
            try:
                process.communicate(code.encode(), timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(process)  # also whatever the code left running
            process.wait()
            output = [_read_head(file, max_output_chars) for file in (stdout, stderr)]
        return SandboxResult(*output, _error(process.returncode, timed_out, timeout_seconds), timed_out)
    finally:
        _remove_tree(scratch)


def remove_orphaned_scratch() -> None:
    """Delete the scratch directories of processes that died mid-call: a killed trainer cannot delete
    its own, its sandboxes die with it (PR_SET_PDEATHSIG) and their directories stay."""
    for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name[len(SCRATCH_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _remove_tree(str(path))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _error(returncode: int, timed_out: bool, timeout_seconds: float) -> str | None:
    if timed_out:
        return f"timed out after {timeout_seconds:g} s"
    if returncode < 0:
        return SIGNAL_REASONS.get(-returncode, f"killed by signal {signal.Signals(-returncode).name}")
    return f"exit status {returncode}" if returncode else None


def _read_head(file, max_chars: int) -> str:
    """The file's first `max_chars` characters, plus one when there are more: enough for the caller to
    see it was cut, without reading all of a flood."""
    file.seek(0)
    return file.read((max_chars + 1) * 4).decode(errors="replace")[:max_chars + 1]  # <= 4 bytes a character


def _remove_tree(path: str) -> None:
    """Delete the scratch directory even where the code removed its own write permissions."""

    def allow_and_retry(function, failed_path, _):
        os.chmod(os.path.dirname(failed_path), stat.S_IRWXU)
        function(failed_path)

    shutil.rmtree(path, onerror=allow_and_retry)
