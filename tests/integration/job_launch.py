"""A training job launched in the background and killed the way a crash kills it (tests of resume)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import ROOT

TRAINED = re.compile(r"step (\d+): trains on prompts (\[[\d, ]*\]) of policy version (\d+)")
MARKER = "MEGARL_TEST_LAUNCH"
"""An environment variable every process of a launch inherits: found by it, an orphan of the job is still its."""


class Launch:
    """One torchrun job of `nproc` workers in the background; its console and its debug log go to files."""

    def __init__(self, out: Path, args: list[str], nproc: int = 2):
        self.nproc = nproc
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.time_ns()
        self.console_path, self.log_path = out / f"console_{stamp}.txt", out / f"log_{stamp}.txt"
        self.marker = str(stamp)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MEGARL_LOG_LEVEL="DEBUG",
                   **{MARKER: self.marker})
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   "launchers/train_ppo.py", *map(str, args)]
        with open(self.console_path, "w") as stdout, open(self.log_path, "w") as stderr:
            self.agent = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)

    def trained_batches(self) -> dict[int, tuple[list[int], int]]:
        """Split placement: the prompts and policy version of each step trained (debug log)."""
        return {int(step): (json.loads(prompts), int(version))
                for step, prompts, version in TRAINED.findall(self.log())}

    def console(self) -> str:
        return self.console_path.read_text()

    def log(self) -> str:
        return self.log_path.read_text()

    def phase_began(self, step: int, phase: str) -> bool:
        return f"step {step}: {phase} phase begins" in self.log()

    def finish(self, timeout: float = 400) -> None:
        """Wait for the job to end well: exit 0, and no process of it left behind."""
        self.agent.wait(timeout=timeout)
        assert self.agent.returncode == 0, (f"exit {self.agent.returncode}\n{self.console()[-3000:]}\n"
                                            f"{self.log()[-8000:]}")
        self.assert_no_survivor()

    def assert_no_survivor(self) -> None:
        """Every process the job started has ended (within a few seconds), orphans included."""
        _, alive = psutil.wait_procs(self.marked(), timeout=10)
        for process in alive:
            _ignore_gone(process.kill)
        assert not alive, f"outlived their job: {[(p.pid, p.cmdline()[-3:]) for p in alive]}"

    def marked(self) -> list[psutil.Process]:
        """The live processes of the job, found by its marker: those below the agent and any orphan of it (a
        process whose parent ended; seen: one of an asynchronous save's, mid-run)."""
        marked = []
        for process in psutil.process_iter():
            try:
                if process.environ().get(MARKER) == self.marker:
                    marked.append(process)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                pass
        return marked

    def wait_for(self, moment, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while not moment():
            assert self.agent.poll() is None, f"the job ended before the moment to kill it\n{self.log()[-3000:]}"
            assert time.time() < deadline, "timed out waiting for the moment to kill"
            time.sleep(0.005)

    def processes(self) -> list[psutil.Process]:
        """The agent and every process below it."""
        agent = psutil.Process(self.agent.pid)
        return [agent, *agent.children(recursive=True)]

    def crash(self) -> None:
        """What a crash of the machine does to the job: every process dies at once, its orphans too. They are
        frozen (SIGSTOP) first and listed again until the list is stable, so that none starts another
        between the listing and the kill."""
        frozen: set[psutil.Process] = set()
        while new := (set(self.processes()) | set(self.marked())) - frozen:
            for process in new:
                _ignore_gone(process.suspend)
            frozen |= new
        for process in frozen:
            _ignore_gone(process.kill)
        self.agent.wait()
        _, alive = psutil.wait_procs(frozen, timeout=10)
        assert not alive, alive

    def kill_agent(self, checkpoints: Path) -> None:
        """SIGKILL of torchrun's agent alone: its workers (its children) must die with it and write no
        checkpoint after, and every process below them must end too (a checkpoint writer once its
        write is done). Every process below the agent is killed afterwards."""
        workers, everything = psutil.Process(self.agent.pid).children(), self.processes()[1:]
        assert len(workers) >= self.nproc
        before = sorted(checkpoints.glob("*global_step_*"))
        try:
            os.kill(self.agent.pid, signal.SIGKILL)
            self.agent.wait()
            _, alive = psutil.wait_procs(workers, timeout=5)
            assert not alive, f"outlived their agent: {[p.cmdline()[-3:] for p in alive]}"
            _, alive = psutil.wait_procs(everything, timeout=10)
            assert not alive, f"outlived their workers: {[p.cmdline()[-3:] for p in alive]}"
            assert sorted(checkpoints.glob("*global_step_*")) == before
        finally:
            for process in everything + self.marked():  # the job's orphans die with the rest
                _ignore_gone(process.kill)


def _ignore_gone(call):
    try:
        call()
    except psutil.NoSuchProcess:
        pass
