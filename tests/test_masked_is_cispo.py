"""Masked importance sampling (--is_mask, all three scripts) and CISPO (--loss_type cispo,
grpo.py and dapo.py): each against values computed by hand (derivations inline), then the
normalisers and gradient accumulation on a real batch of the tiny model, then short runs."""

import math

import pytest
import torch
from test_techniques import assert_documented

import common
import dapo
import grpo
import ppo
from common import read_jsonl

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7: the tolerances below are N·eps, N the tokens summed

# ----------------------------------------------------------------------------------------
# importance_mask: which tokens stay


def ratios_to_logps(ratios: list[list[float]]):
    """old_logp, sample_logp (n, T) whose ratio π_θold/π_sampler is `ratios`: the sampler at
    log 0.1 everywhere, π_θold at log(0.1·k)."""
    sample = torch.full((len(ratios), len(ratios[0])), math.log(0.1))
    return sample + torch.log(torch.tensor(ratios)), sample


# Three completions, T = 4, [α, β] = [0.5, 1.5]; row 0 has 3 valid tokens (the 4th is padding).
#   row 0: k = [2.0, 0.5·1.1 = 0.55, 1.0 | pad]   2.0 > β: masked; 0.55 just inside α
#   row 1: k = [1.4, 1.4, 1.4, 2.0]              only 2.0 > β masked token by token
#   row 2: k = [0.45, 0.55, 1.45, 1.55]           0.45 < α and 1.55 > β masked; 0.55, 1.45 stay
RATIOS = [[2.0, 0.55, 1.0, 1.0], [1.4, 1.4, 1.4, 2.0], [0.45, 0.55, 1.45, 1.55]]
VALID = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])


@pytest.mark.parametrize("script", [grpo, dapo, ppo])
def test_token_mask_by_hand(script):
    old, sample = ratios_to_logps(RATIOS)
    keep = script.importance_mask(old, sample, VALID, (0.5, 1.5), "token")
    assert keep.tolist() == [[0, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 0]]
    assert keep.dtype == VALID.dtype and not keep.requires_grad


@pytest.mark.parametrize("script", [grpo, dapo, ppo])
def test_sequence_mask_by_hand(script):
    # The geometric mean of each row's valid ratios decides for the whole row:
    #   row 0: (2 · 0.55 · 1)^(1/3) = 1.1^(1/3) = 1.0323       in [0.5, 1.5]: all 3 stay (2.0 too)
    #   row 1: (1.4³ · 2)^(1/4) = 5.488^(1/4) = 1.5306        > β: the whole row leaves
    #   row 2: (0.45 · 0.55 · 1.45 · 1.55)^(1/4) = 0.55626^(1/4) = 0.8636   stays, 0.45 and 1.55 too
    # Padding stays 0 either way.
    old, sample = ratios_to_logps(RATIOS)
    keep = script.importance_mask(old, sample, VALID, (0.5, 1.5), "sequence")
    assert keep.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    # The same rows with a tighter band [0.9, 1.1]: row 2's mean 0.8636 < 0.9 leaves too; row 0's 1.0323 stays.
    keep = script.importance_mask(old, sample, VALID, (0.9, 1.1), "sequence")
    assert keep.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_is_mask_bounds_and_metrics_by_hand():
    assert common.is_mask_bounds("") is None
    assert common.is_mask_bounds("0.5,5") == (0.5, 5.0)
    assert common.is_mask_bounds("0,2") == (0.0, 2.0)  # α = 0: no lower bound
    # masked_importance over RATIOS at the token level: 3 of the 11 valid tokens leave (row 0's
    # 2.0, row 1's 2.0, row 2's 0.45 and 1.55: 4), no row leaves whole; at the sequence level row
    # 1's 4 tokens and that row.
    old, sample = ratios_to_logps(RATIOS)
    batch = {"old_logp": old, "sample_logp": sample, "completion_mask": VALID}
    keep, counts = grpo.masked_importance(batch, VALID, grpo.Args(is_mask="0.5,1.5"))
    assert counts == {"masked_tokens": 4, "masked_sequences": 0, "sequences": 3}
    # is_mask/token_fraction = masked / (kept + masked) = 4 / (7 + 4); sequence_fraction 0 / 3
    update = {"tokens": keep.sum().item(), **counts}
    assert common.is_mask_metrics(update) == pytest.approx(
        {"is_mask/token_fraction": 4 / 11, "is_mask/sequence_fraction": 0.0}
    )
    _, counts = grpo.masked_importance(batch, VALID, grpo.Args(is_mask="0.5,1.5", is_mask_level="sequence"))
    assert counts == {"masked_tokens": 4, "masked_sequences": 1, "sequences": 3}
    # Off: the loss mask is completion_mask itself and no is_mask/* key is logged.
    assert grpo.masked_importance(batch, VALID, grpo.Args()) == (VALID, {})
    assert common.is_mask_metrics({"tokens": 11}) == {}


