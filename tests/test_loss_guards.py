"""The guards of the losses that a mutation run found unguarded: each test here failed on a
one-line bug planted in the advantage or loss code (named in its comment) and passes without it.

- dual-clip bounds only negative-advantage tokens (all three scripts);
- DAPO's k3 KL term enters with a + sign;
- Dr. GRPO's constant is max_new_tokens, not the batch's width;
- the sequence-level IS mask averages each row over its own length, not the padded width;
- on-policy, the ratio is exp(log π − sg(log π)): its gradient is the policy gradient;
- the on-policy shortcut is taken exactly when μ = 1 and there is one mini-batch;
- VAPO's positive-example NLL is divided by the correct completions' tokens of the whole mini-batch
  (issue 42);
- every metric update_metrics logs divides its sum by its own count (issue 42: all three scripts)."""

import pytest
import torch

import dapo
import grpo
import ppo

# Two completions of two tokens each, old_logp = 0 so r = exp(logp), ε = 0.2 (DAPO: ε_high 0.28),
# dual-clip c = 3. Sequence 1 has Â = +1 and ratios [1.0, 0.5]; sequence 2 has Â = −1 and
# ratios [5, 2].
RATIOS = torch.tensor([[1.0, 0.5], [5.0, 2.0]])
ADVANTAGES = torch.tensor([1.0, -1.0])
MASK = torch.ones(2, 2, dtype=torch.long)


def grpo_loss(ratios, advantages=ADVANTAGES, mask=MASK, **settings):
    logp = torch.log(ratios).clone().requires_grad_(True)
    args = grpo.Args(**(dict(eps=0.2, beta=0.0, max_new_tokens=ratios.shape[1]) | settings))
    loss, stats = grpo.grpo_loss(
        logp,
        torch.zeros_like(logp),
        None,
        advantages,
        mask,
        args,
        num_sequences=len(ratios),
        num_tokens=int(mask.sum()),
    )
    loss.backward()
    return loss.item(), logp.grad, stats


def dapo_loss(ratios, advantages=ADVANTAGES, mask=MASK, beta=0.0, ref_logp=None, dual_clip=0.0):
    logp = torch.log(ratios).clone().requires_grad_(True)
    args = dapo.Args(eps_low=0.2, eps_high=0.28, beta=beta, dual_clip=dual_clip)
    loss, stats = dapo.dapo_loss(
        logp, torch.zeros_like(logp), ref_logp, advantages, mask, args, num_tokens=int(mask.sum())
    )
    loss.backward()
    return loss.item(), logp.grad, stats


def ppo_loss(ratios, advantages, mask=MASK, dual_clip=0.0):
    logp = torch.log(ratios).clone().requires_grad_(True)
    args = ppo.Args(eps_low=0.2, eps_high=0.2, dual_clip=dual_clip)
    loss, stats = ppo.ppo_loss(logp, torch.zeros_like(logp), advantages, mask, args, num_tokens=int(mask.sum()))
    loss.backward()
    return loss.item(), logp.grad, stats


# ----------------------------------------------------------------------------------------
# Dual-clip (Ye et al. 2020, Eq. 4) bounds the objective of Â < 0 tokens only.
# Planted bug: the `adv < 0` guard dropped, so a positive token's min(r·Â, clip·Â) < c·Â is raised to c·Â.
#
# Per-token objectives, ε = 0.2, c = 3:
#   seq 1 (Â = +1): r = 1 -> 1;  r = 0.5 -> min(0.5, 0.8) = 0.5          (no dual bound: Â > 0)
#   seq 2 (Â = −1): r = 5 -> min(−5, −1.2) = −5 -> max(−5, c·Â = −3) = −3 (dual-clipped);
#                   r = 2 -> min(−2, −1.2) = −2 > −3: unchanged
# With the bug, seq 1's 1 and 0.5 (< c·Â = 3) would both become 3.
# Gradients, d(−J)/d log π = −w·Â·r on an unclipped token (dr/dlog π = r), 0 on a bounded one,
# w the token's weight in the mean:
#   seq 1: −w·1·1, −w·1·0.5;   seq 2: 0, −w·(−1)·2 = +2w


