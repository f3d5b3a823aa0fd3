"""Rollout corrections against a token-by-token reference written from their definitions, and by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megarl.algorithms import ROLLOUT_CORRECTIONS, RolloutCorrection, correct_rollout

PRESETS = {  # the sources' definitions and default bounds, written out again (docs/algorithms.md)
    "none": RolloutCorrection(),
    "token_tis": RolloutCorrection(weights="token", cap=2.0),
    "seq_tis": RolloutCorrection(weights="sequence", cap=2.0),
    "token_mis": RolloutCorrection(weights="token", rejection="token", lower=0.5, upper=2.0),
    "seq_mis": RolloutCorrection(weights="sequence", rejection="sequence", lower=0.5, upper=2.0),
    "icepop": RolloutCorrection(weights="token", rejection="token", lower=0.5, upper=5.0),
    "geo_rs": RolloutCorrection(rejection="geometric", lower=0.999, upper=1.001),
    "geo_rs_token_tis": RolloutCorrection(weights="token", cap=2.0, rejection="geometric", lower=0.999, upper=1.001),
}


def reference(correction: RolloutCorrection, train, rollout, lengths, current=None, advantages=None):
    """Weights, keep flags and counts of each sequence's first `lengths[i]` tokens, with Python floats."""
    weights, keeps, counts = [], [], dict.fromkeys(("kept", "clipped", "masked", "weight", "opsm", "seq_kept",
                                                    "seq_clipped", "seq_masked"), 0.0)
    for i, length in enumerate(lengths):
        d = [float(train[i][t] - rollout[i][t]) for t in range(length)]
        sequence_ratio = math.exp(min(max(sum(d), -20.0), 20.0))
        geometric_ratio = math.exp(sum(d) / length) if length else 1.0
        drift = sum(float(rollout[i][t] - current[i][t]) for t in range(length)) / max(length, 1) if current else 0
        row_weights, row_keep, clipped_any, masked_any = [], [], False, False
        for t in range(length):
            ratio = {"none": 1.0, "token": math.exp(d[t]), "sequence": sequence_ratio}[correction.weights]
            statistic = {"none": 1.0, "token": math.exp(d[t]), "sequence": math.exp(sum(d)),
                         "geometric": geometric_ratio}[correction.rejection]
            keep = correction.lower <= statistic <= correction.upper
            opsm = correction.opsm_delta > 0 and float(advantages[i][t]) < 0 and drift > correction.opsm_delta
            keep = keep and not opsm
            clipped = keep and ratio > correction.cap
            row_weights.append(min(ratio, correction.cap) if keep else 0.0)
            row_keep.append(keep)
            counts["kept"] += keep
            counts["clipped"] += clipped
            counts["masked"] += not keep
            counts["opsm"] += opsm
            counts["weight"] += row_weights[-1]
            clipped_any, masked_any = clipped_any or clipped, masked_any or not keep
        counts["seq_kept"] += length > 0 and not masked_any
        counts["seq_clipped"] += clipped_any
        counts["seq_masked"] += masked_any
        weights.append(row_weights)
        keeps.append(row_keep)
    return weights, keeps, counts


def _random_batch(seed: int, scale: float):
    generator = torch.Generator().manual_seed(seed)
    lengths = [7, 1, 0, 12, 5, 12]
    mask = torch.zeros(6, 12)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    train = -torch.rand(6, 12, generator=generator) * 3
    rollout = train + scale * torch.randn(6, 12, generator=generator)
    rollout[mask == 0] = float("inf")  # garbage at padding must not leak
    current = train + scale * torch.randn(6, 12, generator=generator)
    advantages = torch.randn(6, 1, generator=generator).expand(6, 12) * mask
    return train, rollout, mask, lengths, current, advantages


SCALES = (0.003, 0.3, 2.0)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("opsm_delta", [0.0, 0.05])
def test_every_preset_matches_the_reference(name, scale, opsm_delta):
    # Scales: geo_rs's band is met by some sequences at 0.003 and missed at 0.3; the ratio bands are met and
    # missed at 0.3; at 2.0 most tokens leave every band and many weights hit the cap.
    correction = ROLLOUT_CORRECTIONS.get(name).with_bounds(opsm_delta=opsm_delta)
    train, rollout, mask, lengths, current, advantages = _random_batch(seed=sorted(PRESETS).index(name), scale=scale)
    out = correct_rollout(correction, train, rollout, mask, current, advantages)
    weights, keeps, counts = reference(correction, train.tolist(), rollout.tolist(), lengths, current.tolist(),
                                       advantages.tolist())
    for i, length in enumerate(lengths):
        torch.testing.assert_close(out.weights_BR[i, :length], torch.tensor(weights[i]), rtol=1e-5, atol=1e-7)
        assert out.keep_BR[i, :length].tolist() == [float(k) for k in keeps[i]]
        assert torch.equal(out.weights_BR[i, length:], torch.zeros(12 - length))
        assert torch.equal(out.keep_BR[i, length:], torch.zeros(12 - length))
    tokens, sequences = out.token_counts, out.sequence_counts
    assert float(tokens["token_kept_fraction"]) == counts["kept"]
    assert float(tokens["token_clipped_fraction"]) == counts["clipped"]
    assert float(tokens["token_masked_fraction"]) == counts["masked"]
    assert float(tokens["weight_mean"]) == pytest.approx(counts["weight"], rel=1e-5)
    assert float(tokens.get("opsm_token_masked_fraction", 0.0)) == counts["opsm"]
    assert ("opsm_token_masked_fraction" in tokens) == (opsm_delta > 0)
    assert [float(sequences[f"seq_{kind}_fraction"]) for kind in ("kept", "clipped", "masked")] == [
        counts["seq_kept"], counts["seq_clipped"], counts["seq_masked"]]


