"""A successful run's process ends without the interpreter's teardown, and loses no console output."""

import os
import subprocess
import sys

SCRIPT = """
import atexit
from megarl.distributed import exit_after_success
atexit.register(print, "teardown ran")
print("last metrics line", end="")
exit_after_success()
"""


def test_exit_after_success_flushes_the_console_and_skips_the_teardown():
    # stdout is a buffered pipe here: only the flush brings the line out
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "last metrics line"
