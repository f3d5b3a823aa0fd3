"""What a test script tells its test on the console: whole lines, one write each, and its results as one
`REPORT <json>` line (read by `tests.conftest.reported`).

The ranks of a torchrun launch share one console, and `print` writes a line's text and its newline apart:
under PYTHONUNBUFFERED another rank's output can land between the two and join the lines."""

import json
import sys


def write_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def print_report(results) -> None:
    write_line("REPORT " + json.dumps(results))
