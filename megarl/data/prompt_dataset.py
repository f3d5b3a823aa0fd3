"""Tokenized prompts of parquet files at any size: a one-time tokenized cache, memory-mapped by the
ranks of a node.

Why a cache rather than tokenizing when a prompt is sampled: prompts over `max_prompt_length` tokens
are dropped before the sampler numbers the prompts, so every prompt's length must be known up front;
and parquet is compressed and encoded, so reading it decodes every row into each rank's memory. The
first rank of a node to open a file therefore validates and tokenizes it once, one batch of rows at a
time, into an uncompressed Arrow IPC file in the node's temporary directory; every rank then maps
that file. The operating system shares its pages between the ranks and reads only those touched; a
rank's own memory holds the per-row index of kept prompts (8 bytes a row) and nothing else per row.

The cache's name hashes the file (path, size, modification time), the tokenizer (its serialized
model, chat template and the special tokens it surrounds a text with), whether the template is applied
and the tools it offers: a change in any of them builds a new one. The ranks of a node take turns on a
file lock: one builds, the others map its result. A bad row fails the build, so each rank in turn fails
with the same one-line error naming the file and row. Opening a cache marks it used (its modification
time); before each build, the caches no job opened for a week are deleted, so the directory holds what
recent jobs use, not every tokenization ever made.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from megarl.data.dataset import Prompt, checked_batches, open_parquet
from megarl.data.tokenization import flawed_prompts_error, prompt_flaws, unchecked_prompt_ids, uses_chat_template

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
"""Bump when the cache's columns change, so old caches are not read."""

DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / f"megarl-prompt-cache-{os.getuid()}"
"""Node-local and per user: the ranks of a node share one cache, each node builds its own."""

UNUSED_CACHE_SECONDS = 7 * 24 * 3600
"""A cache no job opened for a week is deleted when the next one is built."""


class PromptDataset:
    """Tokenized prompts of parquet files; prompts over `max_prompt_length` tokens are dropped.

    Chat messages go through the tokenizer's chat template (with the generation prompt) when
    `apply_chat_template` is set and the tokenizer has one; otherwise, and always for a plain
    string prompt, the raw text is used (message contents joined by newlines). Special tokens are
    those of the template, or the tokenizer's for raw text (`megarl.data.tokenization`). `tools`: the
    JSON schemas the template offers (`megarl.agent.tools.tool_schemas`): its tools preamble opens each
    chat prompt, as it opens each multi-turn trajectory.
    """

    def __init__(self, files: list[str], tokenizer, max_prompt_length: int, apply_chat_template: bool = True,
                 cache_dir: str | Path | None = None, tools: list[dict] | None = None):
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be at least 1, got {max_prompt_length}")
        started = time.perf_counter()
        self.files = [str(f) for f in ([files] if isinstance(files, (str, Path)) else files)]
        if not self.files:
            raise ValueError("no data files given")
        for file in self.files:  # footer checks of every file first: a typo fails before any tokenizing
            open_parquet(file)
        self.tables, self.num_built = [], 0
        tokenization = _tokenizer_fingerprint(tokenizer, apply_chat_template, tools)
        for file in self.files:
            table, built = _mapped_tokens(file, tokenizer, apply_chat_template, tools, tokenization,
                                          Path(cache_dir or DEFAULT_CACHE_DIR))
            self.tables.append(table)
            self.num_built += built
        self.starts = np.cumsum([0] + [table.num_rows for table in self.tables])
        self.num_rows = int(self.starts[-1])
        self.kept = np.concatenate([start + np.flatnonzero(_lengths(table) <= max_prompt_length)
                                    for start, table in zip(self.starts, self.tables)])
        self.num_filtered = self.num_rows - len(self.kept)
        if not len(self.kept):
            raise ValueError(f"all {self.num_rows} prompts of {', '.join(self.files)} are longer than "
                             f"max_prompt_length={max_prompt_length} tokens")
        if self.num_filtered:
            logger.warning("filtered %d of %d prompts longer than %d tokens from %s",
                           self.num_filtered, self.num_rows, max_prompt_length, ", ".join(self.files))
        self.open_seconds = time.perf_counter() - started

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, i: int) -> Prompt:
        index = int(self.kept[i])
        file = int(np.searchsorted(self.starts, index, side="right")) - 1
        table, row = self.tables[file], index - int(self.starts[file])
        extra_info = (table.column("extra_info")[row].as_py(maps_as_pydicts="strict")
                      if "extra_info" in table.column_names else None)
        return Prompt(table.column("prompt_ids")[row].values.to_pylist(), table.column("data_source")[row].as_py(),
                      table.column("ground_truth")[row].as_py(), extra_info or {}, index,
                      f"{self.files[file]}: row {row}")

    def describe(self) -> str:
        """One line for the start-up log: sizes and the time it took to open the files."""
        how = f"tokenized {self.num_built} of {len(self.files)} files now" if self.num_built else "cached tokens"
        return (f"{len(self)} prompts ({self.num_rows} rows, {self.num_filtered} over max_prompt_length) "
                f"opened in {self.open_seconds:.1f} s ({how})")