def test_grpo_dual_clip_leaves_positive_advantages_alone():
    # Sample-level: J = ((1 + 0.5)/2 + (−3 − 2)/2) / 2 = (0.75 − 2.5)/2 = −0.875, loss 0.875;
    # w = 1/(N·|o_i|) = 1/4: grad [[−0.25, −0.125], [0, 0.5]]. (Bug: J = (3 − 2.5)/2, loss −0.25.)
    loss, grad, stats = grpo_loss(RATIOS, dual_clip=3.0)
    assert loss == pytest.approx(0.875, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-0.25, -0.125], [0.0, 0.5]]), atol=1e-6)
    assert stats["clip_dual"] == 1


def test_dapo_dual_clip_leaves_positive_advantages_alone():
    # Token-level over 4 tokens; ε_high = 0.28 changes nothing here (no Â > 0 token has r > 1):
    #   J = (1 + 0.5 − 3 − 2)/4 = −0.875, loss 0.875; w = 1/4: the same gradient as GRPO's above.
    loss, grad, stats = dapo_loss(RATIOS, dual_clip=3.0)
    assert loss == pytest.approx(0.875, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-0.25, -0.125], [0.0, 0.5]]), atol=1e-6)
    assert stats["clip_dual"] == 1
    # Without dual-clip the r = 5 token counts −5: J = (1 + 0.5 − 5 − 2)/4 = −1.375.
    assert dapo_loss(RATIOS)[0] == pytest.approx(1.375, abs=1e-6)


def test_ppo_dual_clip_leaves_positive_advantages_alone():
    # PPO's Â is per token: the rows above as (n, T) advantages, token-level mean: as DAPO's.
    loss, grad, stats = ppo_loss(RATIOS, ADVANTAGES[:, None].expand(2, 2), dual_clip=3.0)
    assert loss == pytest.approx(0.875, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-0.25, -0.125], [0.0, 0.5]]), atol=1e-6)
    assert stats["clip_dual"] == 1


# ----------------------------------------------------------------------------------------
# DAPO's optional k3 KL term (β > 0) is added to the loss. Planted bug: its sign flipped.


def test_dapo_kl_term_by_hand():
    # Â = 0 and r = 1 leave β·KL alone, token-level over the 5 valid tokens of
    # mask [[1, 1, 1], [1, 1, 0]]. With log π = 0, k3 = π_ref/π − log(π_ref/π) − 1:
    #   π_ref/π = [[1, 0.5, 2], [0.5, 1, ·]] -> k3 = [[0, 0.193147, 0.306853], [0.193147, 0, ·]]
    #   Σ k3 = 0.693147 (= ln 2);  loss = β·Σ/5 = 0.1 · 0.693147 / 5 = 0.0138629
    # d k3 / d log π = 1 − π_ref/π, times β/5 = 0.02: [[0, 0.01, −0.02], [0.01, 0, 0]]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ref_logp = torch.log(torch.tensor([[1.0, 0.5, 2.0], [0.5, 1.0, 1.0]]))
    loss, grad, stats = dapo_loss(torch.ones(2, 3), torch.zeros(2), mask, beta=0.1, ref_logp=ref_logp)
    assert loss == pytest.approx(0.0138629, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[0.0, 0.01, -0.02], [0.01, 0.0, 0.0]]), atol=1e-6)
    assert stats["kl"] == pytest.approx(0.693147, abs=1e-5)


# ----------------------------------------------------------------------------------------
# Dr. GRPO's normaliser is N·L_max, L_max = --max_new_tokens, whatever the batch's width.
# Planted bug: the width of logp (the longest completion here) in its place.


def test_dr_grpo_constant_is_max_new_tokens_not_the_batch_width():
    # The batch of test_grpo_math (width 3; 5 valid tokens; Σ of per-token objectives 1.8), sampled
    # with --max_new_tokens 8, so no completion reached the cap:
    #   J = 1.8 / (N · L_max) = 1.8 / (2 · 8) = 0.1125, loss −0.1125   (with the width: −0.3)
    # Gradient −Â_i·r_t/16 on unclipped tokens: seq 1 [−1/16, 0, −0.5/16]; seq 2 [0.5/16, 0, 0]
    ratios = torch.tensor([[1.0, 1.5, 0.5], [1.0, 0.7, 9.9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, grad, _ = grpo_loss(ratios, torch.tensor([1.0, -0.5]), mask, loss_type="dr_grpo", max_new_tokens=8)
    assert loss == pytest.approx(-0.1125, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-1 / 16, 0, -0.5 / 16], [0.5 / 16, 0, 0]]), atol=1e-6)


