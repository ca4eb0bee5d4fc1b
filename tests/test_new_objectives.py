"""The objectives adopted since the seed papers (grpo.py and dapo.py, identical text): SAPO's soft
gate (--loss_type sapo) and DeepSeek-V3.2's unbiased KL (--unbiased_kl), against values computed
by hand here, their gradients where the gate or the detach decides them, under gradient
accumulation, and refused where they cannot work."""

import dataclasses
import json
import math
import threading

import pytest
import torch

import common
import dapo
import grpo


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def loss_of(script, logp, old_logp, advantages, ref_logp=None, policy_mask=None, sample_logp=None, **settings):
    """The script's loss and d loss / d logp for one micro-batch that is the whole mini-batch."""
    logp = logp.clone().requires_grad_(True)
    mask = torch.ones_like(logp, dtype=torch.long)
    if script is grpo:
        args = grpo.Args(**({"max_new_tokens": logp.shape[1]} | settings))
        loss, stats = grpo.grpo_loss(
            logp,
            old_logp,
            ref_logp,
            advantages,
            mask,
            args,
            num_sequences=len(logp),
            num_tokens=int(mask.sum()),
            policy_mask=policy_mask,
            sample_logp=sample_logp,
        )
    else:
        args = dapo.Args(**settings)
        loss, stats = dapo.dapo_loss(
            logp,
            old_logp,
            ref_logp,
            advantages,
            mask,
            args,
            num_tokens=int(mask.sum()),
            policy_mask=policy_mask,
            sample_logp=sample_logp,
        )
    loss.backward()
    return loss.item(), logp.grad, stats


# ----------------------------------------------------------------------------------------
# SAPO: f(r)·Â with f(r) = σ(τ(r − 1))·4/τ, τ = 1 for Â > 0 and 1.05 for Â < 0


def test_sapo_gate_by_hand():
    # r = e^0.5, Â = +1, τ = 1:     x = r − 1 = 0.64872, σ(x) = 0.65672, f = 4σ = 2.626889
    #   d(f·Â)/d log π = 4σ(1 − σ)·r·Â = 4 · 0.65672 · 0.34328 · 1.64872 = 1.486739   (dr/d log π = r)
    # r = e^−0.5, Â = −1, τ = 1.05: x = 1.05 · (0.60653 − 1) = −0.41314, σ = 0.39816,
    #   f = σ · 4/1.05 = 1.516795, f·Â = −1.516795; d/d log π = 4σ(1 − σ)·r·Â = −0.581368
    logp = torch.tensor([[0.5], [-0.5]], requires_grad=True)
    mask = torch.ones(2, 1)
    objective = grpo.sapo_objective(logp, torch.zeros(2, 1), mask, torch.tensor([[1.0], [-1.0]]), 1.0, 1.05)
    objective.sum().backward()
    assert objective.flatten().tolist() == pytest.approx([2.626889, -1.516795], abs=1e-6)
    assert logp.grad.flatten().tolist() == pytest.approx([1.486739, -0.581368], abs=1e-6)
    assert abs(sigmoid(1.05 * (math.exp(-0.5) - 1)) * 4 / 1.05 - 1.516795) < 1e-6  # the derivation's own check


@pytest.mark.parametrize("script", [grpo, dapo])
def test_sapo_weight_is_one_at_ratio_one(script):
    # On-policy (r = 1) ∂f/∂r = 4σ(0)(1 − σ(0)) = 1 whatever τ: the gradient is the plain policy
    # gradient −Â/2 per token here (two completions of one token: 1/N = 1/Σ|o_i| = 1/2), for either sign.
    logp = torch.tensor([[-1.0], [-2.0]])
    _, grad, _ = loss_of(script, logp, logp.clone(), torch.tensor([1.0, -1.0]), loss_type="sapo", beta=0.0)
    assert grad.flatten().tolist() == pytest.approx([-0.5, 0.5], abs=1e-7)


@pytest.mark.parametrize("script", [grpo, dapo])
def test_sapo_loss_by_hand(script):
    # The two tokens above as two completions of one token each: J = (2.626889 − 1.516795)/2 =
    # 0.555047, loss −0.555047; d loss/d log π = −(1/2)·[1.486739, −0.581368] = [−0.743370, 0.290684]
    # (GRPO's 1/(N·|o_i|) and DAPO's 1/Σ|o_i| are both 1/2 here). No hard clip: both tokens keep a
    # gradient, where the clipped surrogate (ε = 0.2) gives the r = e^0.5 > 1.2 token none.
    logp = torch.tensor([[0.5], [-0.5]])
    loss, grad, _ = loss_of(script, logp, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), loss_type="sapo", beta=0.0)
    assert loss == pytest.approx(-0.555047, abs=1e-6)
    assert grad.flatten().tolist() == pytest.approx([-0.743370, 0.290684], abs=1e-6)
    clipped = "grpo" if script is grpo else "dapo"
    _, grad, _ = loss_of(script, logp, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), loss_type=clipped, beta=0.0)
    assert grad[0, 0] == 0


@pytest.mark.parametrize("script", [grpo, dapo])
def test_sapo_ratio_that_would_overflow_gets_no_gradient(script):
    # log r = 200: exp overflows to inf, and inf·0 would be NaN; clamped at 20, σ saturates and the
    # gradient is exactly 0, finite.
    logp = torch.tensor([[200.0], [-1.0]])
    loss, grad, _ = loss_of(script, logp, torch.tensor([[0.0], [-1.0]]), torch.tensor([1.0, -1.0]), loss_type="sapo")
    assert math.isfinite(loss) and torch.isfinite(grad).all() and grad[0, 0] == 0


@pytest.mark.parametrize("script", [grpo, dapo])
def test_sapo_gradient_accumulation_equals_one_big_batch(sampled, script):
    # Off-policy (μ = 2 reads the recorded log-probs, shifted so that r ≠ 1): micro-batches of 3, 5
    # and 12 rows give the gradient of the one batch of 12.
    model, tokenizer, batch = sampled
    batch = {**batch, "old_logp": batch["old_logp"] - 0.3 * batch["completion_mask"]}
    settings = {"loss_type": "sapo", "num_iterations": 2, "beta": 0.04}
    settings |= {"max_new_tokens": 12} if script is grpo else {"overlong_buffer": 0}
    gradients = []
    for micro_batch_size in (12, 3, 5):
        model.zero_grad(set_to_none=True)
        script.policy_backward(model, batch, script.Args(micro_batch_size=micro_batch_size, **settings), len(tokenizer))
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert gradients[0].abs().max() > 0
    for gradient in gradients[1:]:
        assert (gradient - gradients[0]).abs().max() <= 1e-5 * gradients[0].abs().max()


