"""Split placement's bridge, on 2 trainer ranks (DP2) and 3 rollout ranks with an `hf` engine each.

Weights out, of a mixture-of-experts model: every engine holds weights bit-identical to the HF export of the
trained model; the first two are fed by one trainer DP replica each, the experts included (each trainer rank,
a replica and an expert replica of its own, sends the whole export once), the third by broadcast from the
first; each engine received exactly the export's bytes (an engine at TP1 needs every tensor whole). A batch
in: each trainer rank holds the responses (token ids, log-probs, loss masks) of the sequences it wants,
exactly as the first rollout rank sent them, and none of the others; every rank holds every sequence's score
and prompt (the trajectory's opening) and the batch's staleness.
"""

from __future__ import annotations

import json

from tests.conftest import ROOT, assert_succeeded, torchrun

WANTED = [[0, 2, 5], [1, 3, 4]]  # as the script's


def test_split_bridge_moves_weights_and_batches_exactly(tiny_moe_models, tmp_path):
    assert_succeeded(torchrun(5, ROOT / "tests/distributed/scripts/split_sync_checks.py",
                              "--hf", tiny_moe_models["qwen3-moe"], "--out", tmp_path))
    reports = [json.loads((tmp_path / f"report_{rank}.json").read_text()) for rank in range(5)]
    trainers, engines = reports[:2], reports[2:]
    assert [report["fed_by"] for report in engines] == ["trainers", "trainers", "broadcast"]
    export_bytes = engines[0]["export_bytes"]
    for report in engines:
        assert report["bit_identical"] and report["tensors"] > 10 and report["buckets"] > 1, report
        assert report["bytes_received"] == report["lower_bound"] == export_bytes, report
    assert [report["bytes_sent"] for report in trainers] == [export_bytes, export_bytes]

    sent = engines[0]["sent"]
    ages = [sent["step"] - 1 - version for versions in sent["token_versions"] for version in versions]
    for rank, report in enumerate(trainers):
        for i in range(len(sent["scores"])):
            held = i in WANTED[rank]
            assert report["response_ids"][i] == (sent["response_ids"][i] if held else None), (rank, i)
            assert report["logprobs"][i] == (sent["logprobs"][i] if held else None), (rank, i)
            assert report["loss_masks"][i] == (sent["loss_masks"][i] if held else None), (rank, i)
            assert report["openings"][i] == (sent["openings"][i] if held else None), (rank, i)
        assert report["opening_lengths"] == [len(opening) for opening in sent["openings"]]
        assert report["scores"] == sent["scores"]
        assert report["staleness"] == max(ages) == 1
        assert report["multi_version_responses"] == sum(len(set(v)) > 1 for v in sent["token_versions"]) / 6
