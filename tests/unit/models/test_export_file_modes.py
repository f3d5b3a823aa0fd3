"""Exported weight files get the same permissions as the other files of an export (the umask's)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from megarl.models.hf_checkpoint import SafetensorsReader, write_shard


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield
    os.umask(previous)


def test_a_written_shard_has_the_mode_open_gives_any_new_file(tmp_path, umask_027):
    tensors = {"model.embed_tokens.weight": torch.arange(6.0).reshape(2, 3)}
    names = [write_shard(tensors, str(tmp_path), 0, 1), write_shard(tensors, str(tmp_path), 1, 2)]
    with open(tmp_path / "config.json", "w") as file:  # how every other export file is written
        json.dump({}, file)
    assert stat.S_IMODE(os.stat(tmp_path / "config.json").st_mode) == 0o640
    for name in names:
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o640, name
    assert torch.equal(SafetensorsReader(str(tmp_path)).read_all("model.embed_tokens.weight"),
                       tensors["model.embed_tokens.weight"])