# ----------------------------------------------------------------------------------------
# DeepSeek-V3.2's unbiased KL: r·k3 with r = π_θ/π_θold not detached


@pytest.mark.parametrize("script", [grpo, dapo])
def test_unbiased_kl_by_hand(script):
    # One token, log π_θ = 0.5, log π_θold = 0, log π_ref = 0, Â = 0, β = 0.1:
    #   k3 = π_ref/π − log(π_ref/π) − 1 = e^−0.5 + 0.5 − 1 = 0.106531;  r = e^0.5 = 1.648721
    #   plain:    loss = β·k3 = 0.0106531,   d/d log π = β·(1 − π_ref/π) = 0.1 · 0.393469 = 0.0393469
    #   unbiased: loss = β·r·k3 = 0.0175639, d/d log π = β·r·(k3 + 1 − π_ref/π) = 0.1 · 0.824361
    logp, old, ref = torch.tensor([[0.5]]), torch.zeros(1, 1), torch.zeros(1, 1)
    plain = loss_of(script, logp, old, torch.zeros(1), ref_logp=ref, beta=0.1)
    unbiased = loss_of(script, logp, old, torch.zeros(1), ref_logp=ref, beta=0.1, unbiased_kl=True)
    assert (plain[0], plain[1].item()) == (pytest.approx(0.0106531, abs=1e-7), pytest.approx(0.0393469, abs=1e-7))
    assert (unbiased[0], unbiased[1].item()) == (pytest.approx(0.0175639, abs=1e-7), pytest.approx(0.0824361, abs=1e-7))
    assert unbiased[2]["kl"] == pytest.approx(0.175639, abs=1e-6)  # the statistic is the estimate the loss used


@pytest.mark.parametrize("script", [grpo, dapo])
def test_unbiased_kl_on_policy_keeps_the_ratios_gradient(script):
    # On-policy the update sets old = sg(log π): r = 1, so the value is k3's (0.106531 at log π = 0.5
    # against log π_ref = 0), but the gradient still flows through r: β·(k3 + 1 − π_ref/π) =
    # 0.1 · (0.106531 + 0.393469) = 0.05, against plain k3's 0.0393469.
    logp = torch.tensor([[0.5]])
    loss, grad, _ = loss_of(
        script, logp, logp.clone(), torch.zeros(1), ref_logp=torch.zeros(1, 1), beta=0.1, unbiased_kl=True
    )
    assert loss == pytest.approx(0.0106531, abs=1e-7) and grad.item() == pytest.approx(0.05, abs=1e-7)


@pytest.mark.parametrize("script", [grpo, dapo])
@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(loss_type="sapo", dual_clip=3.0), "--loss_type sapo gates the ratio softly"),
        (dict(loss_type="sapo", sapo_tau_neg=0.0), "--sapo_tau_pos and --sapo_tau_neg must be > 0"),
        (dict(unbiased_kl=True, beta=0.0), "--unbiased_kl weights the KL term, and --beta 0 has none"),
    ],
)
def test_settings_that_cannot_work_stop(script, settings, message):
    with pytest.raises(SystemExit, match=message):
        script.check_args(script.Args(**settings))


# ----------------------------------------------------------------------------------------
# DeepSeek-V3.2's off-policy sequence masking: Â < 0 and mean log(π_sampler/π_θ) > δ leave the policy term


@pytest.mark.parametrize("script", [grpo, dapo])
def test_off_policy_sequence_mask_by_hand(script):
    # δ = 0.1; divergence = mean over the row's own tokens of log π_sampler − log π_θ:
    #   row 0: Â = −1, [−1, −1] against [−1.5, −1.5]: 0.5 > δ   -> masked (0)
    #   row 1: Â = +1, the same 0.5                              -> kept: only negatives are masked
    #   row 2: Â = −1, [−1, −1] against [−1.05, −1.05]: 0.05     -> kept
    #   row 3: Â = −1, one valid token: −1 against −1.15: 0.15   -> masked (over the padded width,
    #          0.075, it would not be: the mean is the row's own)
    sample = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -9.0]])
    logp = torch.tensor([[-1.5, -1.5], [-1.5, -1.5], [-1.05, -1.05], [-1.15, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    advantages = torch.tensor([[-1.0], [1.0], [-1.0], [-1.0]])
    keep = script.off_policy_sequence_mask(sample, logp, mask, advantages, 0.1)
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0, 0.0] and not keep.requires_grad


@pytest.mark.parametrize("script", [grpo, dapo])
def test_off_policy_masking_leaves_the_kl_in(script):
    # One completion of one token, Â = −1, r = 1 (log π = log π_θold = −1.5), sampled at log π = −1
    # (divergence 0.5 > δ = 0.1): masked. β = 0.1 with log π_ref = −1:
    #   k3 = π_ref/π − log(π_ref/π) − 1 = e^0.5 − 0.5 − 1 = 0.148721; d k3/d log π = 1 − e^0.5 = −0.648721
    #   masked:   loss = β·k3 = 0.0148721, gradient β·(−0.648721) = −0.0648721 (the KL term alone)
    #   unmasked: loss = −Â·r + β·k3 = 1.0148721, gradient −Â·r + that = 0.9351279
    logp, ref, advantages = torch.tensor([[-1.5]]), torch.tensor([[-1.0]]), torch.tensor([-1.0])
    keep = script.off_policy_sequence_mask(torch.tensor([[-1.0]]), logp, torch.ones(1, 1), advantages[:, None], 0.1)
    masked = loss_of(script, logp, logp.clone(), advantages, ref_logp=ref, beta=0.1, policy_mask=keep)
    plain = loss_of(script, logp, logp.clone(), advantages, ref_logp=ref, beta=0.1)
    assert (masked[0], masked[1].item()) == (pytest.approx(0.0148721, abs=1e-7), pytest.approx(-0.0648721, abs=1e-7))
    assert (plain[0], plain[1].item()) == (pytest.approx(1.0148721, abs=1e-7), pytest.approx(0.9351279, abs=1e-7))


@pytest.mark.parametrize("script", [grpo, dapo])
def test_off_policy_masking_is_logged(script, tmp_path):
    # A run with δ = 1e-9 masks nearly every negative completion (any sampler/trainer difference
    # exceeds it): the share is logged each step, between 0 and 1.
    settings = dict(model="tiny", task="digit", max_new_tokens=4, batch_size=2, group_size=4, max_steps=2, save_every=0)
    settings |= {"overlong_buffer": 0} if script is dapo else {}
    run = script.train(script.Args(output_dir=str(tmp_path), off_policy_mask_threshold=1e-9, **settings))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= row["opsm/sequence_fraction"] <= 1 for row in rows)


# ----------------------------------------------------------------------------------------
# --scale_rewards: Â = (R − group mean) / s, s the group's std, the batch's std, the group's mean, or 1


@pytest.mark.parametrize("script", [grpo, dapo])
def test_reward_scales_by_hand(script):
    # Groups [1, 0, 0, 1] (mean 0.5) and [1, 1, 1, 0] (mean 0.75), and [0, 0, 0, 0]:
    #   batch: the 12 rewards, mean 5/12 = 0.416667, unbiased variance (5·(7/12)² + 7·(5/12)²)/11 =
    #          (1.701389 + 1.215278)/11 = 0.265152, std 0.514929:
    #          ±0.5/0.514929 = ±0.971008; 0.25/0.514929 = 0.485504, −0.75/0.514929 = −1.456512; 0
    #   mean (MaxRL): ±0.5/0.5 = ±1; 0.25/0.75 = 0.333333, −0.75/0.75 = −1; the all-0 group: 0, not NaN
    #   none (Dr. GRPO): ±0.5; 0.25, −0.75; 0
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0])
    expected = {
        "batch": [0.971008, -0.971008, -0.971008, 0.971008, 0.485504, 0.485504, 0.485504, -1.456512, 0, 0, 0, 0],
        "mean": [1, -1, -1, 1, 1 / 3, 1 / 3, 1 / 3, -1, 0, 0, 0, 0],
        "none": [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75, 0, 0, 0, 0],
    }
    for scale, values in expected.items():
        assert script.scaled_advantages(rewards, 4, scale, eps=1e-6).tolist() == pytest.approx(values, abs=1e-5)
    group = script.scaled_advantages(rewards, 4, "group", eps=1e-6)
    assert torch.equal(group, script.group_advantages(rewards, 4, eps=1e-6))  # group is GRPO's own, bit for bit