# ----------------------------------------------------------------------------------------
# The sequence-level IS mask judges a completion by the geometric mean of its own ratios.
# Planted bug: the mean of the log-ratios over the padded width T instead of the row's |o_i|.


@pytest.mark.parametrize("script", [grpo, dapo, ppo])
def test_sequence_mask_averages_each_row_over_its_own_length(script):
    # Bounds [0.5, 5]. Row 0: 2 valid tokens of 4, each with k = π_θold/π_sampler = 0.4:
    #   geometric mean over its 2 tokens = 0.4 < 0.5: the row leaves.
    #   (over the padded width: exp(2·ln 0.4 / 4) = √0.4 = 0.632, inside: it would stay)
    # Row 1: 4 valid tokens with k = 0.4, 1, 1, 1.6: mean (0.64)^(1/4) = 0.894: stays.
    ratios = torch.tensor([[0.4, 0.4, 1.0, 1.0], [0.4, 1.0, 1.0, 1.6]])
    valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    sample_logp = torch.full((2, 4), -2.0)
    keep = script.importance_mask(sample_logp + torch.log(ratios), sample_logp, valid, (0.5, 5.0), "sequence")
    assert keep.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]


# ----------------------------------------------------------------------------------------
# On-policy (one update over one mini-batch) the loss sets old = sg(log π): the ratio is 1 and
# its gradient is ∇ log π, the policy gradient. Planted bugs: old_logp left attached to the graph
# (old = logp: the ratio is the constant 1, no gradient); the shortcut's condition changed.


def policy_gradient(script, model, batch, args, vocab_size):
    """The reference: the gradient of the plain policy-gradient loss at r = 1, written out:
        GRPO  −1/N · Σ_i Â_i/|o_i| · Σ_t log π(o_it)        (sample-level mean)
        DAPO  −1/Σ|o_i| · Σ_i Σ_t Â_i · log π(o_it)          (token-level mean)
        PPO   −1/Σ|o_i| · Σ_i Σ_t Â_it · log π(o_it)         (token-level, Â per token)
    with log π from the script's own sequence_logprobs, in one pass."""
    model.zero_grad(set_to_none=True)
    logp, _ = script.sequence_logprobs(
        model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
        args.temperature, vocab_size, chunk_size=len(batch["completion_ids"]),
    )  # fmt: skip
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"] if batch["advantages"].dim() == 2 else batch["advantages"][:, None]
    if script is grpo:
        loss = -((advantages * logp * mask).sum(-1) / mask.sum(-1)).sum() / len(logp)
    else:
        loss = -(advantages * logp * mask).sum() / mask.sum()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def update_gradient(script, model, batch, args, vocab_size):
    model.zero_grad(set_to_none=True)
    script.policy_backward(model, batch, args, vocab_size)
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def on_policy_batch(script, batch, old_logp_offset):
    """The sampled batch with Â = +1 for every completion (every token, for PPO), no reference,
    and old_logp = the model's log-probs − offset: a ratio of e^offset wherever it is read."""
    n, t = batch["completion_ids"].shape
    advantages = torch.ones(n, t) if script is ppo else torch.ones(n)
    return {
        **batch,
        "advantages": advantages,
        "ref_logp": None,
        "old_logp": old_logp_offset,
        "positive": torch.zeros(n),
    }


SETTINGS = {
    grpo: dict(beta=0.0, max_new_tokens=12, micro_batch_size=4),
    dapo: dict(beta=0.0, overlong_buffer=0, micro_batch_size=4),
    ppo: dict(beta=0.0, micro_batch_size=4),
}
EPOCHS = {grpo: "num_iterations", dapo: "num_iterations", ppo: "ppo_epochs"}


