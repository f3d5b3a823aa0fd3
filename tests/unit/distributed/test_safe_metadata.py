"""Checkpoint metadata loads without arbitrary code execution."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from megarl.distributed import safe_metadata

safe_metadata.install()  # what `megarl.distributed.process.configure_process` does at start-up


class Exploit:
    def __reduce__(self):
        return os.system, ("echo pwned",)


def test_real_metadata_round_trips_through_torch_reader():
    metadata = Metadata(state_dict_metadata={"decoder.weight": TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size([4, 8]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 8])),
                ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 8]))])})
    loaded = dcp_filesystem.pickle.load(io.BytesIO(pickle.dumps(metadata)))
    assert loaded == metadata


def test_code_in_metadata_is_refused_naming_it():
    with pytest.raises(pickle.UnpicklingError, match=r"refers to (posix|os)\.system"):
        dcp_filesystem.pickle.load(io.BytesIO(pickle.dumps(Exploit())))
