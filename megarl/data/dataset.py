"""Prompt rows in the common RL parquet layout: reading, validating, writing.

One row: `prompt` (list of `{role, content}` messages, or a plain string for base models; with
some text), `data_source` (str, selects the rule scorer), `ability` (str), `reward_model`
(`{"style": "rule", "ground_truth": str}`), `extra_info` (dict or null). `prompt`, `data_source`
and `reward_model` are required; `ability` defaults to "" and `extra_info` to {}.

Every problem with a file is one ValueError line naming the file, the row index (0-based, as
pyarrow counts) and the column, and saying what was expected.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.messages import one_line

REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")
PROMPT_EXPECTED = "a non-empty list of {role: str, content: str} dicts or a str"
# An empty prompt tokenizes to nothing (or a bare template) and vLLM rejects it mid-step.
PROMPT_TEXT_EXPECTED = "some text (a non-empty str, or a message with non-empty content)"


def _describe(value: Any) -> str:
    text = one_line(repr(value))
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _check_row(file: str, index: int, row: dict) -> dict:
    """The row with defaults filled in; ValueError naming file, row and column if a value is wrong."""

    def fail(column: str, expected: str, value: Any) -> ValueError:
        return ValueError(f"{file}: row {index}, column {column!r}: expected {expected}, got {_describe(value)}")

    prompt = row["prompt"]
    valid_messages = isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    if not (isinstance(prompt, str) or valid_messages):
        raise fail("prompt", PROMPT_EXPECTED, prompt)
    if not (prompt.strip() if isinstance(prompt, str) else any(m["content"].strip() for m in prompt)):
        raise fail("prompt", PROMPT_TEXT_EXPECTED, prompt)
    if not isinstance(row["data_source"], str):
        raise fail("data_source", "a str", row["data_source"])
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise fail("reward_model", "a dict with a 'ground_truth' key", reward_model)
    if not isinstance(reward_model["ground_truth"], str):
        raise fail("reward_model.ground_truth", "a str", reward_model["ground_truth"])
    ability = row.get("ability", "")
    if ability is not None and not isinstance(ability, str):
        raise fail("ability", "a str or null", ability)
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise fail("extra_info", "a dict or null", extra_info)
    if isinstance(prompt, list):  # parquet fills absent struct fields with None: keep what was written
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    return {**row, "prompt": prompt, "ability": ability or "", "extra_info": extra_info or {}}


def _read_table(file: str) -> pa.Table:
    if not Path(file).is_file():
        raise ValueError(f"{file}: data file does not exist")
    try:
        return pq.read_table(file)
    except Exception as exc:  # ArrowInvalid, OSError...: whatever pyarrow says, it is not a parquet file
        raise _not_parquet(file, exc) from exc


def _not_parquet(file: str, exc: Exception) -> ValueError:
    return ValueError(f"{file}: cannot read as parquet ({type(exc).__name__}: {one_line(exc)})")


def open_parquet(file: str) -> pq.ParquetFile:
    """The file, checked from its footer alone: it exists, is parquet, has the required columns and rows."""
    if not Path(file).is_file():
        raise ValueError(f"{file}: data file does not exist")
    try:
        parquet = pq.ParquetFile(file)
    except Exception as exc:
        raise _not_parquet(file, exc) from exc
    columns = parquet.schema_arrow.names
    for column in REQUIRED_COLUMNS:
        if column not in columns:
            raise ValueError(f"{file}: missing column {column!r} (columns: {', '.join(columns)})")
    if parquet.metadata.num_rows == 0:
        raise ValueError(f"{file}: the file has 0 rows")
    return parquet


def checked_batches(file: str, batch_size: int = 8192) -> Iterator[tuple[pa.RecordBatch, list[dict]]]:
    """The file's record batches, each with its rows validated (defaults filled in): memory bounded
    by one batch whatever the file's length; ValueError on the first problem."""
    parquet = open_parquet(file)
    start = 0
    batches = parquet.iter_batches(batch_size)
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # a page that does not decode
            raise _not_parquet(file, exc) from exc
        if batch is None:
            return
        records = batch.to_pylist(maps_as_pydicts="strict")
        yield batch, [_check_row(file, start + index, row) for index, row in enumerate(records)]
        start += batch.num_rows


def load_rows(files: list[str]) -> list[dict]:
    """All rows of the parquet `files`, in order, validated; ValueError on the first problem."""
    if isinstance(files, (str, Path)):
        files = [files]
    if not files:
        raise ValueError("no data files given")
    return [row for file in map(str, files) for _, rows in checked_batches(file) for row in rows]


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows in the layout to a parquet file (creating its directory); returns the path."""
    if not rows:
        raise ValueError(f"{path}: refusing to write a file with 0 rows")
    if all(not row.get("extra_info") for row in rows):
        # Parquet cannot store a struct without fields; load_rows reads a missing column as {}.
        rows = [{k: v for k, v in row.items() if k != "extra_info"} for row in rows]
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(f"{path}: rows do not share one schema ({one_line(exc)})") from exc
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def read_records(path: str | Path) -> list[dict]:
    """Records of a local .jsonl, .json (a list of objects, or one object) or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: input file does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_table(str(path)).to_pylist(maps_as_pydicts="strict")
    if suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: expected a .jsonl, .json or .parquet file")
    text = path.read_text(encoding="utf-8")
    if suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {number} is not valid JSON ({exc.msg})") from exc
        return records
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    return loaded if isinstance(loaded, list) else [loaded]


@dataclass
class Prompt:
    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict
    index: int
    """Position in the concatenated files, before filtering."""
    origin: str = ""
    """Where the prompt was read, `FILE: row N`, for messages about it ('' for a prompt made in code)."""
