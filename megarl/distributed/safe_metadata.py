"""Loading torch.distributed.checkpoint metadata without arbitrary code execution.

megatron-core's dist checkpoints (torch_dist format) keep their index in a pickled `.metadata`
file, which torch reads with a plain `pickle.load`: a crafted file could run code. We give torch's
filesystem reader an unpickler that only builds the classes such metadata consists of (the
`torch.distributed.checkpoint` dataclasses, torch sizes, dtypes and layouts, plain containers) and
refuses anything else, naming it. Writing is unchanged.
"""

from __future__ import annotations

import io
import pickle
import types

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
            "torch.distributed.checkpoint.filesystem")
_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in _MODULES or (module, name) in _GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed there")


def load(file) -> object:
    return MetadataUnpickler(file).load()


def loads(data: bytes) -> object:
    return load(io.BytesIO(data))


def install() -> None:
    """Route torch's checkpoint-metadata reads through `MetadataUnpickler` (idempotent)."""
    shim = types.SimpleNamespace(load=load, loads=loads, dump=pickle.dump, dumps=pickle.dumps,
                                 HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL)
    dcp_filesystem.pickle = shim