# ----------------------------------------------------------------------------------------
# Masked tokens leave the loss and its normaliser


# Two completions, T = 3, r = 1 (on-policy), Â = [1, −0.5]; --is_mask dropped row 1's last token.
LOGP = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -1.0]])
VALID_2 = torch.tensor([[1, 1, 0], [1, 1, 1]])
KEPT = torch.tensor([[1, 1, 0], [1, 1, 0]])
ADVANTAGES = torch.tensor([1.0, -0.5])


def grpo_loss(loss_mask, loss_type="grpo", **options):
    logp = LOGP.clone().requires_grad_(True)
    args = grpo.Args(loss_type=loss_type, eps=0.2, beta=0.0, dual_clip=0.0, max_new_tokens=3, **options)
    loss, stats = grpo.grpo_loss(
        logp, logp.detach(), None, ADVANTAGES, loss_mask, args, num_sequences=2, num_tokens=int(loss_mask.sum())
    )
    loss.backward()
    return loss.item(), logp.grad.flatten().tolist(), stats


def test_masked_token_leaves_grpos_per_completion_mean():
    # GRPO's sample-level mean, N = 2: row 0 (1 + 1)/2 = 1; row 1 over its 2 kept tokens (−0.5 − 0.5)/2 = −0.5;
    #   J = (1 − 0.5)/2 = 0.25, loss −0.25.
    # d loss / d log π = −Â_i / (|o_i|·N) with |o_1| = 2 kept tokens, not 3:
    #   row 0 [−0.25, −0.25, 0]; row 1 [0.5/4, 0.5/4, 0] = [0.125, 0.125, 0]: the masked token gets none
    loss, grad, stats = grpo_loss(KEPT)
    assert loss == pytest.approx(-0.25)
    assert grad == pytest.approx([-0.25, -0.25, 0.0, 0.125, 0.125, 0.0])
    assert stats["tokens"] == 4  # the stats count the loss's tokens
    # Unmasked, row 1's tokens share 1/3 each: 0.5/6 = 0.083333
    _, grad, _ = grpo_loss(VALID_2)
    assert grad[3:] == pytest.approx([0.083333, 0.083333, 0.083333], abs=1e-6)


def test_masked_token_leaves_dapos_token_count():
    # Token-level: Σ Â over the 4 kept tokens = 1 + 1 − 0.5 − 0.5 = 1; J = 1/4, loss −0.25;
    # d loss / d log π = −Â/4: row 0 −0.25, row 1 +0.125, the masked token 0.
    # Unmasked: (2 − 1.5)/5 = 0.1, loss −0.1.
    for mask, expected in ((KEPT, -0.25), (VALID_2, -0.1)):
        logp = LOGP.clone().requires_grad_(True)
        loss, _ = dapo.dapo_loss(
            logp, logp.detach(), None, ADVANTAGES, mask, dapo.Args(eps_low=0.2, eps_high=0.28),
            num_tokens=int(mask.sum()),
        )  # fmt: skip
        loss.backward()
        assert loss.item() == pytest.approx(expected)
    dapo_grad = logp.grad.flatten().tolist()
    assert dapo_grad == pytest.approx([-0.2, -0.2, 0.0, 0.1, 0.1, 0.1])  # the unmasked one: −Â/5


# ----------------------------------------------------------------------------------------
# CISPO (grpo.py and dapo.py --loss_type cispo)


