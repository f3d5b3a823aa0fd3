"""User-facing error messages are one line (STYLE.md): flattening what goes into them, and exiting with one."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def one_line(value: object) -> str:
    """`str(value)` with every run of whitespace, newlines included, collapsed to one space."""
    return " ".join(str(value).split())


def exit_on_user_error(error: ValueError) -> NoReturn:
    """Exit with status 1; global rank 0 prints `megarl: <error>`, the others exit quietly (the
    error, from the config, data or reward function, is the same on every rank)."""
    if os.environ.get("RANK", "0") == "0":
        sys.exit(f"megarl: {error}")
    sys.exit(1)
