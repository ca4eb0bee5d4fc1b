"""GPG, T1's entropy bonus and moving reference, VAPO's clip-higher and positive-example LM
loss, and truncated importance sampling: each against values computed by hand (derivations
inline), then through a short run of the script that has it."""

import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import dapo
import grpo
import ppo
from common import build_tiny_model, read_jsonl
from conftest import ROOT, crash_and_resume, trainer_state


def assert_documented(rows: list[dict]) -> None:
    """Every key the run logged has its row in docs/metrics.md."""
    documented = set(re.findall(r"^\| `([\w/]+)` \|", (ROOT / "docs" / "metrics.md").read_text(), flags=re.M))
    assert set().union(*rows) - documented == set(), "metrics missing from docs/metrics.md"


# ----------------------------------------------------------------------------------------
# GPG (grpo.py --loss_type gpg)


def test_gpg_advantages_by_hand():
    # Three groups of G = 2: R = [1, 0], [1, 1], [0, 0]. The last two have equal rewards: M = 4 of
    # the B = 6 completions carry no signal, so α = B / (B − M) = 6 / 2 = 3.
    # F_norm = 1: Â = α·(R − mean) = 3·(±0.5) = ±1.5 in group 1, 0 elsewhere (no std division).
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert grpo.gpg_advantages(rewards, group_size=2).tolist() == pytest.approx([1.5, -1.5, 0, 0, 0, 0])


def test_gpg_advantages_graded_rewards_and_no_signal():
    # G = 3: R = [1, 0.1, 0] (mean 0.366667) and [0.1, 0.1, 0.1] (no signal): α = 6/3 = 2.
    #   Â = 2·(0.633333, −0.266667, −0.366667) = 1.266667, −0.533333, −0.733333
    rewards = torch.tensor([1.0, 0.1, 0.0, 0.1, 0.1, 0.1])
    expected = [1.266667, -0.533333, -0.733333, 0, 0, 0]
    assert grpo.gpg_advantages(rewards, group_size=3).tolist() == pytest.approx(expected, abs=1e-6)
    # Every group without signal: α would be B/0; every Â is 0 whatever α, and nothing is NaN.
    assert grpo.gpg_advantages(torch.ones(4), group_size=2).tolist() == [0, 0, 0, 0]


# Two completions, T = 3; the first has 2 valid tokens. log π_θ per token:
#   row 0: [−1, −2, (masked)]      row 1: [−0.5, −0.5, −1]
LOGP = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -1.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def grpo_loss(logp, loss_type, advantages, **options):
    logp = logp.clone().requires_grad_(True)
    settings = dict(ref_logp=None, entropy=None, is_weight=None) | options
    tensors = {name: settings.pop(name) for name in ("ref_logp", "entropy", "is_weight")}
    args = grpo.Args(**(dict(loss_type=loss_type, eps=0.2, beta=0.0, max_new_tokens=3) | settings))
    loss, stats = grpo.grpo_loss(
        logp, logp.detach(), tensors["ref_logp"], advantages, MASK, args, num_sequences=2, num_tokens=int(MASK.sum()),
        entropy=tensors["entropy"], is_weight=tensors["is_weight"],
    )  # fmt: skip
    loss.backward()
    return loss.item(), logp.grad, stats


def test_gpg_loss_by_hand():
    # J = 1/Σ|o_i| · Σ_i Σ_t Â_i log π_θ(o_i,t), Â = [1.5, −1.5], Σ|o_i| = 5 valid tokens:
    #   row 0: 1.5·(−1 − 2) = −4.5;  row 1: −1.5·(−0.5 − 0.5 − 1) = 3;  J = −1.5/5 = −0.3; loss = 0.3
    # d loss / d log π = −Â_i / 5: row 0 −0.3, row 1 +0.3; the masked token 0.
    loss, grad, _ = grpo_loss(LOGP, "gpg", torch.tensor([1.5, -1.5]))
    assert loss == pytest.approx(0.3)
    assert grad.flatten().tolist() == pytest.approx([-0.3, -0.3, 0.0, 0.3, 0.3, 0.3])


# ----------------------------------------------------------------------------------------
# T1: entropy bonus and moving reference (grpo.py, dapo.py)