# Two completions of 4 tokens; ε_low^IS = 0.2, ε_high^IS = 0.28, so r̂ = clip(r, 0.8, 1.28):
#   row 0, Â = +1: r = [1.5, 1.1, 0.7, 1.0]  -> r̂ = [1.28, 1.1, 0.8, 1.0]
#   row 1, Â = −1: r = [0.7, 0.9, 1.5, 1.0]  -> r̂ = [0.8, 0.9, 1.28, 1.0]
# every side of both bounds, with either sign of Â.
CISPO_LOGP = torch.tensor([[-1.0, -2.0, -0.5, -1.0], [-0.5, -1.5, -2.0, -1.0]])
CISPO_RATIOS = torch.tensor([[1.5, 1.1, 0.7, 1.0], [0.7, 0.9, 1.5, 1.0]])
CISPO_ADV = torch.tensor([1.0, -1.0])


def cispo(script, mask, advantages=CISPO_ADV, loss_type="cispo"):
    logp = CISPO_LOGP.clone().requires_grad_(True)
    old = CISPO_LOGP - torch.log(CISPO_RATIOS)  # r = exp(log π_θ − log π_θold)
    cispo_eps = dict(cispo_eps_low=0.2, cispo_eps_high=0.28)  # ε_low^IS, ε_high^IS
    if script is grpo:  # GRPO's clip is symmetric: ε = 0.2
        args = grpo.Args(loss_type=loss_type, eps=0.2, beta=0.0, max_new_tokens=4, **cispo_eps)
        loss, stats = grpo.grpo_loss(
            logp, old, None, advantages, mask, args, num_sequences=2, num_tokens=int(mask.sum())
        )
    else:
        args = dapo.Args(loss_type=loss_type, eps_low=0.2, eps_high=0.28, **cispo_eps)
        loss, stats = dapo.dapo_loss(logp, old, None, advantages, mask, args, num_tokens=int(mask.sum()))
    loss.backward()
    return loss.item(), logp.grad.flatten().tolist(), stats


@pytest.mark.parametrize("script", [grpo, dapo])
def test_cispo_loss_by_hand(script):
    # Objective per token r̂·Â·log π_θ:
    #   row 0: 1.28·(−1) = −1.28, 1.1·(−2) = −2.2, 0.8·(−0.5) = −0.4, 1·(−1) = −1     sum −4.88
    #   row 1: −(0.8·(−0.5)) = 0.4, −(0.9·(−1.5)) = 1.35, −(1.28·(−2)) = 2.56, 1     sum  5.31
    #   token-level over the 8 tokens (MiniMax-M1 Eq. 4): J = 0.43/8 = 0.05375, loss −0.05375
    # d loss / d log π = −r̂·Â/8 (r̂ has no gradient): nonzero for every token, the clipped ones too:
    #   row 0 [−0.16, −0.1375, −0.1, −0.125];  row 1 [0.1, 0.1125, 0.16, 0.125]
    mask = torch.ones(2, 4, dtype=torch.long)
    loss, grad, stats = cispo(script, mask)
    assert loss == pytest.approx(-0.05375)
    assert grad == pytest.approx([-0.16, -0.1375, -0.1, -0.125, 0.1, 0.1125, 0.16, 0.125])
    # clip/low and clip/high count a clipped weight whatever the sign of Â: r = 0.7 twice, 1.5 twice
    assert (stats["clip_low"], stats["clip_high"], stats["tokens"]) == (2, 2, 8)


@pytest.mark.parametrize("script", [grpo, dapo])
def test_cispo_keeps_the_gradient_the_clipped_surrogate_drops(script):
    # The same ratios in PPO's clipped surrogate (ε_low 0.2, ε_high 0.28): r = 1.5 with Â > 0
    # (row 0, token 0) and r = 0.7 with Â < 0 (row 1, token 0) are clipped: gradient 0 there;
    # CISPO gives them −1.28/8 = −0.16 and 0.8/8 = 0.1 (test_cispo_loss_by_hand).
    mask = torch.ones(2, 4, dtype=torch.long)
    loss_type = "grpo" if script is grpo else "dapo"
    _, grad, _ = cispo(script, mask, loss_type=loss_type)
    assert grad[0] == 0 and grad[4] == 0
    _, grad, _ = cispo(script, mask)
    assert grad[0] == pytest.approx(-0.16) and grad[4] == pytest.approx(0.1)