@pytest.mark.parametrize("script", [grpo, dapo, ppo])
def test_on_policy_update_is_the_policy_gradient(sampled, script):
    # r = exp(log π − sg(log π)) = 1 with ∇r = ∇log π, so the clipped surrogate's gradient at r = 1 is
    # the policy gradient above, exactly (up to float reassociation), whatever old_logp holds: the
    # recorded one (here deliberately 1 nat off, which off-policy would clip every token) is not read.
    model, tokenizer, batch = sampled
    args = script.Args(**SETTINGS[script], num_mini_batches=1)  # PPO's default is 4
    with torch.no_grad():
        logp, _ = script.sequence_logprobs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
            args.temperature, len(tokenizer), chunk_size=4,
        )  # fmt: skip
    batch = on_policy_batch(script, batch, logp - 1.0)
    expected = policy_gradient(script, model, batch, args, len(tokenizer))
    got = update_gradient(script, model, batch, args, len(tokenizer))
    assert expected.abs().max() > 0
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("script", [grpo, dapo, ppo])
@pytest.mark.parametrize("updates", [(2, 1), (1, 2)])
def test_off_policy_update_reads_the_recorded_old_logp(sampled, script, updates):
    # μ = 2 (or two mini-batches): θ moves between updates, so the ratio must use the recorded
    # log π_θold. It is 1 nat below log π here: r = e ≈ 2.72 > 1 + ε on every token, all Â > 0,
    # so every token is clipped and, with β = 0, the gradient is exactly 0. Taking the on-policy
    # shortcut instead (r = 1) would give the policy gradient.
    model, tokenizer, batch = sampled
    epochs, mini_batches = updates
    args = script.Args(**SETTINGS[script], num_mini_batches=mini_batches, **{EPOCHS[script]: epochs})
    with torch.no_grad():
        logp, _ = script.sequence_logprobs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
            args.temperature, len(tokenizer), chunk_size=4,
        )  # fmt: skip
    batch = on_policy_batch(script, batch, logp - 1.0)
    model.zero_grad(set_to_none=True)
    totals, _ = script.policy_backward(model, batch, args, len(tokenizer))
    gradient = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(not g.abs().any() for g in gradient)
    assert totals["clip_high"] == totals["tokens"] == batch["completion_mask"].sum().item()


# ----------------------------------------------------------------------------------------
# VAPO's positive-example NLL (ppo.py, --pos_lm_coef) is divided by the tokens of the correct
# completions in the whole mini-batch. Planted bugs: divided by every completion's tokens, by the
# loss mask's count, by the positive completions' number, or by each micro-batch's own positive tokens.

FP32_EPS = 1.19e-7  # torch.finfo(torch.float32).eps


def test_ppo_positive_nll_is_divided_by_the_positive_tokens_of_the_mini_batch(sampled):
    # 12 completions of hand-set lengths, rows 1, 3 and 7 correct (3 + 1 + 9 = 13 positive tokens, of
    # 79), micro-batches of 5 rows (5, 5, 2), so the three correct rows fall in two of them:
    #   pos_nll = −Σ_{i∈{1,3,7}} Σ_{t<|o_i|} log π(o_it) / 13
    # with log π the pass's own, which policy_backward records (on-policy, old_logp None).
    model, tokenizer, batch = sampled
    lengths = torch.tensor([12, 3, 7, 1, 12, 5, 2, 9, 4, 12, 6, 6])
    mask = (torch.arange(12)[None, :] < lengths[:, None]).long()  # (12, 12)
    positive = torch.zeros(12, dtype=torch.bool)
    positive[[1, 3, 7]] = True
    batch = {**batch, "completion_mask": mask, "old_logp": None, "ref_logp": None, "positive": positive}
    batch |= {"advantages": torch.ones(12, 12), "returns": torch.zeros(12, 12), "old_values": torch.zeros(12, 12)}
    args = ppo.Args(beta=0.0, micro_batch_size=5, num_mini_batches=1, ppo_epochs=1, pos_lm_coef=0.1)
    model.zero_grad(set_to_none=True)
    totals, recorded = ppo.policy_backward(model, batch, args, len(tokenizer))
    model.zero_grad(set_to_none=True)
    positive_tokens = mask * positive[:, None]  # (12, 12)
    assert (totals["pos_tokens"], int(mask.sum())) == (13, 79)
    summed = -(recorded["old_logp"].double() * positive_tokens).sum().item()  # Σ −log π, 13 terms of one sign
    # The script sums the 13 terms in fp32 in another order (per micro-batch, then the three quotients):
    # at most 13 + 3 roundings of eps each, relative to the sum (every term has the same sign).
    assert totals["pos_nll"] == pytest.approx(summed / 13, rel=16 * FP32_EPS)
    assert summed > 0


