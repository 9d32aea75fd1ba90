"""Decoupled PPO's off-policy corrections, each against its formula worked out in plain Python, token by token.

The references below never call the code under test: they read the log-ratios as Python floats, loop over each
sequence's response tokens, and apply the rule as the correction's source states it (TIS / AReaL, sequence IS,
SkyRL's geometric-mean mask, IcePop's band). Padding holds extreme log-ratios that must never count.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_rl.algorithms import ROLLOUT_CORRECTIONS, decoupled_ppo_loss, make_correction
from hybrid_rl.config import ConfigError
from hybrid_rl.config.algorithm import RolloutCorrectionConfig

from helpers import make_cfg


def _reference(method: str, log_ratio: list[list[float]], mask: list[list[int]], cfg: RolloutCorrectionConfig
               ) -> list[list[tuple[float, bool, bool]]]:
    """Per response token (weight, truncated, masked), by the method's formula; padding gets None."""
    out = []
    for lrs, ms in zip(log_ratio, mask):
        tokens = [lr for lr, m in zip(lrs, ms) if m]
        rho = [math.exp(lr) for lr in tokens]
        if method == "token_truncate":  # w_t = min(ρ_t, cap)
            per = [(min(r, cfg.cap), r > cfg.cap, False) for r in rho]
        elif method == "sequence_truncate":  # w = min(∏ ρ_t, cap) on every token
            prod = math.prod(rho)
            per = [(min(prod, cfg.cap), prod > cfg.cap, False)] * len(rho)
        elif method == "sequence_mask":  # w = ∏ ρ_t, or 0 for the whole sequence above cap
            prod = math.prod(rho)
            per = [(0.0 if prod > cfg.cap else prod, False, prod > cfg.cap)] * len(rho)
        elif method == "geo_mask":  # g = (∏ ρ_t)^(1/n); w = 1 inside [1 - δ, 1 + δ], else 0
            g = math.prod(rho) ** (1 / len(rho)) if rho else 1.0
            out_of_band = not 1 - cfg.geo_delta <= g <= 1 + cfg.geo_delta
            per = [(0.0 if out_of_band else 1.0, False, out_of_band)] * len(rho)
        elif method == "token_mask":  # w_t = ρ_t inside [low, high], else 0
            per = [(r if cfg.band_low <= r <= cfg.band_high else 0.0, False,
                    not cfg.band_low <= r <= cfg.band_high) for r in rho]
        else:
            raise AssertionError(method)
        it = iter(per)
        out.append([next(it) if m else None for m in ms])
    return out


MASKING = ("sequence_mask", "geo_mask", "token_mask")

# 6 sequences of up to 5 response tokens; padding (mask 0) holds log-ratios that would flip every rule
MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def _log_ratio(scale: float, seed: int) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    lr = (torch.randn(6, 5, generator=g, dtype=torch.float64) * scale).tolist()
    return [[v if m else 9.0 for v, m in zip(row, ms)] for row, ms in zip(lr, MASK)]


# scales that put each rule's decisions on both sides: token ratios spread around the caps and bands, sequence
# geometric means around 1 ± δ
CASES = [("token_truncate", {}, 0.6), ("token_truncate", {"cap": 1.3}, 0.4),
         ("sequence_truncate", {}, 0.6), ("sequence_truncate", {"cap": 1.5}, 0.3),
         ("sequence_mask", {}, 0.6), ("sequence_mask", {"cap": 1.5}, 0.3),
         ("geo_mask", {}, 0.015), ("geo_mask", {"geo_delta": 0.05}, 0.08),
         ("token_mask", {}, 1.2), ("token_mask", {"band_low": 0.0, "band_high": 1.5}, 0.5)]


@pytest.mark.parametrize("method,knobs,scale", CASES)
def test_correction_matches_its_formula_token_by_token(method, knobs, scale):
    cfg = RolloutCorrectionConfig(method=method, **knobs)
    cfg.validate()
    for seed in range(3):
        log_ratio = _log_ratio(scale, seed)
        ref = _reference(method, log_ratio, MASK, cfg)
        c = make_correction(cfg)(torch.tensor(log_ratio, dtype=torch.float64), torch.tensor(MASK))
        for i, row in enumerate(ref):
            for j, expected in enumerate(row):
                if expected is None:
                    continue
                w, truncated, masked = expected
                assert c.weights[i, j].item() == pytest.approx(w, rel=1e-12, abs=1e-12), (method, seed, i, j)
                # a truncating rule reports no masks and a masking one no truncations
                assert (False if c.truncated is None else bool(c.truncated[i, j])) == truncated, (method, seed, i, j)
                assert (False if c.masked is None else bool(c.masked[i, j])) == masked, (method, seed, i, j)
        assert (c.truncated is None) == (method in MASKING) and (c.masked is None) == (method not in MASKING)