def test_the_batch_scale_counts_every_rank():
    # Two ranks of 4 rewards each, [1, 0, 0, 1] and [1, 1, 1, 0], their sums exchanged by `total`: the
    # std over all 8, 0.517549 (variance (5·0.375² + 3·0.625²)/7 = 0.267857), not each rank's own.
    halves = torch.tensor([1.0, 0, 0, 1]), torch.tensor([1.0, 1, 1, 0])
    partner = {}

    def total_with(other):
        def total(value):  # this rank's value plus the other rank's, as all_reduce would give
            key = len(partner)
            partner[key] = value
            return value + other[key % 3]

        return total

    # The other rank's count, sum, and squared deviations from the batch's mean 5/8 (two passes):
    # [1, 0, 0, 1] -> 4, 2, 2·0.375² + 2·0.625² = 1.0625
    first_sums = [4, 2.0, 1.0625]
    second = grpo.scaled_advantages(halves[1], 4, "batch", 1e-6, total=total_with(first_sums))
    assert second.tolist() == pytest.approx([0.25 / 0.517549] * 3 + [-0.75 / 0.517549], abs=1e-5)


def test_dr_grpo_keeps_its_own_scale_unless_asked():
    assert grpo.reward_scale(grpo.Args(loss_type="dr_grpo")) == "none"
    assert grpo.reward_scale(grpo.Args(loss_type="dr_grpo", scale_rewards="mean")) == "mean"
    assert grpo.reward_scale(grpo.Args()) == "group" and dapo.reward_scale(dapo.Args()) == "group"
    with pytest.raises(SystemExit, match="--scale_rewards 'std' is not one of: group, batch, mean, none"):
        grpo.check_args(grpo.Args(scale_rewards="std"))
    with pytest.raises(SystemExit, match="--loss_type gpg scales its advantage itself"):
        grpo.check_args(grpo.Args(loss_type="gpg", beta=0.0, scale_rewards="batch"))


def test_train_takes_each_variant_s_advantage_from_variant_advantages():
    # train() calls group_advantages by name for GRPO's own scale and variant_advantages otherwise;
    # rewards [1, 0, 0, 0 | 1, 1, 1, 0] in groups of 4 (means 0.25, 0.75), by hand:
    #   none (Dr. GRPO's default)  R − mean: [0.75, −0.25 ×3 | 0.25 ×3, −0.75]
    #   batch  / the batch's unbiased std √(8·0.25/7) = 0.534522: [1.403121, −0.467707 ×3 | …]
    #   mean   / the group's mean reward: [3, −1 ×3 | 1/3 ×3, −1]
    #   gpg    α = 2 groups / 2 informative = 1: R − mean
    #   group  / the group's std 0.5: [1.5, −0.5 ×3 | 0.5 ×3, −1.5] (group_advantages, as train() calls it)
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0])
    centered = [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]

    def advantages(**settings):
        return grpo.variant_advantages(rewards, grpo.Args(group_size=4, **settings)).tolist()

    assert advantages(loss_type="dr_grpo") == pytest.approx(centered, abs=1e-6)
    assert advantages(scale_rewards="batch") == pytest.approx([c / 0.534522 for c in centered], abs=1e-5)
    assert advantages(scale_rewards="mean") == pytest.approx([3, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1], abs=1e-4)  # + ε
    assert advantages(loss_type="gpg", beta=0.0) == pytest.approx(centered, abs=1e-6)
    by_name = grpo.group_advantages(rewards, 4, eps=1e-6).tolist()
    assert by_name == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -1.5], abs=1e-5)
    assert advantages(scale_rewards="group") == by_name  # the same numbers through either path