@pytest.mark.parametrize("script", [grpo, dapo])
def test_cispo_masked_token_and_equal_group(script):
    # Row 0's first token masked (padding or --is_mask): the sum loses its −1.28 and the
    # normaliser a token: J = (0.43 + 1.28)/7 = 1.71/7 = 0.244286; d/d log π = −r̂·Â/7, 0 for it.
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    loss, grad, stats = cispo(script, mask)
    assert loss == pytest.approx(-1.71 / 7)
    assert grad == pytest.approx([0.0, -1.1 / 7, -0.8 / 7, -1 / 7, 0.8 / 7, 0.9 / 7, 1.28 / 7, 1 / 7])
    assert stats["tokens"] == 7
    # A group whose rewards are all equal has Â = 0: no loss, no gradient, whatever the ratios.
    loss, grad, _ = cispo(script, torch.ones(2, 4, dtype=torch.long), advantages=torch.zeros(2))
    assert loss == 0 and grad == [0.0] * 8


def test_cispo_on_policy_is_the_policy_gradient():
    # r = 1: r̂ = 1 whatever ε, so CISPO is Â·log π over the token count, GPG's form: with Â = [1.5, −1.5]
    # on test_techniques' LOGP rows (valid [−1, −2], [−0.5, −0.5, −1]) J = (−4.5 + 3)/5 = −0.3, loss 0.3.
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -1.0]], requires_grad=True)
    args = grpo.Args(loss_type="cispo", cispo_eps_low=1.0, cispo_eps_high=3.0, beta=0.0, max_new_tokens=3)
    loss, _ = grpo.grpo_loss(
        logp, logp.detach(), None, torch.tensor([1.5, -1.5]), VALID_2, args, num_sequences=2, num_tokens=5
    )
    assert loss.item() == pytest.approx(0.3)


# ----------------------------------------------------------------------------------------
# On a real batch: the normalisers count what stays, and gradient accumulation stays exact


def with_sampler(batch: dict, shifts: torch.Tensor) -> dict:
    """The batch with sample_logp = old_logp − shifts (n, T) on valid tokens: ratio k = e^shift."""
    return {**batch, "sample_logp": (batch["old_logp"] - shifts) * batch["completion_mask"]}


def masked_batch(sampled, level: str):
    """The sampled batch, a sampler that disagrees with π_θold: rows 0 and 5 by a factor e on
    every token (geometric mean e > β = 2: those rows leave at the sequence level), the rest
    by noise of std 0.5 per token (single tokens leave at the token level)."""
    model, tokenizer, batch = sampled
    generator = torch.Generator().manual_seed(1)
    shifts = 0.5 * torch.randn(batch["old_logp"].shape, generator=generator)
    if level == "sequence":
        shifts = 0.05 * shifts
    shifts[[0, 5]] = 1.0
    return model, tokenizer, with_sampler(batch, shifts)


def gradient(script, model, tokenizer, batch, **settings):
    args = script.Args(beta=0.04, max_new_tokens=12, num_iterations=2, **settings)  # μ = 2: recorded old_logp
    model.zero_grad(set_to_none=True)
    totals, _ = script.policy_backward(model, batch, args, len(tokenizer))
    return torch.cat([p.grad.flatten() for p in model.parameters()]), totals


CASES = [(grpo, "grpo"), (grpo, "dr_grpo"), (grpo, "gspo"), (grpo, "cispo"), (dapo, "dapo"), (dapo, "cispo")]


