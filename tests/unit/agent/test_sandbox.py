"""The python tool's sandbox: each attack ends as an error observation within the timeout, and the next
call still works. Run with the kernel namespaces and with the always-on layers alone (rlimits and the
audit hook), so the tests hold whichever the machine offers.

The attacks are bounded (64 processes, 2 GiB of untouched pages) so that a broken sandbox fails the
test instead of taking down the shared machine."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.agent.environment import ToolEnvironment, load_environment
from megarl.agent.sandbox import CHILD
from megarl.agent.tools import load_tools
from megarl.config.schema import MultiTurnConfig, RolloutConfig, SandboxConfig
from megarl.data.dataset import Prompt

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_SECONDS = 10.0  # wall clock: far above the CPU limit, so a loaded machine still hits the CPU limit first
SHORT_TIMEOUT_SECONDS = 0.5  # for code that sleeps, which no CPU limit stops
LIMITS = dict(cpu_seconds=1, memory_mib=256, max_processes=8, max_file_mib=1)


def make_environment(namespaces: bool, timeout_seconds: float) -> ToolEnvironment:
    config = MultiTurnConfig(tools=["python"], tool_timeout_seconds=timeout_seconds, max_tool_output_chars=400,
                             sandbox=SandboxConfig(**LIMITS, namespaces=namespaces))
    return load_environment(RolloutConfig(multi_turn=config))(Prompt([0], "agent", "", {}, 0))


@pytest.fixture(scope="module", params=[True, False], ids=["namespaces", "rlimits+audit"])
def namespaces(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def environment(namespaces) -> ToolEnvironment:
    return make_environment(namespaces, TIMEOUT_SECONDS)


def run(environment: ToolEnvironment, code: str) -> tuple[str, dict, float]:
    """The tool message's content, the observation's counters and the seconds it took."""
    started = time.monotonic()
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    observation = environment.step(f"<tool_call>{call}</tool_call>")
    assert not observation.done and len(observation.messages) == 1
    return observation.messages[0]["content"], observation.info, time.monotonic() - started


def assert_error_then_recovers(environment, code: str, error: str) -> dict:
    """The error observation's counters."""
    content, info, seconds = run(environment, code)
    assert content.startswith("Error: ") and error in content, content
    assert info["tool_calls"] == info["tool_errors"] == 1
    assert seconds < environment.toolbox.timeout_seconds + 1.0, f"took {seconds:.1f} s"
    assert run(environment, "print(6 * 7)")[:2] == ("42\n", {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0,
                                                             "tool_malformed": 0, "tool_unknown": 0})
    return info


def test_an_infinite_loop_hits_the_cpu_limit(environment):
    assert_error_then_recovers(environment, "while True:\n    pass", "CPU time limit exceeded")


def test_code_that_waits_forever_hits_the_wall_clock_timeout(namespaces):
    code = "import time\nwhile True:\n    time.sleep(0.1)"
    environment = make_environment(namespaces, SHORT_TIMEOUT_SECONDS)
    assert assert_error_then_recovers(environment, code, "timed out after 0.5 s")["tool_timeouts"] == 1


def test_a_memory_bomb_hits_the_memory_limit(environment):
    assert_error_then_recovers(environment, "blocks = [bytearray(2**28) for _ in range(8)]\nprint('allocated')",
                               "MemoryError")


def test_limits_cannot_be_lifted(environment):
    """Not even the CPU limit's soft value up to its hard one (the kernel itself allows that)."""
    hard = LIMITS["cpu_seconds"] + 1
    code = f"import resource\nresource.setrlimit(resource.RLIMIT_CPU, ({hard}, {hard}))\nprint('lifted')"
    assert_error_then_recovers(environment, code, "resource limits are fixed")


def test_a_process_flood_is_refused(environment):
    code = ("import os, time\nfor _ in range(64):\n    if os.fork() == 0:\n        time.sleep(3)\n        os._exit(0)\n"
            "print('forked 64')")
    assert_error_then_recovers(environment, code, "Error")


def test_no_network(environment):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=1)"
        assert_error_then_recovers(environment, code, "Error")
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected


def test_no_ctypes(environment):
    """Foreign calls would go around every audit event."""
    assert_error_then_recovers(environment, "import ctypes\nprint(ctypes.CDLL(None).getpid())",
                               "module 'ctypes' is not available")


def test_no_writes_outside_the_scratch_directory(environment, tmp_path):
    outside = tmp_path / "outside.txt"
    assert_error_then_recovers(environment, f"open({str(outside)!r}, 'w').write('escaped')", "Error")
    assert not outside.exists()


def test_the_scratch_directory_is_writable_and_deleted_afterwards_and_no_secret_gets_in(environment, monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_TOKEN", "secret")
    code = ("import os\nopen('notes.txt', 'w').write('kept')\n"
            "print(os.getcwd(), open('notes.txt').read(), os.environ.get('MEGARL_TEST_TOKEN', 'none'))")
    content, info, _ = run(environment, code)
    scratch, text, token = content.split()
    assert (text, token) == ("kept", "none") and info["tool_errors"] == 0
    assert os.path.basename(scratch).startswith("megarl-sandbox-") and not os.path.exists(scratch)


def test_output_is_truncated(environment):
    content, info, _ = run(environment, "print('x' * 100000)")
    assert info["tool_errors"] == 0 and content.startswith("x" * 400) and content.count("x") == 400
    assert content.endswith("\n[answer cut to 400 characters]")


def test_a_sandbox_dies_with_the_process_that_started_it_and_its_directory_goes_next_time():
    """A trainer killed mid-call (here: a helper process) leaves no sandboxed code running, and the next
    run removes the scratch directory it left."""
    started = "from megarl.agent.sandbox import run_python\nfrom megarl.config.schema import SandboxConfig\n" \
              "run_python('import time\\ntime.sleep(60)', SandboxConfig(), 60, 100)"
    helper = psutil.Popen([sys.executable, "-c", started], env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 20
    while not (children := _sandboxes(helper)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(children) == 1, "the helper started no sandbox"
    scratch = Path(children[0].cmdline()[3])
    helper.kill()
    helper.wait()
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"sandbox {alive} outlived the process that started it"
    assert scratch.is_dir()  # nobody was left to delete it: the next run's python tool does
    load_tools(MultiTurnConfig(tools=["python"]))
    assert not scratch.exists()


def _sandboxes(process: psutil.Process) -> list[psutil.Process]:
    """The children of `process` that already run the sandbox (a child between fork and exec still
    shows its parent's command line)."""
    return [child for child in process.children() if str(CHILD) in child.cmdline()]