def test_the_reference_sees_each_mechanism():
    # The randomised test above is only as good as the cases it meets: at one of its scales each mechanism
    # acts on some tokens but not all.
    def acts(name, kind, opsm_delta=0.0):
        for scale in SCALES:
            train, rollout, _, lengths, current, advantages = _random_batch(sorted(PRESETS).index(name), scale)
            correction = replace(PRESETS[name], opsm_delta=opsm_delta)
            _, _, counts = reference(correction, train.tolist(), rollout.tolist(), lengths, current.tolist(),
                                     advantages.tolist())
            if 0 < counts[kind] and counts["kept"] > 0:
                return True
        return False

    for name, kind in (("token_tis", "clipped"), ("seq_tis", "seq_clipped"), ("token_mis", "masked"),
                       ("seq_mis", "seq_masked"), ("icepop", "masked"), ("geo_rs", "seq_masked"),
                       ("geo_rs_token_tis", "seq_masked")):  # its clipping: by hand, below
        assert acts(name, kind), (name, kind)
    assert acts("none", "opsm", opsm_delta=0.05)


def test_presets_are_the_documented_ones():
    assert ROLLOUT_CORRECTIONS.names() == sorted(PRESETS)
    for name, preset in PRESETS.items():
        assert ROLLOUT_CORRECTIONS.get(name) == preset, name
    assert not ROLLOUT_CORRECTIONS.get("none").is_active
    assert RolloutCorrection(opsm_delta=0.1).is_active and ROLLOUT_CORRECTIONS.get("geo_rs").is_active
    # Bounds given override the preset's; those left None keep it.
    assert ROLLOUT_CORRECTIONS.get("seq_mis").with_bounds(upper=3.0) == RolloutCorrection(
        weights="sequence", rejection="sequence", lower=0.5, upper=3.0)
    assert ROLLOUT_CORRECTIONS.get("token_tis").with_bounds(cap=5.0, opsm_delta=1e-4) == RolloutCorrection(
        weights="token", cap=5.0, opsm_delta=1e-4)
    with pytest.raises(ValueError, match="unknown rollout correction 'mis'; registered: geo_rs, geo_rs_token_tis"):
        ROLLOUT_CORRECTIONS.get("mis")


TRAIN = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.7, -0.1, 0.0, 0.0]])
DIFFS = torch.tensor([[0.1, -0.2, 1.5, 0.0], [0.05, -0.8, 0.0, 0.0]])  # train - rollout
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
ROLLOUT = TRAIN - DIFFS


def _hand(name: str, **bounds):
    return correct_rollout(ROLLOUT_CORRECTIONS.get(name).with_bounds(**bounds), TRAIN, ROLLOUT, MASK)


def test_token_and_sequence_tis_by_hand():
    # Token ratios e^0.1 = 1.1052, e^-0.2 = 0.8187, e^1.5 = 4.4817 -> 2 (clipped); e^0.05 = 1.0513, e^-0.8 = 0.4493.
    out = _hand("token_tis")
    expected = torch.tensor([[1.1052, 0.8187, 2.0, 0.0], [1.0513, 0.4493, 0.0, 0.0]])
    torch.testing.assert_close(out.weights_BR, expected, atol=1e-4, rtol=0)
    assert float(out.token_counts["token_clipped_fraction"]) == 1 and float(out.token_counts["weight_mean"]) == (
        pytest.approx(1.1052 + 0.8187 + 2 + 1.0513 + 0.4493, abs=1e-3))
    # Sequence ratios e^(0.1 - 0.2 + 1.5) = e^1.4 = 4.055 -> 2 on all 3 tokens; e^(0.05 - 0.8) = e^-0.75 = 0.4724.
    out = _hand("seq_tis")
    expected = torch.tensor([[2.0, 2.0, 2.0, 0.0], [0.4724, 0.4724, 0.0, 0.0]])
    torch.testing.assert_close(out.weights_BR, expected, atol=1e-4, rtol=0)
    assert float(out.token_counts["token_clipped_fraction"]) == 3 and float(out.sequence_counts[
        "seq_clipped_fraction"]) == 1