def test_entropy_bonus_by_hand():
    # Â = 0, β = 0: the loss is the entropy bonus alone, −c_H·H_t per token, with GRPO's
    # sample-level mean (1/|o_i| per completion, then / N = 2). c_H = 0.1, H:
    #   row 0: [1.0, 2.0, (masked)] -> mean 1.5;   row 1: [0.5, 0.5, 2.0] -> mean 1.0
    #   loss = −0.1·(1.5 + 1.0)/2 = −0.125
    # d loss / d H_t = −c_H / (|o_i|·N): row 0 −0.1/4 = −0.025, row 1 −0.1/6 = −0.016667
    entropy = torch.tensor([[1.0, 2.0, 7.0], [0.5, 0.5, 2.0]], requires_grad=True)
    loss, _, _ = grpo_loss(LOGP, "grpo", torch.zeros(2), entropy=entropy, entropy_coef=0.1)
    assert loss == pytest.approx(-0.125)
    assert entropy.grad.flatten().tolist() == pytest.approx(
        [-0.025, -0.025, 0.0, -0.016667, -0.016667, -0.016667], abs=1e-6
    )
    # DAPO's token-level mean: −0.1·(1 + 2 + 0.5 + 0.5 + 2)/5 = −0.12
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = dapo.dapo_loss(
        logp, logp.detach(), None, torch.zeros(2), MASK, dapo.Args(eps_low=0.2, eps_high=0.28, entropy_coef=0.1),
        num_tokens=5, entropy=entropy.detach(),
    )  # fmt: skip
    assert loss.item() == pytest.approx(-0.12)


@pytest.mark.parametrize("script", [grpo, dapo])
def test_ema_reference_by_hand(script):
    # θ_ref ← λ·θ_ref + (1 − λ)·θ with λ = 0.9: θ_ref = 1, θ = 3 -> 0.9 + 0.3 = 1.2; again -> 1.08 + 0.3 = 1.38.
    # λ = 0: the flag is off and the reference stays where it is.
    reference, policy = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    torch.nn.init.constant_(reference.weight, 1.0), torch.nn.init.constant_(policy.weight, 3.0)
    torch.nn.init.constant_(reference.bias, 0.0), torch.nn.init.constant_(policy.bias, -1.0)
    script.ema_update(reference, policy, 0.0)
    assert reference.weight.tolist() == [[1.0, 1.0]]
    script.ema_update(reference, policy, 0.9)
    assert reference.weight.flatten().tolist() == pytest.approx([1.2, 1.2])
    assert reference.bias.item() == pytest.approx(-0.1)  # 0.9·0 + 0.1·(−1)
    script.ema_update(reference, policy, 0.9)
    assert reference.weight.flatten().tolist() == pytest.approx([1.38, 1.38])
    assert policy.weight.flatten().tolist() == [3.0, 3.0]  # the policy is only read


# ----------------------------------------------------------------------------------------
# Truncated importance sampling (all three scripts)


@pytest.mark.parametrize("script", [grpo, dapo, ppo])
def test_tis_weights_by_hand(script):
    # w_t = min(π_θold / π_sampler, C), C = 1.5:
    #   π_θold 0.5, π_sampler 0.25 -> 2.0, capped to 1.5
    #   π_θold 0.2, π_sampler 0.4  -> 0.5
    #   π_θold = π_sampler         -> 1.0
    #   masked token (any values)  -> 1.0
    old = torch.log(torch.tensor([[0.5, 0.2, 0.3, 0.9]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.3, 1e-9]]))
    weights = script.tis_weights(old, sampler, torch.tensor([[1, 1, 1, 0]]), cap=1.5)
    assert weights.flatten().tolist() == pytest.approx([1.5, 0.5, 1.0, 1.0])
    assert not weights.requires_grad


