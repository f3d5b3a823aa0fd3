"""A complete checkpoint with one small shard, published the way the trainer publishes its own."""

from __future__ import annotations

from pathlib import Path

from megarl.checkpoint.directory import partial_dir, publish, write_manifest


def publish_fake_checkpoint(root: Path, step: int, payload: bytes = b"weights") -> Path:
    staging = partial_dir(root, step)
    (staging / "actor").mkdir(parents=True)
    (staging / "actor" / "shard.distcp").write_bytes(payload)
    write_manifest(staging, step)
    return publish(root, step)
