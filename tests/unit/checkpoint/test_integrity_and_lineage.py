"""Damaged shards are found by size and checksum; retention and `resume_mode=disable` never mix runs."""

from __future__ import annotations

import logging
import os
import zlib

import pytest

from megarl.checkpoint import CheckpointError, Checkpointer
from megarl.checkpoint.directory import (
    CHECKSUM_SPAN,
    checksum,
    complete_checkpoints,
    partial_dir,
    remove_oldest,
)
from tests.unit.checkpoint.fake_checkpoint import publish_fake_checkpoint


def _checkpointer(root):
    return Checkpointer(root, "unused", root / "config.yaml", max_to_keep=0)


@pytest.mark.parametrize("size", [10, CHECKSUM_SPAN + 7, 3 * CHECKSUM_SPAN])
def test_checksum_covers_the_first_and_last_mib(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "file").write_bytes(data)
    # Computed by hand: the head, then the tail that does not overlap it.
    expected = zlib.crc32(data[:CHECKSUM_SPAN] + data[max(size - CHECKSUM_SPAN, CHECKSUM_SPAN):])
    assert checksum(tmp_path / "file") == expected


def test_a_shard_truncated_to_zero_bytes_is_skipped_for_the_previous(tmp_path, caplog):
    publish_fake_checkpoint(tmp_path, 1)
    publish_fake_checkpoint(tmp_path, 2)
    (tmp_path / "global_step_2" / "actor" / "shard.distcp").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert _checkpointer(tmp_path).find("auto", "") == tmp_path / "global_step_1"
    assert "global_step_2: actor/shard.distcp has 0 bytes, 7 when saved" in caplog.text


def test_a_checkpoint_without_placement_state_stops_with_its_name(tmp_path):
    """Checkpoints saved before the placement's state was (2026-11-27) cannot resume: one line says so, on every rank
    alike, before any collective."""
    directory = publish_fake_checkpoint(tmp_path, 3)
    with pytest.raises(CheckpointError, match=rf"^{directory}: has no placement.pt \(checkpoints saved before"):
        _checkpointer(tmp_path).load(directory, engines={})


def test_a_shard_overwritten_in_place_fails_its_checksum(tmp_path, caplog):
    publish_fake_checkpoint(tmp_path, 1, os.urandom(3 * CHECKSUM_SPAN))
    shard = tmp_path / "global_step_1" / "actor" / "shard.distcp"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # same size, one byte of the last MiB changed
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert complete_checkpoints(tmp_path) == []
    assert "actor/shard.distcp differs from what was saved (checksum)" in caplog.text
    with pytest.raises(CheckpointError, match="shard.distcp differs from what was saved"):
        _checkpointer(tmp_path).find("path", str(tmp_path / "global_step_1"))


def test_retention_keeps_the_checkpoint_just_published_whatever_its_step(tmp_path):
    # A run that rolled back to step 1 (resume_mode=path) publishes step 2 beside a newer step 6:
    # keeping the highest steps would delete the work just saved and leave `latest` dangling.
    for step in (1, 6, 2):
        publish_fake_checkpoint(tmp_path, step)
    assert [p.name for p in remove_oldest(tmp_path, keep=1)] == ["global_step_1", "global_step_6"]
    assert (tmp_path / "latest").read_text() == "global_step_2" and (tmp_path / "global_step_2").is_dir()
    publish_fake_checkpoint(tmp_path, 3)
    assert [p.name for p in remove_oldest(tmp_path, keep=2)] == []
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["global_step_2", "global_step_3"]


def test_auto_resumes_from_what_latest_names_not_the_highest_step(tmp_path, caplog):
    # A run rolled back to step 1 published step 2 beside the abandoned step 6: it continues from 2.
    for step in (1, 6, 2):
        publish_fake_checkpoint(tmp_path, step)
    assert _checkpointer(tmp_path).find("auto", "") == tmp_path / "global_step_2"
    (tmp_path / "global_step_2" / "actor" / "shard.distcp").write_bytes(b"")  # then its checkpoint is damaged
    with caplog.at_level(logging.WARNING):
        assert _checkpointer(tmp_path).find("auto", "") == tmp_path / "global_step_1"  # its own past, not step 6
    assert "latest names" in caplog.text and "global_step_2" in caplog.text


def test_disable_refuses_a_directory_holding_an_earlier_runs_checkpoints(tmp_path):
    assert _checkpointer(tmp_path / "absent").find("disable", "") is None
    partial_dir(tmp_path, 1).mkdir()  # a save that never finished is no run to mix with
    assert _checkpointer(tmp_path).find("disable", "") is None
    publish_fake_checkpoint(tmp_path, 6)
    with pytest.raises(CheckpointError) as error:
        _checkpointer(tmp_path).find("disable", "")
    message = str(error.value)
    assert "\n" not in message and "global_step_6" in message and str(tmp_path) in message
    for key in ("trainer.resume_mode", "trainer.experiment_name", "trainer.checkpoint_dir"):
        assert key in message