# ----------------------------------------------------------------------------------------
# Every count a metric reads, by hand (issue 42's "every count that a metric or a normaliser reads"):
# update_metrics turns the sums of a step's updates into its logged means and fractions. Planted bugs:
# a fraction over the wrong count (the kept tokens instead of every valid one, the sequences instead
# of the tokens), a mean over the micro-batches instead of the optimizer steps.

# A step of 2 optimizer steps (grad norms 1 and 3) whose updates kept 30 tokens of 40 (--is_mask took
# 10) and 1 completion of 8; the other sums are chosen so that every quotient below is distinct.
UPDATE = {
    "loss": 0.6, "kl": 3.0, "tokens": 30, "masked_tokens": 10, "sequences": 8, "masked_sequences": 1,
    "clip_low": 3, "clip_high": 6, "clip_dual": 1, "ratio_max": 2.5, "tis_weight": 33.0, "tis_weight_max": 1.9,
    "entropy_kept": 12, "cov_tokens": 21, "opsm_masked": 3, "opsm_sequences": 5,
}  # fmt: skip
SHARED_METRICS = {
    "loss/policy": 0.3,  # 0.6 over the 2 optimizer steps
    "clip/low": 0.1,  # 3 / 30 kept tokens
    "clip/high": 0.2,  # 6 / 30
    "clip/fraction": 0.3,  # (3 + 6) / 30
    "clip/dual": 1 / 30,
    "clip/ratio_max": 2.5,  # the largest, not a mean
    "optim/grad_norm": 2.0,  # (1 + 3) / 2
    "tis/weight_mean": 1.1,  # 33 / 30
    "tis/weight_max": 1.9,
    "is_mask/token_fraction": 0.25,  # 10 masked / (30 + 10) valid
    "is_mask/sequence_fraction": 0.125,  # 1 / 8 completions
}


@pytest.mark.parametrize("script", [grpo, dapo])
def test_update_metrics_divide_each_sum_by_its_own_count(script):
    metrics = script.update_metrics(UPDATE, [1.0, 3.0], 1e-6)
    expected = SHARED_METRICS | {
        "kl/mean": 0.1,  # 3 / 30
        "entropy/kept_fraction": 0.4,  # 12 / 30
        "cov/token_fraction": 0.7,  # 21 / 30
        "opsm/sequence_fraction": 0.6,  # 3 / 5
        "optim/lr": 1e-6,
    }
    assert metrics == pytest.approx(expected, rel=1e-12)


def test_ppo_update_metrics_divide_each_sum_by_its_own_count():
    # The actor's as above, VAPO's NLL over the optimizer steps and its tokens over every valid one
    # (the masked included: the NLL keeps them); the critic's over its own 4 steps and 40 tokens.
    update = {**UPDATE, "pos_nll": 5.0, "pos_tokens": 14}
    critic = {"loss": 2.0, "value_clipped": 6, "tokens": 40}
    metrics = ppo.update_metrics(update, [1.0, 3.0], critic, [1.0, 1.0, 2.0, 4.0], (1e-6, 1e-5))
    expected = SHARED_METRICS | {
        "loss/pos_nll": 2.5,  # 5 / 2 steps
        "pos/token_fraction": 0.35,  # 14 / (30 + 10)
        "optim/lr": 1e-6,
        "loss/value": 0.5,  # 2 / 4 critic steps
        "value/clip_fraction": 0.15,  # 6 / 40
        "optim/critic_grad_norm": 2.0,  # (1 + 1 + 2 + 4) / 4
        "optim/critic_lr": 1e-5,
    }
    assert metrics == pytest.approx(expected, rel=1e-12)