@pytest.mark.parametrize("script, loss_type", CASES, ids=[f"{s.__name__}-{t}" for s, t in CASES])
def test_sequence_mask_equals_dropping_the_completions(sampled, script, loss_type):
    # A completion masked whole leaves the loss and every normaliser (N of grpo and dr_grpo,
    # Σ|o_i| of the token-level losses): the gradient is that of the batch without it.
    model, tokenizer, batch = masked_batch(sampled, "sequence")
    settings = dict(loss_type=loss_type, is_mask="0.5,2", is_mask_level="sequence", micro_batch_size=5)
    masked, totals = gradient(script, model, tokenizer, batch, **settings)
    assert (totals["masked_sequences"], totals["sequences"]) == (2, 12)
    kept = torch.ones(12, dtype=torch.bool)
    kept[[0, 5]] = False
    without = {k: v[kept] for k, v in batch.items()}
    dropped, _ = gradient(script, model, tokenizer, without, loss_type=loss_type, micro_batch_size=5)
    unmasked, _ = gradient(script, model, tokenizer, batch, loss_type=loss_type, micro_batch_size=5)
    model.zero_grad(set_to_none=True)
    tolerance = batch["completion_mask"].sum().item() * FP32_EPS  # N·eps: the same terms in another order
    assert (masked - dropped).abs().max() <= tolerance * dropped.abs().max()
    assert (masked - unmasked).abs().max() > 100 * tolerance * unmasked.abs().max()


@pytest.mark.parametrize("script, loss_type", CASES, ids=[f"{s.__name__}-{t}" for s, t in CASES])
def test_token_mask_keeps_gradient_accumulation_exact(sampled, script, loss_type):
    # Every micro-batch divides by the whole mini-batch's kept counts, so 12 = 12, 4·3 and
    # 5 + 5 + 2 give one gradient, with some tokens masked in most rows.
    model, tokenizer, batch = masked_batch(sampled, "token")
    results = [
        gradient(script, model, tokenizer, batch, loss_type=loss_type, is_mask="0.5,2", micro_batch_size=m)
        for m in (12, 3, 5)
    ]
    (full, full_totals), rest = results[0], results[1:]
    model.zero_grad(set_to_none=True)
    assert 0 < full_totals["masked_tokens"] < batch["completion_mask"].sum()
    assert full.abs().max() > 0
    tolerance = batch["completion_mask"].sum().item() * FP32_EPS  # N·eps: the same terms in another order
    for grad, totals in rest:
        assert (grad - full).abs().max() <= tolerance * full.abs().max()
        assert totals["loss"] == pytest.approx(full_totals["loss"], rel=tolerance, abs=tolerance)
        assert totals["tokens"] == full_totals["tokens"]


def test_ppo_token_mask_keeps_gradient_accumulation_exact(sampled):
    # ppo.py's actor: per-token Â (here each row's, on its valid tokens), the mask's tokens out of
    # the token count of the whole mini-batch, before the micro-batches: 12 = 4·3 = 5 + 5 + 2.
    model, tokenizer, batch = masked_batch(sampled, "token")
    advantages = batch["advantages"][:, None] * batch["completion_mask"]  # (n, T)
    batch = {**batch, "advantages": advantages, "positive": torch.zeros(12, dtype=torch.bool)}
    results = []
    for micro_batch_size in (12, 3, 5):
        args = ppo.Args(is_mask="0.5,2", micro_batch_size=micro_batch_size, num_mini_batches=2)  # off-policy
        model.zero_grad(set_to_none=True)
        totals, _ = ppo.policy_backward(model, batch, args, len(tokenizer))
        results.append((torch.cat([p.grad.flatten() for p in model.parameters()]), totals))
    model.zero_grad(set_to_none=True)
    (full, full_totals), rest = results[0], results[1:]
    assert full_totals["tokens"] + full_totals["masked_tokens"] == batch["completion_mask"].sum()
    assert full.abs().max() > 0 and full_totals["masked_tokens"] > 0
    tolerance = batch["completion_mask"].sum().item() * FP32_EPS  # N·eps: the same terms in another order
    for grad, totals in rest:
        assert (grad - full).abs().max() <= tolerance * full.abs().max()
        assert totals["loss"] == pytest.approx(full_totals["loss"], rel=tolerance, abs=tolerance)


def test_every_token_masked_gives_no_gradient_and_no_nan(sampled):
    # A band no ratio falls in ([0, 1.0001] against ratios of e): loss 0, gradient 0, counts finite.
    model, tokenizer, batch = sampled
    batch = with_sampler(batch, torch.ones_like(batch["old_logp"]))
    grad, totals = gradient(grpo, model, tokenizer, batch, is_mask="0,1.0001", micro_batch_size=4)
    model.zero_grad(set_to_none=True)
    assert totals["tokens"] == 0 and totals["loss"] == 0 and grad.abs().max() == 0
    assert common.is_mask_metrics(totals) == {"is_mask/token_fraction": 1.0, "is_mask/sequence_fraction": 1.0}


