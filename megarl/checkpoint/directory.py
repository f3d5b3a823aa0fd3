"""Where checkpoints live and how they become visible.

    <root>/global_step_N/      a complete checkpoint (published by one atomic rename)
    <root>/.global_step_N.partial/   being written; never taken for a checkpoint
    <root>/latest              the name of the newest complete checkpoint, replaced atomically

A checkpoint is complete when its `manifest.json` (written last, before the rename) lists files that
all exist. A crash at any moment leaves either the previous checkpoint or the new one, never a
directory that looks complete but is not. Resuming skips, with a warning naming it, any
`global_step_N` that fails this check (for example one damaged by hand).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)
STEP_DIR = re.compile(r"global_step_(\d+)")
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it."""


def partial_dir(root: Path, step: int) -> Path:
    return root / f".global_step_{step}.partial"


def step_of(path: Path) -> int:
    match = STEP_DIR.fullmatch(path.name)
    if not match:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected a name like global_step_12)")
    return int(match.group(1))


def write_manifest(directory: Path, step: int) -> None:
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    (directory / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))


def problem_with(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when it is."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as error:
        return f"unreadable {MANIFEST}: {error}"
    missing = [f for f in files if not (directory / f).is_file()]
    return f"missing {len(missing)} files, e.g. {missing[0]}" if missing else None


def publish(root: Path, step: int) -> Path:
    """Make the partial checkpoint of `step` visible, then point `latest` at it."""
    final = root / f"global_step_{step}"
    if final.exists():
        shutil.rmtree(final)  # a checkpoint of the same step from an earlier, overtaken attempt
    os.rename(partial_dir(root, step), final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first; incomplete ones are skipped with a warning."""
    found = []
    for path in sorted(root.glob("global_step_*"), key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1))
                       if STEP_DIR.fullmatch(p.name) else -1):
        if not STEP_DIR.fullmatch(path.name):
            continue
        problem = problem_with(path)
        if problem:
            logger.warning("skipping checkpoint %s: %s", path, problem)
        else:
            found.append(path)
    return found


def remove_oldest(root: Path, keep: int) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `keep`; incomplete ones are left alone."""
    complete = complete_checkpoints(root)
    doomed = complete[:-keep] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path)
    return doomed