@pytest.mark.parametrize("method,knobs,scale", CASES)
def test_loss_and_fractions_follow_the_reference_weights(method, knobs, scale):
    """With log_prob = proximal the clipped term is -A per token, so the token-mean loss is -Σ A w / N, N the real
    tokens (a masked token stays in N); the logged fractions are the reference's counts over N."""
    cfg = RolloutCorrectionConfig(method=method, **knobs)
    seen = {"truncated": 0, "masked": 0}
    for seed in range(3):
        log_ratio = _log_ratio(scale, seed)
        ref = _reference(method, log_ratio, MASK, cfg)
        g = torch.Generator().manual_seed(100 + seed)
        adv = torch.randn(6, 5, generator=g, dtype=torch.float64)
        prox = -torch.rand(6, 5, generator=g, dtype=torch.float64) - 0.1
        behav = prox - torch.tensor(log_ratio, dtype=torch.float64)
        loss, m = decoupled_ppo_loss(prox.clone(), prox, behav, adv, torch.tensor(MASK),
                                     correction=make_correction(cfg))
        real = [(i, j) for i, row in enumerate(MASK) for j, v in enumerate(row) if v]
        expected = -sum(adv[i, j].item() * ref[i][j][0] for i, j in real) / len(real)
        assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
        n_trunc = sum(ref[i][j][1] for i, j in real)
        n_mask = sum(ref[i][j][2] for i, j in real)
        # each rule logs the share it changes: truncations or masks
        key, other, count = (("is_masked_frac", "is_truncated_frac", n_mask) if method in MASKING
                             else ("is_truncated_frac", "is_masked_frac", n_trunc))
        assert m[key].item() == pytest.approx(count / len(real)) and other not in m
        seen["truncated"] += n_trunc
        seen["masked"] += n_mask
    # the cases are chosen so that every rule acts on some tokens and spares others
    kind = "masked" if method in MASKING else "truncated"
    assert 0 < seen[kind] < 3 * sum(map(sum, MASK))


def test_geo_mask_ignores_length_where_the_product_does_not():
    """A long sequence of tokens each slightly off: its product ratio leaves any fixed cap, its geometric mean stays
    in the band; a short sequence with one far-off token is the other way round."""
    long_row = [0.004] * 200  # 200 tokens, each ρ_t = e^0.004: ∏ = e^0.8 ≈ 2.23 > 2, geometric mean ≈ 1.004
    short_row = [0.3] + [0.0] * 199  # 10 tokens (below), one ρ = e^0.3: ∏ ≈ 1.35 < 2, geometric mean e^0.03 ≈ 1.03
    mask = torch.tensor([[1] * 200, [1] * 10 + [0] * 190])
    log_ratio = torch.tensor([long_row, short_row], dtype=torch.float64)
    geo = make_correction(RolloutCorrectionConfig(method="geo_mask"))(log_ratio, mask)
    prod = make_correction(RolloutCorrectionConfig(method="sequence_mask"))(log_ratio, mask)
    assert geo.masked[:, 0].tolist() == [False, True]
    assert prod.masked[:, 0].tolist() == [True, False]


def test_every_correction_is_registered_once_with_its_knobs():
    assert list(ROLLOUT_CORRECTIONS) == ["token_truncate", "sequence_truncate", "sequence_mask", "geo_mask",
                                         "token_mask"]
    rc = RolloutCorrectionConfig(cap=3.0, geo_delta=0.02, band_low=0.25, band_high=4.0)
    assert {name: ROLLOUT_CORRECTIONS.info(name).config(rc) for name in ROLLOUT_CORRECTIONS} == {
        "token_truncate": {"cap": 3.0}, "sequence_truncate": {"cap": 3.0}, "sequence_mask": {"cap": 3.0},
        "geo_mask": {"delta": 0.02}, "token_mask": {"low": 0.25, "high": 4.0}}


@pytest.mark.parametrize("override,message", [
    ("algorithm.rollout_correction.method=geo", r"algorithm.rollout_correction.method='geo' is not one of"),
    ("algorithm.rollout_correction.geo_delta=0", r"algorithm.rollout_correction.geo_delta=0.0 must be in \(0, 1\)"),
    ("algorithm.rollout_correction.band_low=1.0", r"algorithm.rollout_correction.band_low=1.0, .*the band must hold 1"),
    ("algorithm.rollout_correction.band_high=0.8", r"band_high=0.8: the band must hold 1"),
    ("algorithm.rollout_correction.cap=1", r"algorithm.rollout_correction.cap=1.0 must be > 1"),
    ("algorithm.rollout_correction.level=sequence", r"replaced by algorithm.rollout_correction.method"),
])
def test_bad_settings_name_the_key_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(override)


def test_a_registered_correction_is_a_method_the_config_takes():
    from hybrid_rl.algorithms import Correction, register_correction

    @register_correction("halve", config=lambda rc: {})
    def halve(log_ratio, response_mask):
        none = torch.zeros_like(log_ratio, dtype=torch.bool)
        return Correction(torch.full_like(log_ratio, 0.5), torch.exp(log_ratio), none, none)

    try:
        cfg = make_cfg("algorithm.rollout_correction.apply=always", "algorithm.rollout_correction.method=halve")
        prox = torch.tensor([[-1.0, -2.0]])
        adv = torch.tensor([[1.0, -3.0]])
        loss, _ = decoupled_ppo_loss(prox.clone(), prox, prox - 0.3, adv, torch.ones(1, 2),
                                     correction=make_correction(cfg.algorithm.rollout_correction))
        assert loss.item() == pytest.approx(-(1.0 * 0.5 - 3.0 * 0.5) / 2)
    finally:
        ROLLOUT_CORRECTIONS.unregister("halve")
    with pytest.raises(ConfigError, match="method='halve' is not one of"):
        make_cfg("algorithm.rollout_correction.method=halve")