# ----------------------------------------------------------------------------------------
# Through the scripts: fp32 on the CPU, the sampler and the trainer agree to ~1e-6


@pytest.mark.parametrize("script", [grpo, dapo, ppo])
def test_runs_log_the_masked_fractions(tmp_path, script):
    # A band of ±1e-7 around 1: on the CPU in fp32 the two passes differ by ~1e-7 in log π, so
    # a share of the tokens leaves, never all; IcePop's [0.5, 5] would mask none here.
    settings = dict(
        model="tiny", task="digit", lr=3e-3, max_new_tokens=4, batch_size=4, group_size=4, max_steps=2,
        save_every=0, output_dir=str(tmp_path), is_mask="0.9999999,1.0000001",
    )  # fmt: skip
    if script is dapo:
        settings |= dict(overlong_buffer=0, dynamic_sampling=False, loss_type="cispo")
    rows = read_jsonl(script.train(script.Args(**settings)) / "metrics.jsonl")
    assert_documented(rows)
    for row in rows:
        assert 0 < row["is_mask/token_fraction"] < 1
        assert row["is_mask/sequence_fraction"] < 1
        assert math.isfinite(row["loss/policy"])


def test_grpo_cispo_run_with_sequence_mask(tmp_path):
    # Two mini-batches, so θ moves between them and the second's ratios are not 1 (CISPO's
    # weight at work; T1's entropy bonus moves θ even where every reward is 0); the wide
    # sequence band [0.5, 2] masks nothing in fp32.
    run_dir = grpo.train(
        grpo.Args(
            model="tiny", task="digit", loss_type="cispo", is_mask="0.5,2", is_mask_level="sequence", lr=3e-3,
            entropy_coef=0.01,
            num_mini_batches=2, max_new_tokens=4, batch_size=4, group_size=4, max_steps=2, save_every=0,
            output_dir=str(tmp_path),
        )
    )  # fmt: skip
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert_documented(rows)
    assert [row["is_mask/sequence_fraction"] for row in rows] == [0.0, 0.0]
    assert rows[-1]["clip/ratio_max"] != 1.0


# ----------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "script, settings, message",
    [
        (grpo, dict(is_mask="0.5"), "--is_mask takes two numbers α,β, e.g. 0.5,5 (IcePop's), not '0.5'"),
        (dapo, dict(is_mask="a,b"), "--is_mask takes two numbers α,β"),
        (ppo, dict(is_mask="1.2,2"), "--is_mask α,β needs 0 <= α < 1 < β (got 1.2,2)"),
        (grpo, dict(is_mask="0.5,1"), "--is_mask α,β needs 0 <= α < 1 < β (got 0.5,1)"),
        (ppo, dict(is_mask_level="row"), "--is_mask_level 'row' is not one of: token, sequence."),
        (grpo, dict(loss_type="cispo", dual_clip=3.0), "--loss_type cispo clips the IS weight, not the objective"),
        (dapo, dict(loss_type="cispo", dual_clip=3.0), "--loss_type cispo clips the IS weight, not the objective"),
        (grpo, dict(loss_type="cispo", cispo_eps_low=-1.0), "--cispo_eps_low must be >= 0 (got -1.0)"),
        (grpo, dict(cispo_eps_high=0.0), "--cispo_eps_high must be > 0 (got 0.0)"),
        (dapo, dict(cispo_eps_high=0.0), "CISPO needs --cispo_eps_low >= 0 and --cispo_eps_high > 0"),
        (dapo, dict(loss_type="grpo"), "--loss_type 'grpo' is not one of: dapo, cispo, sapo, clip_cov, kl_cov, dppo."),
    ],
)
def test_bad_settings_stop_with_a_message(script, settings, message):
    with pytest.raises(SystemExit) as stop:
        script.check_args(script.Args(model="tiny", **settings))
    assert message in str(stop.value)
