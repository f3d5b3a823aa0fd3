"""A finished run's process ends without the interpreter's teardown, with its status, and loses no
console output."""

import os
import subprocess
import sys

SCRIPT = """
import atexit
from megarl.distributed import finish_process
atexit.register(print, "teardown ran")
print("last metrics line", end="")
finish_process(3)
"""


def test_finish_process_flushes_the_console_skips_the_teardown_and_exits_with_its_status():
    # stdout is a buffered pipe here: only the flush brings the line out
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "last metrics line"
