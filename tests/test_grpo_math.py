"""GRPO's advantages, KL and losses against values computed by hand (derivations inline)."""

import math

import pytest
import torch

from grpo import Args, group_advantages, grpo_loss, kl_k3


def test_group_advantages_by_hand():
    # Group 1: R = [1, 0, 0, 1]; mean 0.5; deviations ±0.5;
    #   unbiased std = sqrt(4 · 0.25 / 3) = sqrt(1/3) = 0.577350  ->  Â = ±0.5 / 0.577350 = ±0.866025
    # Group 2: R = [0.1, 0.1, 0.1, 0.1]; all equal -> Â = 0 / (0 + eps) = 0, not NaN
    # Group 3: R = [1, 0.1, 0, 0]; mean 0.275; deviations 0.725, -0.175, -0.275, -0.275;
    #   Σ dev² = 0.525625 + 0.030625 + 0.075625 + 0.075625 = 0.7075; std = sqrt(0.7075 / 3) = 0.485627
    #   Â = 0.725 / 0.485627 = 1.492916, -0.360359, -0.566279, -0.566279
    rewards = torch.tensor([1, 0, 0, 1, 0.1, 0.1, 0.1, 0.1, 1, 0.1, 0, 0])
    expected = [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0, 1.492916, -0.360359, -0.566279, -0.566279]
    advantages = group_advantages(rewards, group_size=4, eps=1e-6)
    assert advantages.tolist() == pytest.approx(expected, abs=1e-5)  # eps = 1e-6 in std shifts Â by < 4e-6
    assert torch.isfinite(advantages).all()


def test_group_advantages_dr_grpo_has_no_std():
    # Dr. GRPO: Â = R − mean only. Group 1 as above: ±0.5. Group 2: 0.
    rewards = torch.tensor([1.0, 0, 0, 1, 0.1, 0.1, 0.1, 0.1])
    advantages = group_advantages(rewards, group_size=4, scale_by_std=False)
    assert advantages.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], abs=1e-7)


def test_kl_k3_by_hand():
    # k3 = π_ref/π − log(π_ref/π) − 1
    #   π = 0.5,  π_ref = 0.25: 0.5 − ln 0.5 − 1 = 0.193147
    #   π = 0.25, π_ref = 0.5:  2 − ln 2 − 1   = 0.306853
    #   π = π_ref:              1 − 0 − 1      = 0
    logp = torch.log(torch.tensor([0.5, 0.25, 0.3]))
    ref_logp = torch.log(torch.tensor([0.25, 0.5, 0.3]))
    assert kl_k3(logp, ref_logp).tolist() == pytest.approx([0.193147, 0.306853, 0.0], abs=1e-6)


# A batch of N = 2 completions of unequal length (T = 3; the second has 2 valid tokens),
# old_logp = 0, so r = exp(logp). Sequence 1 has Â = +1, sequence 2 has Â = −0.5.
#   sequence 1 ratios [1.0, 1.5, 0.5]; sequence 2 ratios [1.0, 0.7, (masked: 9.9)]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.0, 0.7, 9.9]])
ADVANTAGES = torch.tensor([1.0, -0.5])


def loss_and_grad(ratios, loss_type="grpo", eps=0.2, beta=0.0, ref_logp=None, dual_clip=0.0, max_new_tokens=3, **kw):
    logp = torch.log(ratios).clone().requires_grad_(True)
    eps_low, eps_high = kw.get("eps_low", eps), kw.get("eps_high", eps)
    args = Args(
        loss_type=loss_type, eps=eps, gspo_eps_low=eps_low, gspo_eps_high=eps_high, beta=beta, dual_clip=dual_clip,
        max_new_tokens=max_new_tokens,
    )  # fmt: skip
    mask = kw.get("mask", MASK)
    loss, stats = grpo_loss(
        logp, torch.zeros_like(logp), ref_logp, kw.get("advantages", ADVANTAGES), mask, args,
        num_sequences=ratios.shape[0], num_tokens=int(mask.sum()),
    )  # fmt: skip
    loss.backward()
    return loss.item(), logp.grad, stats


def test_grpo_loss_sample_level_by_hand():
    # Per-token objective min(r·Â, clip(r, 0.8, 1.2)·Â):
    #   seq 1 (Â=+1):   r=1 -> 1;  r=1.5 -> min(1.5, 1.2) = 1.2 (clipped);  r=0.5 -> min(0.5, 0.8) = 0.5
    #                   mean over 3 tokens = 2.7 / 3 = 0.9
    #   seq 2 (Â=−0.5): r=1 -> −0.5;  r=0.7 -> min(−0.35, −0.4) = −0.4 (clipped);  masked token ignored
    #                   mean over 2 tokens = −0.9 / 2 = −0.45
    #   J = (0.9 − 0.45) / 2 = 0.225, loss = −J = −0.225
    # Gradient d loss / d logp_t = −(1/N)(1/|o_i|) Â_i r_t on unclipped tokens, 0 on clipped ones
    # (d r / d logp = r):
    #   seq 1: −(1/2)(1/3)(1)(1) = −1/6,  0,  −(1/2)(1/3)(1)(0.5) = −1/12
    #   seq 2: −(1/2)(1/2)(−0.5)(1) = +1/8,  0,  0 (masked)
    loss, grad, stats = loss_and_grad(RATIOS)
    assert loss == pytest.approx(-0.225, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-1 / 6, 0, -1 / 12], [1 / 8, 0, 0]]), atol=1e-6)
    # clipped tokens: seq 1 t=1 (Â>0, r>1.2: high side), seq 2 t=1 (Â<0, r<0.8: low side)
    assert (stats["clip_high"], stats["clip_low"], stats["tokens"]) == (1, 1, 5)


