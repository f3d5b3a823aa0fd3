"""HuggingFace safetensors checkpoints: lazy slice reads and sharded writes.

A reader opens `model.safetensors` or the shards listed in `model.safetensors.index.json` and
reads only the requested slice of a tensor (safetensors maps the file, so untouched bytes are
never loaded): each rank materialises its own shards, never the whole model.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsReader:
    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        index_path = os.path.join(model_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                self._file_of = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(model_dir, SINGLE_FILE)):
            with safe_open(os.path.join(model_dir, SINGLE_FILE), framework="pt") as handle:
                self._file_of = {name: SINGLE_FILE for name in handle.keys()}
        else:
            raise FileNotFoundError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}; expected HF safetensors weights")
        self._handles = {}

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"{self.model_dir}: tensor {name!r} is not in the checkpoint")
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.model_dir, file), framework="pt")
        return self._handles[file]

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of tensor `name`."""
        tensor_slice = self._handle(name).get_slice(name)
        index = (slice(None),) * dim + (slice(start, stop),)
        return tensor_slice[index]

    def read_all(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def fingerprint(self) -> str:
        """A hash of every tensor's name, shape, dtype and first and last rows: a few bytes of each, read in
        moments at any size, in which another model of the same architecture (a fine-tune of it) differs."""
        digest = hashlib.sha256()
        for name in self.names():
            tensor_slice = self._handle(name).get_slice(name)
            shape = tensor_slice.get_shape()
            digest.update(f"{name} {shape} {tensor_slice.get_dtype()}".encode())
            rows = [tensor_slice[:1], tensor_slice[-1:]] if shape else [self.read_all(name)]
            for row in rows:
                digest.update(row.reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def write_shard(tensors: dict[str, torch.Tensor], out_dir: str, shard_index: int, num_shards: int) -> str:
    """Write one shard file; returns its file name (for the index)."""
    file = SINGLE_FILE if num_shards == 1 else f"model-{shard_index + 1:05d}-of-{num_shards:05d}.safetensors"
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    path = os.path.join(out_dir, file)
    save_file(contiguous, path, metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600); give the shard the mode
    # every other file of the export gets, so whoever can read the config can read the weights.
    os.chmod(path, 0o666 & ~_umask())
    return file


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def write_index(weight_map: dict[str, str], total_bytes: int, out_dir: str) -> None:
    if set(weight_map.values()) == {SINGLE_FILE}:
        return
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
