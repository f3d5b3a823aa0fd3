"""Split placement's weight sync from a TP2 trainer into two `hf` engines on two rollout ranks: both engines
hold weights bit-identical to the HF export of the trained model, one fed by the trainers and one by
broadcast, and each received exactly the export's bytes (an engine at TP1 needs every tensor whole)."""

from __future__ import annotations

import json

from tests.conftest import ROOT, assert_succeeded, torchrun


def test_split_sync_is_bit_identical_to_the_export(tiny_models, tmp_path):
    assert_succeeded(torchrun(4, ROOT / "tests/distributed/scripts/split_sync_checks.py",
                              "--hf", tiny_models["qwen2-untied"], "--out", tmp_path))
    reports = [json.loads((tmp_path / f"report_{rank}.json").read_text()) for rank in (2, 3)]
    assert [report["fed_by"] for report in reports] == ["trainers", "broadcast"]
    for report in reports:
        assert report["bit_identical"] and report["tensors"] > 10 and report["buckets"] > 1, report
        assert report["bytes_received"] == report["lower_bound"] == report["export_bytes"], report