def test_masked_presets_by_hand():
    # token_mis [0.5, 2]: 4.4817 and 0.4493 leave the band; the rest keep their ratio.
    out = _hand("token_mis")
    torch.testing.assert_close(out.weights_BR, torch.tensor([[1.1052, 0.8187, 0.0, 0.0], [1.0513, 0.0, 0.0, 0.0]]),
                               atol=1e-4, rtol=0)
    assert out.keep_BR.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert [float(out.sequence_counts[f"seq_{k}_fraction"]) for k in ("kept", "masked")] == [0, 2]
    # icepop [0.5, 5]: 4.4817 is kept at its full ratio (no cap), 0.4493 still leaves.
    out = _hand("icepop")
    torch.testing.assert_close(out.weights_BR, torch.tensor([[1.1052, 0.8187, 4.4817, 0.0], [1.0513, 0.0, 0.0, 0.0]]),
                               atol=1e-4, rtol=0)
    # seq_mis [0.5, 2]: 4.055 rejects sequence 0 whole; 0.4724 rejects sequence 1; upper 5 and lower 0.4 keep both.
    assert _hand("seq_mis").keep_BR.sum() == 0
    out = _hand("seq_mis", lower=0.4, upper=5.0)
    torch.testing.assert_close(out.weights_BR, torch.tensor([[4.0552, 4.0552, 4.0552, 0.0], [0.4724, 0.4724, 0, 0]]),
                               atol=1e-4, rtol=0)


def test_geometric_rejection_by_hand():
    # Geometric ratios e^(1.4 / 3) = 1.595 and e^(-0.75 / 2) = 0.687: both outside [0.999, 1.001]; a band of
    # [0.6, 1.7] keeps both, [0.6, 1.5] only sequence 1. No weights: kept tokens weigh 1.
    assert _hand("geo_rs").keep_BR.sum() == 0
    assert _hand("geo_rs", lower=0.6, upper=1.7).weights_BR.tolist() == MASK.tolist()
    out = _hand("geo_rs", lower=0.6, upper=1.5)
    assert out.weights_BR.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    # With token_tis weights on the kept sequence: e^0.05 = 1.0513, e^-0.8 = 0.4493; with both kept, sequence
    # 0's e^1.5 = 4.4817 is clipped to 2.
    out = _hand("geo_rs_token_tis", lower=0.6, upper=1.5)
    torch.testing.assert_close(out.weights_BR, torch.tensor([[0.0, 0, 0, 0], [1.0513, 0.4493, 0, 0]]), atol=1e-4,
                               rtol=0)
    out = _hand("geo_rs_token_tis", lower=0.6, upper=1.7)
    torch.testing.assert_close(out.weights_BR, torch.tensor([[1.1052, 0.8187, 2.0, 0], [1.0513, 0.4493, 0, 0]]),
                               atol=1e-4, rtol=0)
    assert float(out.token_counts["token_clipped_fraction"]) == 1
    # Tiny drift: mean log ratio 0.0004 -> e^0.0004 = 1.0004, inside the default band.
    tiny = correct_rollout(ROLLOUT_CORRECTIONS.get("geo_rs"), TRAIN, TRAIN - 0.0004 * MASK, MASK)
    assert tiny.keep_BR.tolist() == MASK.tolist()


def test_off_policy_sequence_masking_by_hand():
    # Current policy 0.3 below the engine on sequence 0 (mean drift 0.3 > 0.2), 0.1 on sequence 1 (kept);
    # sequence 0's advantages are [-1, 2, -0.5]: its first and third tokens are dropped, the second kept.
    current = ROLLOUT - 0.3 * torch.tensor([[1.0], [1 / 3]]) * MASK
    advantages = torch.tensor([[-1.0, 2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    out = correct_rollout(RolloutCorrection(opsm_delta=0.2), TRAIN, ROLLOUT, MASK, current, advantages)
    assert out.keep_BR.tolist() == [[0, 1, 0, 0], [1, 1, 0, 0]]
    assert float(out.token_counts["opsm_token_masked_fraction"]) == 2


def test_weights_carry_no_gradient_and_padding_stays_finite():
    train = TRAIN.clone().requires_grad_()
    rollout = ROLLOUT.clone()
    rollout[MASK == 0] = float("-inf")  # log-prob -inf at padding: an infinite ratio there
    for name in PRESETS:
        out = correct_rollout(ROLLOUT_CORRECTIONS.get(name), train, rollout, MASK, train, torch.ones(2, 4))
        assert not out.weights_BR.requires_grad and not out.keep_BR.requires_grad
        assert torch.isfinite(out.weights_BR).all() and (out.weights_BR[MASK == 0] == 0).all()
    # A token 40 nats off: rejection compares the true ratio, e^(40 + 1.4) = 9.6e17 > 1e12 (the weights'
    # safety clamp at e^20 = 4.9e8 would have kept it), and an untruncated weight stops at e^-20 or e^20.
    far = TRAIN - torch.tensor([[40.0, 0, 0, 0], [0, 0, 0, 0]]) * MASK
    out = correct_rollout(RolloutCorrection(weights="sequence", rejection="sequence", upper=1e12), TRAIN, far, MASK)
    assert out.keep_BR.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    out = correct_rollout(RolloutCorrection(weights="token"), far, TRAIN, MASK)
    assert float(out.weights_BR[0, 0]) == pytest.approx(math.exp(-20.0), rel=1e-4)