def test_tis_weight_scales_the_policy_gradient_not_the_kl():
    # On-policy (r = 1), Â = [1, −1], weights w = [[1.5, 0.5, ·], [1, 1, 2]], GRPO sample-level mean:
    #   row 0 objective (1.5 + 0.5)·1 / 2 = 1;  row 1 (1 + 1 + 2)·(−1) / 3 = −4/3
    #   loss = −(1 − 4/3)/2 = 1/6 = 0.166667
    # d loss / d log π = −w·Â/(|o_i|·N): row 0 [−1.5/4, −0.5/4] = [−0.375, −0.125];
    #   row 1 [1/6, 1/6, 2/6] = [0.166667, 0.166667, 0.333333]
    weights = torch.tensor([[1.5, 0.5, 1.0], [1.0, 1.0, 2.0]])
    loss, grad, stats = grpo_loss(LOGP, "grpo", torch.tensor([1.0, -1.0]), is_weight=weights)
    assert loss == pytest.approx(1 / 6)
    assert grad.flatten().tolist() == pytest.approx([-0.375, -0.125, 0.0, 1 / 6, 1 / 6, 1 / 3])
    # stats: the sum and max over the 5 valid tokens: 1.5 + 0.5 + 1 + 1 + 2 = 6, max 2 (the masked 1.0 is not counted)
    assert (stats["tis_weight"], stats["tis_weight_max"]) == (6.0, 2.0)
    # The KL term is not weighted: with Â = 0 and β = 1 the loss is the k3 KL alone, w or not.
    ref = LOGP + 0.5
    plain, _, _ = grpo_loss(LOGP, "grpo", torch.zeros(2), beta=1.0, ref_logp=ref)
    weighted, _, _ = grpo_loss(LOGP, "grpo", torch.zeros(2), beta=1.0, ref_logp=ref, is_weight=weights)
    assert weighted == pytest.approx(plain)
    assert plain == pytest.approx(math.exp(0.5) - 0.5 - 1)  # k3 of a constant log-ratio 0.5, every token
    # Nor the entropy bonus: with Â = 0 the loss is −c_H·H (−0.125, test_entropy_bonus_by_hand), w or not.
    entropy = torch.tensor([[1.0, 2.0, 7.0], [0.5, 0.5, 2.0]])
    bonus, _, _ = grpo_loss(LOGP, "grpo", torch.zeros(2), entropy=entropy, entropy_coef=0.1, is_weight=weights)
    assert bonus == pytest.approx(-0.125)


def test_tis_weight_in_the_dapo_loss_by_hand():
    # Token-level mean over the 5 valid tokens, r = 1, Â = [1, −1], the weights above:
    #   Σ w·Â = (1.5 + 0.5)·1 + (1 + 1 + 2)·(−1) = −2;  J = −2/5 = −0.4; loss 0.4
    # d loss / d log π = −w·Â/5: row 0 [−0.3, −0.1], row 1 [0.2, 0.2, 0.4]
    logp = LOGP.clone().requires_grad_(True)
    weights = torch.tensor([[1.5, 0.5, 1.0], [1.0, 1.0, 2.0]])
    loss, stats = dapo.dapo_loss(
        logp, logp.detach(), None, torch.tensor([1.0, -1.0]), MASK, dapo.Args(eps_low=0.2, eps_high=0.28),
        num_tokens=5, is_weight=weights,
    )  # fmt: skip
    loss.backward()
    assert loss.item() == pytest.approx(0.4)
    assert logp.grad.flatten().tolist() == pytest.approx([-0.3, -0.1, 0.0, 0.2, 0.2, 0.4])
    assert (stats["tis_weight"], stats["tis_weight_max"]) == (6.0, 2.0)


# ----------------------------------------------------------------------------------------
# VAPO in ppo.py: clip-higher, the token-level loss, the positive-example LM loss


def ppo_surrogate(ratios, advantages, eps_low, eps_high, is_weight=None):
    logp = torch.log(ratios).clone().requires_grad_(True)
    mask = torch.ones_like(ratios, dtype=torch.long)
    args = ppo.Args(eps_low=eps_low, eps_high=eps_high)
    loss, stats = ppo.ppo_loss(
        logp, torch.zeros_like(logp), advantages, mask, args, num_tokens=mask.sum().item(), is_weight=is_weight
    )
    loss.backward()
    return loss.item(), logp.grad, stats


def test_clip_higher_by_hand():
    # One completion of 4 tokens, old log π = 0 so r = exp(log π); ε_low 0.2, ε_high 0.28:
    #   r = 1.25, Â = 1:  1.25 < 1.28, not clipped: 1.25          (symmetric ε 0.2 would clip it to 1.2)
    #   r = 1.3,  Â = 1:  clipped to 1.28
    #   r = 0.75, Â = −1: min(−0.75, −0.8) = −0.8, clipped low
    #   r = 0.9,  Â = −1: −0.9
    # Token-level mean: (1.25 + 1.28 − 0.8 − 0.9)/4 = 0.83/4 = 0.2075; loss −0.2075.
    # d loss / d log π = −Â·r/4 where unclipped: [−0.3125, 0, 0, 0.225]
    ratios, advantages = torch.tensor([[1.25, 1.3, 0.75, 0.9]]), torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, grad, stats = ppo_surrogate(ratios, advantages, 0.2, 0.28)
    assert loss == pytest.approx(-0.2075)
    assert grad.flatten().tolist() == pytest.approx([-0.3125, 0.0, 0.0, 0.225])
    assert (stats["clip_high"], stats["clip_low"]) == (1, 1)
    # Symmetric PPO (ε_high = ε_low = 0.2) clips the first token too: (1.2 + 1.2 − 0.8 − 0.9)/4 = 0.175
    symmetric, _, stats = ppo_surrogate(ratios, advantages, 0.2, 0.2)
    assert symmetric == pytest.approx(-0.175) and stats["clip_high"] == 2