def test_grpo_loss_kl_term_by_hand():
    # Â = 0 and r = 1 leave only the KL term: loss = β · (1/N) Σ_i mean_t k3_it.
    #   seq 1: π/π_ref per token gives k3 = [0, 0.193147, 0.306853] -> mean 0.5 / 3 = 0.166667
    #   seq 2: k3 = [0.193147, 0, (masked)] -> mean 0.193147 / 2 = 0.096574
    #   loss = 0.1 · (0.166667 + 0.096574) / 2 = 0.013162
    # d k3 / d logp = 1 − π_ref/π: seq 1 t=1 (π_ref/π = 0.5): 0.5;  t=2 (π_ref/π = 2): −1.
    #   times β/(N·|o_i|) = 0.1/6:  0.5 · 0.1/6 = 0.008333,  −0.1/6 = −0.016667
    #   seq 2 t=0: 0.5 · 0.1/(2·2) = 0.0125
    ratios = torch.ones(2, 3)
    ref_logp = torch.log(torch.tensor([[1.0, 0.5, 2.0], [0.5, 1.0, 1.0]]))  # log π_ref with log π = 0
    loss, grad, stats = loss_and_grad(ratios, beta=0.1, ref_logp=ref_logp, advantages=torch.zeros(2))
    assert loss == pytest.approx(0.013162, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[0, 0.1 / 12, -0.1 / 6], [0.0125, 0, 0]]), atol=1e-6)
    assert stats["kl"] == pytest.approx(0.5 + 0.193147, abs=1e-5)  # summed over the 5 valid tokens


def test_dr_grpo_loss_by_hand():
    # Same per-token objectives; Σ over valid tokens = 2.7 − 0.9 = 1.8; normaliser N · L_max = 2 · 3 = 6
    #   J = 1.8 / 6 = 0.3, loss = −0.3
    # Gradient −Â_i r_t / 6 on unclipped tokens: seq 1: −1/6, 0, −0.5/6 = −1/12; seq 2: +0.5/6 = 1/12, 0, 0
    # (sample-level GRPO gave seq 2 t=0 a larger weight, 1/8: a shorter completion's tokens count more)
    loss, grad, _ = loss_and_grad(RATIOS, loss_type="dr_grpo", max_new_tokens=3)
    assert loss == pytest.approx(-0.3, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-1 / 6, 0, -1 / 12], [1 / 12, 0, 0]]), atol=1e-6)


def test_gspo_loss_by_hand():
    # Sequence ratio s_i = exp(mean_t log r_it), clip(s, 1 − 3e-4, 1 + 4e-4):
    #   seq 1 (Â=+1): log r = [0.001, 0.002, 0.003] -> s = e^0.002 = 1.002002 > 1.0004: clipped, J_1 = 1.0004
    #   seq 2 (Â=−0.5): log r = [−0.0001, 0.0001, (masked 5.0)] -> s = e^0 = 1, J_2 = −0.5
    #   J = (1.0004 − 0.5) / 2 = 0.2502, loss = −0.2502
    # Gradient: seq 1 clipped -> 0. seq 2: d(−s Â / N) / d logp_t = −(Â/N) · s · (1/|o|) = 0.25 · 0.5 = 0.125
    # for each of its 2 valid tokens, 0 for the masked one.
    ratios = torch.exp(torch.tensor([[0.001, 0.002, 0.003], [-0.0001, 0.0001, 5.0]]))
    loss, grad, stats = loss_and_grad(ratios, loss_type="gspo", eps_low=3e-4, eps_high=4e-4)
    assert loss == pytest.approx(-0.2502, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[0, 0, 0], [0.125, 0.125, 0]]), atol=1e-6)
    assert stats["clip_high"] == 3  # all 3 tokens of sequence 1 share its clipped ratio


def test_dual_clip_by_hand():
    # One sequence, Â = −1, ratios [5, 2], ε = 0.2, c = 3.
    #   plain:     min(−5, −1.2) = −5;  min(−2, −1.2) = −2;  J = −3.5, loss 3.5
    #   dual-clip: max(−5, c·Â = −3) = −3;  −2 > −3 unchanged;  J = −2.5, loss 2.5
    # Gradient with dual-clip: token 0 is bounded -> 0; token 1: −(1/2)(−1)(2) = 1
    common = dict(advantages=torch.tensor([-1.0]), mask=torch.ones(1, 2, dtype=torch.long))
    ratios = torch.tensor([[5.0, 2.0]])
    plain, _, _ = loss_and_grad(ratios, **common)
    dual, grad, stats = loss_and_grad(ratios, dual_clip=3.0, **common)
    assert plain == pytest.approx(3.5, abs=1e-5)
    assert dual == pytest.approx(2.5, abs=1e-5)
    assert torch.allclose(grad, torch.tensor([[0.0, 1.0]]), atol=1e-5)
    assert stats["clip_dual"] == 1


def test_loss_is_zero_at_ratio_one_with_zero_advantages():
    # Every group all-equal: Â = 0, and β = 0 -> nothing to learn, loss and gradient exactly 0.
    loss, grad, _ = loss_and_grad(torch.ones(2, 3), advantages=torch.zeros(2))
    assert loss == 0.0 and not grad.abs().any()
    assert math.isfinite(loss)
