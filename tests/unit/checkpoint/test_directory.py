"""Checkpoint directories: atomic publication, retention, and damaged checkpoints."""

from __future__ import annotations

import logging
import shutil

import pytest

from megarl.checkpoint import CheckpointError, Checkpointer
from megarl.checkpoint.directory import (
    complete_checkpoints,
    partial_dir,
    problem_with,
    remove_oldest,
)
from tests.unit.checkpoint.fake_checkpoint import publish_fake_checkpoint


def test_publish_renames_and_points_latest(tmp_path):
    path = publish_fake_checkpoint(tmp_path, 3)
    assert path.name == "global_step_3" and not partial_dir(tmp_path, 3).exists()
    assert (tmp_path / "latest").read_text() == "global_step_3" and problem_with(path) is None


def test_retention_keeps_exactly_the_newest_complete(tmp_path):
    for step in (1, 2, 3, 4, 5):
        publish_fake_checkpoint(tmp_path, step)
    partial_dir(tmp_path, 6).mkdir()  # a save in progress is never counted or deleted
    removed = remove_oldest(tmp_path, keep=2)
    assert [p.name for p in removed] == ["global_step_1", "global_step_2", "global_step_3"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["global_step_4", "global_step_5"]
    assert partial_dir(tmp_path, 6).is_dir()


def test_damaged_checkpoints_are_skipped_with_a_warning_naming_them(tmp_path, caplog):
    publish_fake_checkpoint(tmp_path, 1)
    publish_fake_checkpoint(tmp_path, 2)
    (tmp_path / "global_step_2" / "actor" / "shard.distcp").unlink()  # damaged by hand
    shutil.copytree(tmp_path / "global_step_1", tmp_path / "global_step_3")
    (tmp_path / "global_step_3" / "manifest.json").unlink()  # copied without its manifest
    with caplog.at_level(logging.WARNING):
        complete = complete_checkpoints(tmp_path)
    assert [p.name for p in complete] == ["global_step_1"]
    assert "global_step_2" in caplog.text and "actor/shard.distcp is missing" in caplog.text
    assert "global_step_3" in caplog.text and "did not finish" in caplog.text
    checkpointer = Checkpointer(tmp_path, "unused", tmp_path / "config.yaml", max_to_keep=0)
    assert checkpointer.find("auto", "") == tmp_path / "global_step_1"


@pytest.mark.parametrize("name,needle", [("global_step_2", "actor/shard.distcp is missing"),
                                         ("global_step_9", "no such directory")])
def test_explicit_bad_path_fails_naming_it(tmp_path, name, needle):
    publish_fake_checkpoint(tmp_path, 2)
    (tmp_path / "global_step_2" / "actor" / "shard.distcp").unlink()
    checkpointer = Checkpointer(tmp_path, "unused", tmp_path / "config.yaml", max_to_keep=0)
    with pytest.raises(CheckpointError, match=f"trainer.resume_path=.*{name}: not a usable checkpoint: {needle}"):
        checkpointer.find("path", str(tmp_path / name))