def test_tis_weight_in_the_ppo_loss_by_hand():
    # r = 1 (on-policy), Â = [1, −2], w = [2, 0.5]: objective (2·1 + 0.5·(−2))/2 = 0.5; loss −0.5;
    # d loss / d log π = −w·Â/2 = [−1, 0.5]
    ratios, advantages = torch.ones(1, 2), torch.tensor([[1.0, -2.0]])
    loss, grad, stats = ppo_surrogate(ratios, advantages, 0.2, 0.2, is_weight=torch.tensor([[2.0, 0.5]]))
    assert loss == pytest.approx(-0.5)
    assert grad.flatten().tolist() == pytest.approx([-1.0, 0.5])
    assert (stats["tis_weight"], stats["tis_weight_max"]) == (2.5, 2.0)


def test_positive_lm_loss_by_hand():
    # Three completions; rows 0 and 2 correct (T), row 1 wrong; row 2 has one valid token.
    #   Σ_{o_i∈T} |o_i| = 2 + 1 = 3;  Σ log π over T = (−1 − 2) + (−0.5) = −3.5;  L_NLL = 3.5/3 = 1.166667
    # d L / d log π = −1/3 on the tokens of T, 0 on row 1 and on the masked token.
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -3.0], [-0.5, -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    positive = torch.tensor([True, False, True])
    loss = ppo.positive_lm_loss(logp, mask, positive, num_positive_tokens=3)
    loss.backward()
    assert loss.item() == pytest.approx(3.5 / 3)
    assert logp.grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, 0, 0, -1 / 3, 0])
    # No correct completion in the mini-batch: 0, not NaN.
    assert ppo.positive_lm_loss(logp, mask, torch.zeros(3, dtype=torch.bool), num_positive_tokens=0).item() == 0


# ----------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "script, settings, message",
    [
        (grpo, dict(loss_type="gpg"), "--loss_type gpg has no reference model and no ratio to clip: add --beta 0"),
        (grpo, dict(loss_type="gpg", beta=0.0, num_iterations=2), "--loss_type gpg is the on-policy gradient"),
        (grpo, dict(entropy_coef=-0.01), "--entropy_coef must be >= 0 (got -0.01)"),
        (dapo, dict(entropy_coef=-1.0), "--entropy_coef must be >= 0 (got -1.0)"),
        (grpo, dict(ref_ema_decay=1.0), "--ref_ema_decay must be in [0, 1) (got 1.0), e.g. 0.99"),
        (dapo, dict(ref_ema_decay=-0.5), "--ref_ema_decay must be in [0, 1) (got -0.5)"),
        (dapo, dict(ref_ema_decay=0.99), "--ref_ema_decay moves the reference of the KL term: it needs --beta > 0"),
        (grpo, dict(ref_ema_decay=0.99, lora_rank=4), "it needs --beta > 0 and --lora_rank 0"),
        (grpo, dict(ref_ema_decay=0.99, dtype="bfloat16"), "--ref_ema_decay needs fp32 weights"),
        (grpo, dict(loss_type="gpg", beta=0.0, num_mini_batches=2), "--loss_type gpg is the on-policy gradient"),
        (grpo, dict(loss_type="gpg", beta=0.0, dual_clip=3.0), "--loss_type gpg has no reference model and no ratio"),
        (grpo, dict(loss_type="gspo", tis_cap=2.0), "GSPO's ratio is one per sequence: use --tis_cap 0 with gspo"),
        (grpo, dict(tis_cap=0.5), "--tis_cap must be >= 1, or 0 to disable it (got 0.5)"),
        (dapo, dict(tis_cap=-2.0), "--tis_cap must be >= 1, or 0 to disable it (got -2.0)"),
        (ppo, dict(tis_cap=0.9), "--tis_cap must be >= 1, or 0 to disable it (got 0.9)"),
        (ppo, dict(pos_lm_coef=-0.1), "--pos_lm_coef must be >= 0 (got -0.1)"),
        (ppo, dict(eps_high=-0.1), "Clip ranges need 0 <= --eps_low < 1 and --eps_high >= 0"),
    ],
)
def test_bad_technique_settings_stop_with_a_message(script, settings, message):
    with pytest.raises(SystemExit) as stop:
        script.check_args(script.Args(model="tiny", **settings))
    assert message in str(stop.value)


