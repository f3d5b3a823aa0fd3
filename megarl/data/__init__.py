"""Prompt data: the parquet layout, tokenized prompt datasets, resumable sampling.

Synthetic tasks live in `megarl.data.synthetic` (not imported here, so `python -m` runs it cleanly).
"""

from megarl.data.dataset import Prompt, load_rows, read_records, write_rows
from megarl.data.prompt_dataset import PromptDataset
from megarl.data.sampler import ResumableSampler

__all__ = [
    "Prompt",
    "PromptDataset",
    "ResumableSampler",
    "load_rows",
    "read_records",
    "write_rows",
]
