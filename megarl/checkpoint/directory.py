"""Where checkpoints live and how they become visible.

    <root>/global_step_N/      a complete checkpoint (published by one atomic rename)
    <root>/.global_step_N.partial/   being written; never taken for a checkpoint
    <root>/latest              the name of the newest complete checkpoint, replaced atomically

A checkpoint is complete when its `manifest.json` (written last, before the rename) lists files that
all exist with the sizes and checksums recorded at save. A crash at any moment leaves either the
previous checkpoint or the new one, never a directory that looks complete but is not. Resuming
skips, with a warning naming the file, any `global_step_N` that fails this check (a shard truncated
or overwritten later, a file deleted by hand) and takes the one before it.

The checksum is a CRC-32 of each file's first and last MiB: it reads at most 2 MiB per file, so
checking every checkpoint of a directory of multi-GB shards stays cheap, and together with the
exact size it catches the usual damage (truncation, zero-filled or partly copied files).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path

logger = logging.getLogger(__name__)
STEP_DIR = re.compile(r"global_step_(\d+)")
MANIFEST = "manifest.json"
CHECKSUM_SPAN = 1 << 20  # bytes read from each end of a file for its checksum


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it."""


def partial_dir(root: Path, step: int) -> Path:
    return root / f".global_step_{step}.partial"


def step_of(path: Path) -> int:
    match = STEP_DIR.fullmatch(path.name)
    if not match:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected a name like global_step_12)")
    return int(match.group(1))


def checksum(path: Path) -> int:
    """CRC-32 of the file's first and last CHECKSUM_SPAN bytes (the whole file when it is smaller)."""
    with path.open("rb") as file:
        crc = zlib.crc32(file.read(CHECKSUM_SPAN))
        file.seek(0, os.SEEK_END)
        if file.tell() > CHECKSUM_SPAN:
            file.seek(max(file.tell() - CHECKSUM_SPAN, CHECKSUM_SPAN))
            crc = zlib.crc32(file.read(), crc)
    return crc


def write_manifest(directory: Path, step: int) -> None:
    """Record every file of the checkpoint with its size and checksum (call once all are written)."""
    files = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "crc32": checksum(p)}
             for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))


def _file_problem(path: Path, name: str, recorded: dict) -> str | None:
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != recorded["bytes"]:
        return f"{name} has {size} bytes, {recorded['bytes']} when saved"
    if checksum(path) != recorded["crc32"]:
        return f"{name} differs from what was saved (checksum)"
    return None


def problem_with(directory: Path) -> str | None:
    """Why `directory` is not a complete, intact checkpoint (naming the first bad file), or None."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
        for name, recorded in files.items():
            problem = _file_problem(directory / name, name, recorded)
            if problem:
                return problem
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return f"unreadable {MANIFEST}: {type(error).__name__}: {error}"
    return None


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


def step_dirs(root: Path) -> list[Path]:
    """Every `global_step_N` directory under `root`, complete or not, oldest first."""
    return sorted((p for p in root.glob("global_step_*") if p.is_dir() and STEP_DIR.fullmatch(p.name)),
                  key=step_of) if root.is_dir() else []


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first; incomplete ones are skipped with a warning."""
    found = []
    for path in step_dirs(root):
        problem = problem_with(path)
        if problem:
            logger.warning("skipping checkpoint %s: %s", path, problem)
        else:
            found.append(path)
    return found


def remove_oldest(root: Path, keep: int) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `keep`; incomplete ones are left alone.

    The checkpoint `latest` names (the one just published) is always kept and counts as one of
    `keep`, whatever its step: retention never deletes the work it was called to protect."""
    if keep <= 0:
        return []
    pointer = root / "latest"
    current = root / pointer.read_text().strip() if pointer.is_file() else None
    others = [path for path in complete_checkpoints(root) if path != current]
    room = keep - 1 if current is not None else keep
    doomed = others[: max(len(others) - room, 0)]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