@pytest.mark.parametrize("script", [grpo, dapo])
def test_a_run_trains_with_each_scale(script, tmp_path):
    settings = dict(model="tiny", task="digit", max_new_tokens=4, batch_size=2, group_size=4, max_steps=1, save_every=0)
    settings |= {"overlong_buffer": 0} if script is dapo else {}
    for scale in ("batch", "mean"):
        run = script.train(script.Args(output_dir=str(tmp_path / scale), scale_rewards=scale, **settings))
        (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert math.isfinite(row["loss/policy"])


# ----------------------------------------------------------------------------------------
# --top_entropy_quantile ρ: only the top-ρ share of tokens by π_θold's entropy keep the policy gradient


def test_top_share_by_hand():
    # Valid values 3, 1, 2 | 5, 4 (padding 9 and 0 ignored), 5 tokens:
    #   share 0.4 -> k = ⌈2.0⌉ = 2: 5 and 4;   share 0.5 -> k = ⌈2.5⌉ = 3: 5, 4 and 3;   share 1: every valid token
    values = torch.tensor([[3.0, 1.0, 2.0, 9.0], [5.0, 4.0, 0.0, 0.0]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert common.top_share(values, valid, 0.4).int().tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    assert common.top_share(values, valid, 0.5).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0]]
    assert common.top_share(values, valid, 1.0).int().tolist() == valid.tolist()
    # [2, 2, 1] with share 0.34 -> k = ⌈1.02⌉ = 2: both 2s (and only them).
    assert common.top_share(torch.tensor([[2.0, 2.0, 1.0]]), torch.ones(1, 3), 0.34).int().tolist() == [[1, 1, 0]]
    # 100 distinct values, share 0.07: k = 7, the values 93…99, though 0.07·100 = 7.000000000000001 in
    # floats (a bare ceil: 8 tokens); wanted = 5 in place of the share: 95…99.
    values = torch.arange(100.0)[None]
    assert common.top_share(values, torch.ones(1, 100), 0.07).nonzero()[:, 1].tolist() == list(range(93, 100))
    assert common.top_share(values, torch.ones(1, 100), 1.0, wanted=5).nonzero()[:, 1].tolist() == list(range(95, 100))


def test_top_share_takes_exactly_k_tokens_and_the_earliest_of_a_tie():
    # k = ⌈share·count⌉ tokens exactly (issue 42: every token tied with the k-th was kept). Of the tokens
    # tied at the k-th value, the earliest in the mini-batch's order are taken: row by row, position by
    # position (padding skipped).
    #   [[2, 2, 2, 1]], share 0.5: k = 2 of the three 2s -> the first two.
    #   [[1, 3, 9], [3, 3, 0]] (9 padding), share 0.5 of 5 -> k = ⌈2.5⌉ = 3: the three 3s (no tie at the cut);
    #   share 0.4 -> k = 2 of the three 3s: (0, 1) and (1, 0), not (1, 1).
    #   All equal, 20 tokens, share 0.2 -> k = 4: the first four; share 0.01 -> k = 1: the first.
    #   -0.0 and 0.0 are one value: [[-0.0, 0.0]], share 0.5 -> the first.
    take = common.top_share
    assert take(torch.tensor([[2.0, 2.0, 2.0, 1.0]]), torch.ones(1, 4), 0.5).int().tolist() == [[1, 1, 0, 0]]
    values, valid = torch.tensor([[1.0, 3.0, 9.0], [3.0, 3.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert take(values, valid, 0.5).int().tolist() == [[0, 1, 0], [1, 1, 0]]
    assert take(values, valid, 0.4).int().tolist() == [[0, 1, 0], [1, 0, 0]]
    assert take(torch.zeros(4, 5), torch.ones(4, 5), 0.2).flatten().nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert take(torch.zeros(4, 5), torch.ones(4, 5), 0.01).flatten().nonzero().flatten().tolist() == [0]
    assert take(torch.tensor([[-0.0, 0.0]]), torch.ones(1, 2), 0.5).int().tolist() == [[1, 0]]
    # Negative, tiny and huge values rank as numbers do (the bisection runs over fp32's ordering, exact
    # in at most 33 halvings): the 3 largest of these 7 are 1e30, 1e-30 and 1e-38 (a subnormal).
    values = torch.tensor([[-1e30, -2.0, -1e-30, 1e-38, 1e-30, 1e30, -1e-38]])
    assert take(values, torch.ones(1, 7), 3 / 7).int().tolist() == [[0, 0, 0, 1, 1, 1, 0]]


def two_ranks(function, *halves):
    """function(*half, reduce, rank) on two "ranks" in two threads, each with its half of the rows,
    their sums (numbers and tensors), minima and maxima exchanged at every step as all_reduce would.
    Returns the two results."""
    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def rank(index):
        def reduce(value, op="sum"):
            slots[index] = value
            barrier.wait()
            mine, other = slots[index], slots[1 - index]
            barrier.wait()
            return mine + other if op == "sum" else min(mine, other) if op == "min" else max(mine, other)

        results[index] = function(*halves[index], reduce, index)

    threads = [threading.Thread(target=rank, args=(index,)) for index in (0, 1)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    return results


def test_top_share_breaks_a_tie_over_two_ranks_as_one_process():
    # 6 rows of 5, every value 0.5 except a few 0.9, rows 0-2 on rank 0 and 3-5 on rank 1: the k-th
    # value is tied across both ranks, and together they take the tokens one process takes: the
    # earliest, rank 0's rows first (the prompts' order: rank r holds prompts r·B/K …).
    values = torch.full((6, 5), 0.5)
    values[4, 1] = values[1, 3] = 0.9
    valid = torch.ones(6, 5, dtype=torch.long)
    valid[0, 3:] = valid[3, :2] = 0
    for share in (0.2, 0.5, 0.9):  # k = 6, 13, 24 of 26: ties taken on rank 0 only, on both, on both
        one = common.top_share(values, valid, share)
        kept = two_ranks(
            lambda v, m, reduce, rank, share=share: common.top_share(v, m, share, reduce, rank_index=rank),
            (values[:3], valid[:3]),
            (values[3:], valid[3:]),
        )
        assert torch.equal(torch.cat(kept), one) and one.sum() == math.ceil(share * 26)
        assert one[4, 1] and one[1, 3]  # the two 0.9s, above the tie


def test_top_share_over_two_ranks_is_one_process():
    # Random values, no ties: two "ranks" (two_ranks) together keep exactly the tokens one process keeps.
    torch.manual_seed(0)
    values, valid = torch.rand(6, 5), (torch.rand(6, 5) > 0.3).long()
    one = common.top_share(values, valid, 0.2)
    kept = two_ranks(
        lambda v, m, reduce, rank: common.top_share(v, m, 0.2, reduce, rank_index=rank),
        (values[:3], valid[:3]),
        (values[3:], valid[3:]),
    )
    assert torch.equal(torch.cat(kept), one) and one.sum() == math.ceil(0.2 * valid.sum().item())


@pytest.mark.parametrize("script", [grpo, dapo])
def test_top_entropy_gradient_accumulation_equals_one_big_batch(sampled, script):
    # The top 20% are chosen over the whole mini-batch before its micro-batches: micro-batches of 3, 5
    # and 12 rows give the one gradient; and it differs from the gradient of every token.
    model, tokenizer, batch = sampled
    torch.manual_seed(1)
    batch = {**batch, "entropy": torch.rand(batch["completion_mask"].shape) * batch["completion_mask"]}
    settings = {"top_entropy_quantile": 0.2, "num_iterations": 2, "beta": 0.04}
    settings |= {"max_new_tokens": 12} if script is grpo else {"overlong_buffer": 0}
    gradients = []
    for micro_batch_size, quantile in ((12, 0.2), (3, 0.2), (5, 0.2), (12, 1.0)):
        model.zero_grad(set_to_none=True)
        args = script.Args(micro_batch_size=micro_batch_size, **(settings | {"top_entropy_quantile": quantile}))
        totals, _ = script.policy_backward(model, batch, args, len(tokenizer))
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for gradient in gradients[1:3]:
        assert (gradient - gradients[0]).abs().max() <= 1e-5 * gradients[0].abs().max()
    assert (gradients[3] - gradients[0]).abs().max() > 1e-3 * gradients[0].abs().max()


@pytest.mark.parametrize("script", [grpo, dapo])
def test_top_entropy_run_scores_the_old_policy_and_logs_the_share(script, tmp_path):
    # On-policy step 4 would skip the policy's pass; the quantile needs π_θold's entropy first, so it
    # runs, and the share of tokens that kept their gradient is logged: ⌈0.5·count⌉/count, 0.5 or a little more.
    settings = dict(model="tiny", task="digit", max_new_tokens=4, batch_size=2, group_size=4, max_steps=2, save_every=0)
    settings |= {"overlong_buffer": 0} if script is dapo else {}
    run = script.train(script.Args(output_dir=str(tmp_path), top_entropy_quantile=0.5, **settings))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0.5 <= row["entropy/kept_fraction"] <= 0.6 for row in rows)
    with pytest.raises(SystemExit, match=r"--top_entropy_quantile must be in \(0, 1\]"):
        script.check_args(script.Args(top_entropy_quantile=0.0))


# ----------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov (arXiv 2505.22617): Cov_t = (log π − mean log π)(Â − mean Â) over the mini-batch


@pytest.mark.parametrize("script", [grpo, dapo])
def test_token_covariance_and_the_tokens_chosen_by_hand(script):
    # log π_θold [[−1, −2], [−3, pad]], Â = [1, −1]: valid tokens log π −1, −2, −3 (mean −2), Â 1, 1, −1
    # (mean 1/3): Cov = (1)(2/3) = 0.666667, (0)(2/3) = 0, (−1)(−4/3) = 1.333333; padding 0.
    old_logp = torch.tensor([[-1.0, -2.0], [-3.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    advantages = torch.tensor([1.0, -1.0])
    cov = script.token_covariance(old_logp, advantages, mask)
    assert cov.flatten().tolist() == pytest.approx([0.666667, 0.0, 1.333333, 0.0], abs=1e-6)
    batch = {"old_logp": old_logp, "advantages": advantages}
    # KL-Cov, k = 1/3 of 3 tokens: the one of largest Cov, 1.333333.
    chosen = script.covariance_tokens(batch, mask, script.Args(loss_type="kl_cov", kl_cov_ratio=1 / 3))
    assert chosen.int().tolist() == [[0, 0], [1, 0]]
    # Clip-Cov, band [0.5, 5] holds 0.666667 and 1.333333; r·N = 0.34·3 = 1.02 tokens -> ⌈1.02⌉ = 2: both.
    # Band [1, 5] holds 1.333333 alone: r·N = 1 of 1.
    args = script.Args(loss_type="clip_cov", clip_cov_ratio=0.34, clip_cov_bounds="0.5,5")
    assert script.covariance_tokens(batch, mask, args).int().tolist() == [[1, 0], [1, 0]]
    args = script.Args(loss_type="clip_cov", clip_cov_ratio=1 / 3, clip_cov_bounds="1,5")
    assert script.covariance_tokens(batch, mask, args).int().tolist() == [[0, 0], [1, 0]]
    # r·N counts every valid token, the band only limits where they are taken: 100 tokens, r = 0.14,
    # ⌈14⌉ = 14 tokens (0.14·100 = 14.000000000000002 in floats), the band's 14 largest Cov. Â = ±1 on
    # alternate rows and log π = row index give Cov ∝ ±(row − mean): 50 rows have Cov > 0.
    old_logp = torch.arange(100.0)[:, None]  # (100, 1) one token per completion
    batch = {"old_logp": old_logp, "advantages": torch.tensor([1.0, -1.0] * 50)}
    args = script.Args(loss_type="clip_cov", clip_cov_ratio=0.14, clip_cov_bounds="0,1000")
    chosen = script.covariance_tokens(batch, torch.ones(100, 1), args)
    cov = script.token_covariance(old_logp, batch["advantages"], torch.ones(100, 1))
    assert chosen.sum().item() == 14 and cov[chosen].min() >= cov[~chosen & (cov >= 0)].max()


@pytest.mark.parametrize("script", [grpo, dapo])
def test_kl_cov_objective_by_hand(script):
    # log π_θ = 0.5, log π_θold = 0 (r = e^0.5 = 1.648721), Â = 1, β = 1:
    #   chosen:     r·Â − β|0.5| = 1.148721, d/d log π = r·Â − β·sign(0.5) = 0.648721
    #   not chosen: r·Â = 1.648721, d/d log π = 1.648721 (no clip: KL-Cov replaces it)
    logp = torch.tensor([[0.5, 0.5]], requires_grad=True)
    ratio = torch.exp(logp)
    objective = script.kl_cov_objective(
        logp, torch.zeros(1, 2), ratio, torch.ones(1, 1), torch.tensor([[True, False]]), 1.0
    )
    objective.sum().backward()
    assert objective.flatten().tolist() == pytest.approx([1.148721, 1.648721], abs=1e-6)
    assert logp.grad.flatten().tolist() == pytest.approx([0.648721, 1.648721], abs=1e-6)


@pytest.mark.parametrize("script", [grpo, dapo])
@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov"])
def test_cov_gradient_accumulation_equals_one_big_batch(sampled, script, loss_type):
    # The tokens are chosen over the whole mini-batch, from π_θold: micro-batches of 3, 5 and 12 rows
    # give one gradient (μ = 2, so r ≠ 1 and KL-Cov's penalty acts), which differs from GRPO's or DAPO's.
    model, tokenizer, batch = sampled
    ratio = (
        {"clip_cov_ratio": 0.05, "clip_cov_bounds": "-100,100"} if loss_type == "clip_cov" else {"kl_cov_ratio": 0.05}
    )
    settings = {"num_iterations": 2, "beta": 0.0, **ratio}
    settings |= {"max_new_tokens": 12} if script is grpo else {"overlong_buffer": 0}
    plain = "grpo" if script is grpo else "dapo"
    gradients = []
    for micro_batch_size, kind in ((12, loss_type), (3, loss_type), (5, loss_type), (12, plain)):
        model.zero_grad(set_to_none=True)
        args = script.Args(micro_batch_size=micro_batch_size, loss_type=kind, **settings)
        totals, _ = script.policy_backward(model, batch, args, len(tokenizer))
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if kind == loss_type:  # 5% of the mini-batch's valid tokens, ⌈0.05·count⌉ exactly
            assert totals["cov_tokens"] == math.ceil(0.05 * batch["completion_mask"].sum().item())
    for gradient in gradients[1:3]:
        assert (gradient - gradients[0]).abs().max() <= 1e-5 * gradients[0].abs().max()
    assert (gradients[3] - gradients[0]).abs().max() > 1e-4 * gradients[0].abs().max()


@pytest.mark.parametrize("script", [grpo, dapo])
def test_an_all_zero_advantage_mini_batch_gets_one_covariance_token_not_all(sampled, script):
    # Every group's rewards equal (a stalled run): Â = 0, so Cov_t = (log π − mean)·0 = 0 on every token,
    # all tied. KL-Cov with k = 2e-4 of N tokens takes ⌈2e-4·N⌉ = 1 token, the first valid one (row 0,
    # position 0), not all N (issue 42); Clip-Cov with a band holding 0 (ω −1, 5) the same one.
    model, tokenizer, batch = sampled
    mask = batch["completion_mask"]
    batch = {**batch, "advantages": torch.zeros(len(mask))}
    for settings in ({"loss_type": "kl_cov"}, {"loss_type": "clip_cov", "clip_cov_bounds": "-1,5"}):
        args = script.Args(**settings)
        chosen = script.covariance_tokens(batch, mask, args)
        assert chosen.nonzero().tolist() == [[0, 0]] and mask[0, 0] == 1
        args = script.Args(micro_batch_size=5, num_iterations=2, beta=0.0, **settings)
        args = dataclasses.replace(args, **({"max_new_tokens": 12} if script is grpo else {"overlong_buffer": 0}))
        model.zero_grad(set_to_none=True)
        totals, _ = script.policy_backward(model, batch, args, len(tokenizer))
        assert totals["cov_tokens"] == 1
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("script", [grpo, dapo])
def test_equal_entropies_keep_exactly_the_top_share(sampled, script):
    # Every token's entropy equal (so all tie): ρ = 0.2 keeps ⌈0.2·N⌉ tokens, not all N.
    model, tokenizer, batch = sampled
    count = batch["completion_mask"].sum().item()
    batch = {**batch, "entropy": torch.ones(batch["completion_mask"].shape)}
    settings = {"top_entropy_quantile": 0.2, "num_iterations": 2, "micro_batch_size": 5}
    settings |= {"max_new_tokens": 12} if script is grpo else {"overlong_buffer": 0}
    model.zero_grad(set_to_none=True)
    totals, _ = script.policy_backward(model, batch, script.Args(**settings), len(tokenizer))
    model.zero_grad(set_to_none=True)
    assert totals["entropy_kept"] == math.ceil(0.2 * count) < count


# ----------------------------------------------------------------------------------------
# DPPO (arXiv 2602.04879): a trust region on p − q, the token's probability under π_θ and π_θold


@pytest.mark.parametrize("script", [grpo, dapo])
def test_dppo_objective_by_hand(script):
    # δ = 0.2, C = 20; each token's (p, q, Â): objective sg(min(r, C))·Â·log p if kept, else 0;
    # gradient d/d log p = min(r, C)·Â on a kept token (r = p/q).
    #   (0.3, 0.2, +1): p − q = 0.1 ≤ δ, kept:     1.5 · log 0.3 = −1.805959, gradient 1.5
    #   (0.5, 0.2, +1): p − q = 0.3 > δ, dropped:  0, gradient 0 (r = 2.5 is inside no ratio clip either)
    #   (0.5, 0.2, −1): p − q = 0.3 ≥ −δ, kept:    −2.5 · log 0.5 = 1.732868, gradient −2.5
    #   (0.1, 0.4, −1): p − q = −0.3 < −δ, dropped: 0, gradient 0
    #   (1.0, 0.01, −1): kept, r = 100 capped at 20: −20 · log 1 = 0, gradient −20
    p = torch.tensor([[0.3, 0.5, 0.5, 0.1, 1.0]])
    q = torch.tensor([[0.2, 0.2, 0.2, 0.4, 0.01]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    logp = p.log().requires_grad_(True)
    objective, cut = script.dppo_objective(
        logp, q.log(), torch.ones_like(p), advantages, divergence="binary_tv", delta=0.2, cap=20.0
    )
    objective.sum().backward()
    assert cut.int().tolist() == [[0, 1, 0, 1, 0]]
    assert objective.flatten().tolist() == pytest.approx([-1.805959, 0.0, 1.732868, 0.0, 0.0], abs=1e-5)
    assert logp.grad.flatten().tolist() == pytest.approx([1.5, 0.0, -2.5, 0.0, -20.0], abs=1e-4)


@pytest.mark.parametrize("region", [{}, {"dppo_type": "binary_kl", "kl_tau": 0.01}], ids=["tv", "kl-tau"])
@pytest.mark.parametrize("script", [grpo, dapo])
def test_dppo_gradient_accumulation_and_its_settings(sampled, script, region):
    model, tokenizer, batch = sampled
    settings = {"loss_type": "dppo", "num_iterations": 2, "beta": 0.0} | region
    settings |= {"max_new_tokens": 12} if script is grpo else {"overlong_buffer": 0}
    gradients = []
    for micro_batch_size in (12, 3, 5):
        model.zero_grad(set_to_none=True)
        script.policy_backward(model, batch, script.Args(micro_batch_size=micro_batch_size, **settings), len(tokenizer))
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert gradients[0].abs().max() > 0
    for gradient in gradients[1:]:
        assert (gradient - gradients[0]).abs().max() <= 1e-5 * gradients[0].abs().max()
    with pytest.raises(SystemExit, match="--dppo_delta and --dppo_kl_delta must be > 0"):
        script.check_args(script.Args(loss_type="dppo", dppo_kl_delta=0.0))


@pytest.mark.parametrize("script", [grpo, dapo])
def test_dppo_binary_kl_by_hand(script):
    # Binary-KL (DPPO Eq. 14), δ = 0.05: D = q·ln(q/p) + (1 − q)·ln((1 − q)/(1 − p)), the KL between
    # the sampling and the current Bernoulli "this token or another"; a token leaves when D > δ and p
    # moved the way Â pushes it (p > q where Â > 0, p < q where Â < 0). Each token's (p, q, Â):
    #   (0.3, 0.2, +1):   D = 0.2·ln(2/3) + 0.8·ln(8/7) = −0.081093 + 0.106825 = 0.025732 ≤ δ, kept:
    #                     1.5 · ln 0.3 = −1.805959, gradient r·Â = 1.5
    #   (0.5, 0.2, +1):   D = 0.2·ln 0.4 + 0.8·ln 1.6 = 0.192745 > δ, p > q: dropped
    #   (0.5, 0.2, −1):   the same D, but p rose where Â < 0 pushes it down: kept, −2.5·ln 0.5 = 1.732868
    #   (0.1, 0.4, −1):   D = 0.4·ln 4 + 0.6·ln(2/3) = 0.311239 > δ, p < q: dropped
    #   (0.15, 0.02, +1): D = 0.02·ln(2/15) + 0.98·ln(98/85) = 0.099172 > δ, p > q: dropped, where
    #                     Binary-TV keeps it (p − q = 0.13 ≤ 0.2): a rare token's move counts for more
    #   (0.35, 0.4, −1):  D = 0.4·ln(8/7) + 0.6·ln(12/13) = 0.005387 ≤ δ, kept: r = 0.875,
    #                     −0.875 · ln 0.35 = 0.918594, gradient −0.875
    #   (0.09, 0.02, +1): D = 0.02·ln(2/9) + 0.98·ln(98/91) = 0.042544 ≤ δ, kept: 4.5 · ln 0.09 =
    #                     −10.835755, gradient 4.5 (the KL the other way, p·ln(p/q) + …, is 0.067923:
    #                     it would drop the token)
    p = torch.tensor([[0.3, 0.5, 0.5, 0.1, 0.15, 0.35, 0.09]])
    q = torch.tensor([[0.2, 0.2, 0.2, 0.4, 0.02, 0.4, 0.02]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0]])
    logp = p.log().requires_grad_(True)
    objective, cut = script.dppo_objective(
        logp, q.log(), torch.ones_like(p), advantages, divergence="binary_kl", delta=0.05, cap=20.0
    )
    objective.sum().backward()
    assert cut.int().tolist() == [[0, 1, 0, 1, 1, 0, 0]]
    expected = [-1.805959, 0, 1.732868, 0, 0, 0.918594, -10.835755]
    assert objective.flatten().tolist() == pytest.approx(expected, abs=1e-5)
    assert logp.grad.flatten().tolist() == pytest.approx([1.5, 0, -2.5, 0, 0, -0.875, 4.5], abs=1e-4)
    tv, _ = script.dppo_objective(
        p.log(), q.log(), torch.ones_like(p), advantages, divergence="binary_tv", delta=0.2, cap=20.0
    )  # the fifth token: kept by Binary-TV
    assert tv[0, 4].item() == pytest.approx(7.5 * math.log(0.15), abs=1e-5)
    # A token the sampler was certain of (μ = 1, log μ = 0) that π_θ lowered to p = 0.5, Â = −1:
    # D = 1·ln(1/0.5) + 0·(…) = ln 2 = 0.693 > δ with p < μ: dropped, gradient 0. (1 − μ = 0 gives
    # 0·ln(0/0.5) = NaN unfloored, and NaN > δ is False: the token would be kept, gradient r·Â = −0.5.)
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    certain, cut = script.dppo_objective(
        logp, torch.zeros(1, 1), torch.ones(1, 1), -torch.ones(1, 1), divergence="binary_kl", delta=0.05, cap=20.0
    )
    certain.sum().backward()
    assert cut.tolist() == [[True]] and logp.grad.item() == 0.0
    # --dppo_type picks the region's δ: the paper's 0.2 for Binary-TV, 0.05 for Binary-KL
    assert script.dppo_region(script.Args(dppo_type="binary_kl")) == {
        "divergence": "binary_kl",
        "delta": 0.05,
        "cap": 20,
    }
    assert script.dppo_region(script.Args()) == {"divergence": "binary_tv", "delta": 0.2, "cap": 20}


@pytest.mark.parametrize("script", [grpo, dapo])
def test_kimi_squared_log_ratio_penalty_by_hand(script):
    # Kimi K2.5's penalty τ·(log π_θ − log π_θold)² on every valid token, DPPO's dropped ones included.
    # One completion, |o| = 2, Â = +1, τ = 0.01, Binary-TV δ = 0.2:
    #   token 1 (p, q) = (0.5, 0.2): p − q = 0.3 > δ, dropped; log r = ln 2.5 = 0.916291
    #   token 2 (p, q) = (0.3, 0.2): kept, objective 1.5·ln 0.3 = −1.805959; log r = ln 1.5 = 0.405465
    # GRPO's 1/|o| Σ_t and DAPO's token mean are the same here (one completion of two tokens):
    #   loss = −(0 − 1.805959)/2 + 0.01·(0.916291² + 0.405465²)/2 = 0.902980 + 0.005020 = 0.908000
    #   d/d log p_1 = 2τ·log r_1 / 2 = 0.009163 (the dropped token is still pulled back toward q)
    #   d/d log p_2 = −1.5/2 + 2τ·log r_2 / 2 = −0.75 + 0.004055 = −0.745945
    logp, old_logp = torch.tensor([[0.5, 0.3]]).log(), torch.tensor([[0.2, 0.2]]).log()
    settings = {"loss_type": "dppo", "beta": 0.0, "kl_tau": 0.01}
    loss, gradient, _ = loss_of(script, logp, old_logp, torch.tensor([1.0]), **settings)
    assert loss == pytest.approx(0.908000, abs=1e-5)
    assert gradient.flatten().tolist() == pytest.approx([0.009163, -0.745945], abs=1e-5)
    # a group of equal rewards (Â = 0) has no policy term, but the penalty stays on its tokens:
    #   loss = 0.01·(0.839589 + 0.164402)/2 = 0.005020, gradient 2τ·log r/2 = 0.009163, 0.004055
    loss, gradient, _ = loss_of(script, logp, old_logp, torch.tensor([0.0]), **settings)
    assert loss == pytest.approx(0.005020, abs=1e-6)
    assert gradient.flatten().tolist() == pytest.approx([0.009163, 0.004055], abs=1e-6)
    # the penalty is 0 with a 0 gradient on-policy (log r = 0): the update is the plain one
    on_policy = loss_of(script, old_logp, old_logp, torch.tensor([1.0]), **settings)[1]
    plain = loss_of(script, old_logp, old_logp, torch.tensor([1.0]), **(settings | {"kl_tau": 0.0}))[1]
    assert torch.equal(on_policy, plain)
    with pytest.raises(SystemExit, match="--kl_tau must be >= 0"):
        script.check_args(script.Args(kl_tau=-0.1))
    with pytest.raises(SystemExit, match="--dppo_type must be one of binary_tv, binary_kl"):
        script.check_args(script.Args(loss_type="dppo", dppo_type="topk_tv"))


@pytest.mark.parametrize("script", [grpo, dapo])
def test_dppo_and_the_penalty_measure_from_the_sampler(script):
    # As the paper does (Sec. 5.2): μ is the sampler's log-prob, not π_θold's. One completion of two
    # tokens, on-policy by π_θold (old_logp = logp: r = 1), but the sampler gave μ = (0.2, 0.2) where
    # π_θ has p = (0.5, 0.3), Â = +1, δ = 0.2, τ = 0.01: the numbers of the penalty's test above, with
    # old_logp out of the picture (measured from π_θold, every token would be kept, the penalty 0).
    logp, sample_logp = torch.tensor([[0.5, 0.3]]).log(), torch.tensor([[0.2, 0.2]]).log()
    settings = {"loss_type": "dppo", "beta": 0.0, "kl_tau": 0.01}
    loss, gradient, stats = loss_of(script, logp, logp, torch.tensor([1.0]), sample_logp=sample_logp, **settings)
    assert loss == pytest.approx(0.908000, abs=1e-5)
    assert gradient.flatten().tolist() == pytest.approx([0.009163, -0.745945], abs=1e-5)
    # the dropped token is the clip's count: probability rose too far where Â > 0
    assert (stats["clip_high"], stats["clip_low"], stats["tokens"]) == (1, 0, 2)
    with pytest.raises(SystemExit, match="--loss_type dppo's objective"):
        script.check_args(script.Args(loss_type="dppo", dual_clip=3.0))


def test_maxrl_on_dapos_shaped_reward_divides_by_the_task_reward():
    # Task rewards [1, 0, 0, 0], lengths [4, 7, 7, 7] of 8 with a buffer of 4: penalties
    # [0, −0.75 ×3] ((8 − 4 − 7)/4). The shaped reward S = [1, −0.75 ×3], mean −0.3125, centred
    # [1.3125, −0.4375 ×3]; MaxRL divides by the task reward's mean 0.25, not S's (−0.3125, which
    # would flip the signs): [5.25, −1.75, −1.75, −1.75]. And by hand on a shaped [1, −0.25 ×3]:
    # mean 0.0625, centred [0.9375, −0.3125 ×3], over 0.25: [3.75, −1.25 ×3].
    rewards, lengths = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([4, 7, 7, 7])
    advantages, penalty = dapo.shaped_advantages(rewards, lengths, 4, max_length=8, buffer=4, eps=1e-6, scale="mean")
    assert penalty.tolist() == [0.0, -0.75, -0.75, -0.75]  # (8 − 4 − 7)/4, clamped at −1: length 7 of 8
    shaped = rewards + penalty
    assert shaped.tolist() == [1.0, -0.75, -0.75, -0.75]
    assert advantages.tolist() == pytest.approx([5.25, -1.75, -1.75, -1.75], abs=1e-4)  # ε = 1e-6 in 0.25 + ε
    by_hand = grpo.scaled_advantages(
        torch.tensor([1.0, -0.25, -0.25, -0.25]), 4, "mean", 1e-6, success=torch.tensor([1.0, 0, 0, 0])
    )
    assert by_hand.tolist() == pytest.approx([3.75, -1.25, -1.25, -1.25], abs=1e-4)  # ε = 1e-6 in 0.25 + ε
    with pytest.raises(SystemExit, match="rewards below 0 have none"):
        grpo.scaled_advantages(torch.tensor([1.0, -1.0, -1.0, 1.0]), 4, "mean", 1e-6)


@pytest.mark.parametrize("script", [grpo, dapo])
def test_off_policy_masking_judges_every_token_of_the_completion(script):
    # --is_mask dropped the second token (it left loss_mask), the most divergent one: the completion is
    # still judged over both its tokens, (0 + 3)/2 = 1.5 > δ = 0.5, and masked (over the kept token
    # alone, 0, it would stay).
    micro = {
        "sample_logp": torch.tensor([[-1.0, -1.0]]),
        "completion_mask": torch.tensor([[1, 1]]),
        "loss_mask": torch.tensor([[1, 0]]),
        "advantages": torch.tensor([-1.0]),
    }
    logp = torch.tensor([[-1.0, -4.0]])
    _, policy_mask, stats = script.corrections(micro, logp, logp, script.Args(off_policy_mask_threshold=0.5))
    assert policy_mask.tolist() == [[0.0, 0.0]] and stats == {"opsm_masked": 1, "opsm_sequences": 1}


@pytest.mark.parametrize("script", [grpo, dapo])
def test_clip_cov_cuts_the_chosen_tokens_and_keeps_the_rest(script):
    # Clip-Cov's chosen tokens (covariance_tokens) leave the policy term: the policy mask is 0 on them
    # and 1 elsewhere (inverted, only the chosen tokens would train); KL-Cov's chosen tokens keep
    # their policy term (its penalty acts in the loss), so it sets no mask.
    chosen = torch.tensor([[True, False, False], [False, True, False]])
    micro = {
        "cov_tokens": chosen,
        "loss_mask": torch.ones(2, 3, dtype=torch.long),
        "completion_mask": torch.ones(2, 3, dtype=torch.long),
    }
    logp = torch.zeros(2, 3)
    _, policy_mask, stats = script.corrections(micro, logp, logp, script.Args(loss_type="clip_cov"))
    assert policy_mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]] and stats == {"cov_tokens": 2}
    assert script.corrections(micro, logp, logp, script.Args(loss_type="kl_cov"))[1] is None


@pytest.mark.parametrize("script", [grpo, dapo])
def test_off_policy_masking_compares_the_sampler_with_the_current_policy(script):
    # Mid-update π_θ (logp) has moved from π_θold (old_logp); the mask reads π_θ, as DeepSeek-V3.2
    # defines it: sampler −1, π_θ −2, π_θold −1 on both tokens, Â = −1, δ = 0.5: the divergence
    # from π_θ is 1 > δ (masked); from π_θold it would be 0 (kept).
    micro = {
        "sample_logp": torch.tensor([[-1.0, -1.0]]),
        "completion_mask": torch.tensor([[1, 1]]),
        "loss_mask": torch.tensor([[1, 1]]),
        "advantages": torch.tensor([-1.0]),
    }
    logp, old_logp = torch.full((1, 2), -2.0), torch.full((1, 2), -1.0)
    _, policy_mask, _ = script.corrections(micro, logp, old_logp, script.Args(off_policy_mask_threshold=0.5))
    assert policy_mask.tolist() == [[0.0, 0.0]]
