"""The Slurm templates: launch.sh's logic run as two simulated nodes on this machine (shellcheck:
tests/integration/test_shell_scripts.py).

Two copies of launch.sh start concurrently with the SLURM_* variables Slurm would give the two tasks
of a 2-node job (node ids 0 and 1, nodelist "localhost"); their torchrun agents must meet by c10d
rendezvous in a world of 2 and finish a short GRPO run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT
from tests.integration.test_train_ppo import _logged

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_simulated_nodes_rendezvous_and_train(tiny_models, tmp_path):
    train, _ = make_arithmetic(64, 16, seed=0, out_dir=tmp_path / "data")
    # What is under test is launch.sh's rendezvous: the `hf` engine and no validation keep the run short.
    overrides = [f"model.path={tiny_models['qwen2-tied']}", f"data.train_files=[{train}]", "data.val_files=[]",
                 f"trainer.output_dir={tmp_path}", "trainer.total_steps=2", "rollout.backend=hf",
                 "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                 f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}"]  # launch.sh adds trainer.resume_mode=auto
    common = {"SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
              "GPUS_PER_NODE": "1", "MASTER_PORT": str(_free_port()), "MEGARL_LOG_DIR": str(tmp_path / "logs"),
              "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    nodes = []
    for node_id in (0, 1):
        console = open(tmp_path / f"node{node_id}.out", "w")
        env = dict(os.environ, **common, SLURM_NODEID=str(node_id))
        command = ["bash", "launchers/slurm/launch.sh", "--config", "configs/quickstart.yaml", *overrides]
        nodes.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT,
                                       start_new_session=True), console))
    try:
        codes = [process.wait(timeout=600) for process, _ in nodes]
    finally:
        for process, console in nodes:
            if process.poll() is None:  # its whole process group: torchrun and the workers too
                os.killpg(process.pid, signal.SIGKILL)
            console.close()
    consoles = [(tmp_path / f"node{i}.out").read_text() for i in (0, 1)]
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(c[-6000:] for c in consoles)
    assert "node 1 of 2, processes per node 1, rendezvous localhost:" in consoles[1]
    assert sum("step 2: reward/mean=" in console for console in consoles) == 1  # one world, one rank 0
    for node_id in (0, 1):  # one torchrun log folder per node, one stdout/stderr per local rank
        assert len(list((tmp_path / "logs" / f"node{node_id}").rglob("0/stderr.log"))) == 1
    assert _logged(tmp_path / "quickstart_grpo", "quickstart_grpo", "reward/mean") == [1, 2]


def test_sigusr1_requeues_the_job_and_stops_the_workers(tiny_models, tmp_path):
    # A stand-in scontrol on PATH records the requeue; `show hostnames` lists the nodes as Slurm would.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[[ $1 == show ]] && {{ echo "$3"; exit; }}\n'
                                      f'echo "$@" >> {tmp_path / "scontrol.log"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = dict(os.environ, SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_ID="4243",
               GPUS_PER_NODE="1", MASTER_PORT=str(_free_port()), MEGARL_LOG_DIR=str(tmp_path / "logs"),
               PYTHON=sys.executable, PATH=f"{bin_dir}:{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="")
    console = tmp_path / "node0.out"
    with console.open("w") as out:
        process = subprocess.Popen(["bash", "launchers/slurm/launch.sh", "--config", "configs/quickstart.yaml",
                                    f"model.path={tiny_models['qwen2-tied']}"], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not list((tmp_path / "logs").rglob("0/stderr.log")) and time.monotonic() < deadline:
            time.sleep(0.5)  # torchrun has started the worker
        process.send_signal(signal.SIGUSR1)
        code = process.wait(timeout=120)
    assert code != 0, console.read_text()[-4000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4243\n"
    text = console.read_text()
    assert "received SIGUSR1, stopping the workers" in text and "got signal: 15" in text  # torchrun was stopped