# ----------------------------------------------------------------------------------------
# Through the scripts


def test_gpg_run_with_tis_and_entropy_bonus_logs_the_weights(tmp_path, monkeypatch):
    # fp32 on the CPU: generate and the update's forward pass agree to ~1e-6, so every weight is 1 to 1e-5.
    calls = []
    monkeypatch.setattr(grpo, "gpg_advantages", lambda *a, **_: calls.append(a) or grpo.group_advantages(*a))
    run_dir = grpo.train(
        grpo.Args(
            model="tiny", task="digit", loss_type="gpg", beta=0.0, tis_cap=2.0, entropy_coef=0.01, lr=3e-3,
            max_new_tokens=4, batch_size=4, group_size=4, max_steps=2, save_every=0, output_dir=str(tmp_path),
        )
    )  # fmt: skip
    assert len(calls) == 2  # step 5 took GPG's advantage, once a step
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    assert_documented(rows)
    for row in rows:
        assert row["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5)
        assert 1.0 <= row["tis/weight_max"] <= 1.0 + 1e-5
        assert math.isfinite(row["loss/policy"])


def test_moving_reference_is_saved_and_resumes_exactly(tmp_path, monkeypatch):
    # DAPO with β > 0, T1's moving reference (λ = 0.5, so it moves visibly in 3 steps), the
    # entropy bonus and truncated IS: run B crashes and resumes from step 2, and must end with
    # run A's policy and reference bit for bit. The reference lives in the trainer state.
    settings = dict(
        model="tiny", task="digit", beta=0.01, ref_ema_decay=0.5, entropy_coef=0.01, tis_cap=2.0, lr=3e-3,
        overlong_buffer=0, max_new_tokens=2, batch_size=8, group_size=4, max_steps=3,
    )  # fmt: skip
    straight, resumed = crash_and_resume(dapo, tmp_path, monkeypatch, **settings)
    a = trainer_state(straight / "final" / "trainer_state.pt")["reference"]
    b = trainer_state(resumed / "final" / "trainer_state.pt")["reference"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = AutoModelForCausalLM.from_pretrained(build_tiny_model()).state_dict()
    policy = AutoModelForCausalLM.from_pretrained(straight / "final").state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(a[name], start[name]) and not torch.equal(a[name], policy[name])  # between the two
    policy_b = AutoModelForCausalLM.from_pretrained(resumed / "final").state_dict()
    assert all(torch.equal(policy[k], policy_b[k]) for k in policy)


def test_vapo_recipe_runs_and_logs_its_terms(tmp_path):
    # VAPO's recipe in ppo.py on the digit task: clip-higher, the positive-example LM loss,
    # value pretraining, decoupled and length-adaptive GAE, truncated IS.
    run_dir = ppo.train(
        ppo.Args(
            model="tiny", task="digit", eps_high=0.28, pos_lm_coef=0.1, value_warmup_steps=1, lam_critic=1.0,
            length_adaptive_lam=True, tis_cap=2.0, lr=3e-3, critic_lr=3e-3, max_new_tokens=2, batch_size=16,
            group_size=4, max_steps=3, save_every=0, output_dir=str(tmp_path),
        )
    )  # fmt: skip
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert "loss/pos_nll" not in rows[0]
    assert_documented(rows)  # step 1 trains the critic alone
    for row in rows[1:]:
        # pos/token_fraction: the share of the batch's tokens in correct completions (a digit first)
        assert 0 <= row["pos/token_fraction"] <= 1
        assert (row["pos/token_fraction"] > 0) == (row["reward/accuracy"] > 0)
        assert row["loss/pos_nll"] >= 0 and row["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_resuming_without_the_saved_reference_stops_with_a_message(tmp_path):
    # A checkpoint saved before --ref_ema_decay existed (its args lack the key, so the
    # same-on-resume check cannot compare): resuming it with the flag names what is missing.
    settings = dict(model="tiny", task="digit", max_new_tokens=2, batch_size=2, group_size=2, output_dir=str(tmp_path))
    run_dir = grpo.train(grpo.Args(max_steps=1, **settings))
    state_file = run_dir / "final" / "trainer_state.pt"
    state = trainer_state(state_file)
    del state["args"]["ref_ema_decay"]
    torch.save(state, state_file)
    with pytest.raises(SystemExit, match="holds no saved reference: resume with the settings it was saved with"):
        grpo.train(grpo.Args(max_steps=2, ref_ema_decay=0.5, resume_from=str(run_dir / "final"), **settings))