def _lengths(table: pa.Table) -> np.ndarray:
    """Token count of every row, from the list offsets alone (no token is read). The offsets are
    viewed with `np.frombuffer`: pyarrow's `to_numpy` of a mapped array allocated ~0.5 MiB a call."""
    return np.concatenate([np.diff(np.frombuffer(chunk.buffers()[1], np.int32, len(chunk) + 1, 4 * chunk.offset))
                           for chunk in table.column("prompt_ids").chunks])


def _mapped_tokens(file: str, tokenizer, apply_chat_template: bool, tools: list[dict] | None, tokenization: str,
                   cache_dir: Path) -> tuple[pa.Table, bool]:
    """The file's tokenized cache, memory-mapped (built first if missing), and whether this call built it."""
    stat = os.stat(file)
    parts = (CACHE_FORMAT, str(Path(file).resolve()), stat.st_size, stat.st_mtime_ns, tokenization)
    path = cache_dir / f"{Path(file).stem}-{hashlib.sha256(repr(parts).encode()).hexdigest()[:24]}.arrow"
    built = False
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # held while mapping: a pruner (holding it exclusively) waits
        if not path.is_file():
            fcntl.flock(lock, fcntl.LOCK_EX)  # one rank of the node builds, the others wait and map
            if not path.is_file():
                remove_unused_caches(cache_dir)
                _build(file, tokenizer, apply_chat_template, tools, path)
                built = True
        os.utime(path)  # its modification time is its last use
        return pa.ipc.open_file(pa.memory_map(str(path))).read_all(), built


def remove_unused_caches(cache_dir: Path, max_age_seconds: float = UNUSED_CACHE_SECONDS) -> list[Path]:
    """Delete the caches of `cache_dir` no job has opened for `max_age_seconds` (and their locks), skipping
    any a job is opening now (its lock is held); returns those deleted. Run before each build: a new cache
    is made when a file or tokenizer changed, which is what leaves old ones unused."""
    removed = []
    for cache in cache_dir.glob("*.arrow"):
        with open(cache.with_suffix(".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being opened or built
            try:
                if time.time() - cache.stat().st_mtime > max_age_seconds:
                    cache.unlink()
                    cache.with_suffix(".lock").unlink()
                    removed.append(cache)
            except FileNotFoundError:  # removed by another job's pruning meanwhile
                pass
    return removed


def _tokenizer_fingerprint(tokenizer, apply_chat_template: bool, tools: list[dict] | None) -> str:
    """A hash of everything that decides a prompt's ids: the tokenizer's model and rules, its chat
    template, the special tokens it surrounds a text with, whether the template is used and the tools
    it offers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = (type(tokenizer).__name__, model, tokenizer.chat_template, tokenizer("")["input_ids"],
             uses_chat_template(tokenizer, apply_chat_template), json.dumps(tools or [], sort_keys=True))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _build(file: str, tokenizer, apply_chat_template: bool, tools: list[dict] | None, path: Path) -> None:
    """Validate and tokenize `file` batch by batch into the Arrow IPC file `path` (atomically)."""
    fields = [pa.field("prompt_ids", pa.list_(pa.int32())), pa.field("data_source", pa.string()),
              pa.field("ground_truth", pa.string())]
    source_schema = open_parquet(file).schema_arrow
    has_extra_info = "extra_info" in source_schema.names
    if has_extra_info:  # kept as written; read back row by row
        fields.append(source_schema.field("extra_info"))
    schema = pa.schema(fields)
    doubled: list[int] = []
    empty: list[int] = []
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            start = 0
            for batch, rows in checked_batches(file):
                ids = unchecked_prompt_ids([row["prompt"] for row in rows], tokenizer, apply_chat_template, tools)
                flaws = prompt_flaws(ids, tokenizer)
                doubled += [start + i for i in flaws[0]]
                empty += [start + i for i in flaws[1]]
                columns = [pa.array(ids, pa.list_(pa.int32())),
                           pa.array([row["data_source"] for row in rows], pa.string()),
                           pa.array([row["reward_model"]["ground_truth"] for row in rows], pa.string())]
                if has_extra_info:
                    columns.append(batch.column("extra_info"))
                writer.write_batch(pa.record_batch(columns, schema=schema))
                start += batch.num_rows
        error = flawed_prompts_error(file, doubled, empty, start, tokenizer, apply_chat_template)
        if error is not None:
            raise error
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
