"""ppo.py: per-token rewards, GAE, whitening, explained variance and the losses against values
computed by hand (derivations inline); then the critic, gradient accumulation, value warm-up,
learning on the toy task, resuming, and the command line as a user runs it."""

import dataclasses
import functools
import math
import random
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_train import expected_digit_reward
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import ppo
from common import load_model, read_jsonl, resolve_model_name, save_checkpoint
from conftest import ROOT, crash_and_resume, trainer_state
from ppo import (
    CRITIC_DIR,
    VALUE_HEAD_FILE,
    Args,
    adaptive_lambda,
    critic_backward,
    critic_values,
    encode_prompts,
    explained_variance,
    gae,
    generate,
    load_critic,
    masked_whiten,
    policy_backward,
    ppo_loss,
    sequence_logprobs,
    token_rewards,
    train,
    value_loss,
)
from rewards import load_task

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7: the tolerances below are N·eps, N the tokens summed


def test_gae_2x4_by_hand():
    # γ = 0.9, λ = 0.5, so γλ = 0.45. Row 1 has 4 valid tokens; row 2 has 2, then padding
    # whose (garbage) rewards and values must be ignored: V = 0 after the last valid token.
    #   δ_t = r_t + γ V_{t+1} − V_t,  Â_t = δ_t + γλ Â_{t+1},  return_t = Â_t + V_t
    # Row 1: r = [0.1, 0, −0.2, 1.0], V = [0.5, 0.4, 0.6, 0.8]
    #   t=3: δ = 1.0 + 0 − 0.8 = 0.2                  Â = 0.2
    #   t=2: δ = −0.2 + 0.9·0.8 − 0.6 = −0.08          Â = −0.08 + 0.45·0.2 = 0.01
    #   t=1: δ = 0 + 0.9·0.6 − 0.4 = 0.14              Â = 0.14 + 0.45·0.01 = 0.1445
    #   t=0: δ = 0.1 + 0.9·0.4 − 0.5 = −0.04           Â = −0.04 + 0.45·0.1445 = 0.025025
    #   returns = [0.525025, 0.5445, 0.61, 1.0]
    # Row 2: r = [0, 0.5 | 9, 9], V = [0.2, 0.3 | 7, 7]
    #   t=1: δ = 0.5 + 0 − 0.3 = 0.2                   Â = 0.2
    #   t=0: δ = 0 + 0.9·0.3 − 0.2 = 0.07              Â = 0.07 + 0.45·0.2 = 0.16
    #   returns = [0.36, 0.5], padding 0
    rewards = torch.tensor([[0.1, 0.0, -0.2, 1.0], [0.0, 0.5, 9.0, 9.0]])
    values = torch.tensor([[0.5, 0.4, 0.6, 0.8], [0.2, 0.3, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert advantages.flatten().tolist() == pytest.approx([0.025025, 0.1445, 0.01, 0.2, 0.16, 0.2, 0, 0], abs=1e-6)
    assert returns.flatten().tolist() == pytest.approx([0.525025, 0.5445, 0.61, 1.0, 0.36, 0.5, 0, 0], abs=1e-6)
    # γ = λ = 1: Â_t = Σ_{l≥t} r_l − V_t and the return is the plain reward-to-go.
    #   row 1: [0.9, 0.8, 0.8, 1.0]; row 2: [0.5, 0.5]
    _, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert returns.flatten().tolist() == pytest.approx([0.9, 0.8, 0.8, 1.0, 0.5, 0.5, 0, 0], abs=1e-6)


def plain_gae(rewards, values, lengths, gamma, lams):
    """The textbook reverse loop, one sequence and one token at a time, in Python floats."""
    advantages = [[0.0] * len(row) for row in rewards]
    for i, length in enumerate(lengths):
        running = 0.0
        for t in reversed(range(length)):
            next_value = values[i][t + 1] if t + 1 < length else 0.0
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            running = delta + gamma * lams[i] * running
            advantages[i][t] = running
    return advantages


@pytest.mark.parametrize("per_sequence_lambda", [False, True])
def test_gae_matches_a_plain_reverse_loop(per_sequence_lambda):
    generator = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(6, 9, generator=generator), torch.randn(6, 9, generator=generator)
    lengths = [9, 1, 4, 7, 2, 9]
    mask = (torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]).long()
    gamma = 0.97
    lams = [random.Random(i).uniform(0.3, 1.0) for i in range(6)] if per_sequence_lambda else [0.8] * 6
    lam = torch.tensor(lams) if per_sequence_lambda else 0.8
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    expected = torch.tensor(plain_gae(rewards.tolist(), values.tolist(), lengths, gamma, lams))
    assert torch.allclose(advantages, expected, atol=1e-5)
    assert torch.allclose(returns, (expected + values) * mask, atol=1e-5)


def test_token_rewards_by_hand():
    # β = 0.1, r_t = −β·(old_logp − ref_logp) on valid tokens, + R at the last valid token.
    #   row A, ended by EOS after 2 tokens: k1 = [0.5, −1.0], R = 1.0
    #        -> [−0.05, 0.1 + 1.0 = 1.1, 0, 0]
    #   row B, truncated (no EOS within T = 4): k1 = [0.2, 0, 0.3, 0.1], R = 0.1; the reward
    #        goes on its last token -> [−0.02, 0, −0.03, −0.01 + 0.1 = 0.09]
    #   row C, EOS as its first token: k1 = [2.0], R = 0 -> [−0.2, 0, 0, 0]
    # Padding holds a large k1 (5.0) that must not leak in.
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    ref_logp = torch.full((3, 4), -2.0)
    k1 = torch.tensor([[0.5, -1.0, 5.0, 5.0], [0.2, 0.0, 0.3, 0.1], [2.0, 5.0, 5.0, 5.0]])
    rewards = torch.tensor([1.0, 0.1, 0.0])
    per_token = token_rewards(rewards, ref_logp + k1, ref_logp, mask, beta=0.1)
    expected = [-0.05, 1.1, 0, 0, -0.02, 0, -0.03, 0.09, -0.2, 0, 0, 0]
    assert per_token.flatten().tolist() == pytest.approx(expected, abs=1e-6)
    # β = 0 needs no reference: only R, at the same positions.
    per_token = token_rewards(rewards, ref_logp + k1, None, mask, beta=0.0)
    assert per_token.flatten().tolist() == pytest.approx([0, 1.0, 0, 0, 0, 0, 0, 0.1, 0, 0, 0, 0], abs=1e-7)


def test_length_adaptive_lambda_by_hand():
    # λ = 1 − 1/(α·|o|), α = 0.05: α·|o| = [0.5, 1, 2, 5, 50] for |o| = [10, 20, 40, 100, 1000]
    #   -> [1 − 2 = −1 clamped to 0, 0, 0.5, 0.8, 0.98]
    lambdas = adaptive_lambda(torch.tensor([10, 20, 40, 100, 1000]), alpha=0.05)
    assert lambdas.tolist() == pytest.approx([0.0, 0.0, 0.5, 0.8, 0.98], abs=1e-6)


def test_masked_whiten_by_hand():
    # Valid entries 1, 2, 3, 5 (two padded 99s ignored): mean 11/4 = 2.75,
    # deviations −1.75, −0.75, 0.25, 2.25, squares sum 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75,
    # population variance 8.75/4 = 2.1875, std 1.4790199
    #   -> −1.183216, −0.507093, 0.169031, 1.521278; padding 0
    x = torch.tensor([[1.0, 2.0, 3.0], [5.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    whitened = masked_whiten(x, mask, eps=1e-8)
    assert whitened.flatten().tolist() == pytest.approx([-1.183216, -0.507093, 0.169031, 1.521278, 0, 0], abs=1e-5)


def test_masked_whiten_floors_a_spread_of_noise():
    # Â of a saturated batch: every answer right, what is left ±0.01 (mean 0, population variance
    # 1e-4). The default ε = 0.0025 floors the std: sqrt(1e-4 + 0.0025) = sqrt(0.0026) = 0.0509902,
    # so ±0.01 -> ±0.196116 (about 5×), not ±1 as ε = 1e-8 gives (100×). A real spread is whitened
    # as before: ±1 -> ±1/sqrt(1 + 0.0025) = ±0.998752.
    mask = torch.ones(1, 2)
    assert Args.whiten_eps == 0.0025
    assert masked_whiten(torch.tensor([[0.01, -0.01]]), mask, Args.whiten_eps).flatten().tolist() == pytest.approx(
        [0.196116, -0.196116], abs=1e-6
    )
    assert masked_whiten(torch.tensor([[0.01, -0.01]]), mask, 1e-8).flatten().tolist() == pytest.approx(
        [1.0, -1.0], abs=1e-4
    )
    assert masked_whiten(torch.tensor([[1.0, -1.0]]), mask, Args.whiten_eps).flatten().tolist() == pytest.approx(
        [0.998752, -0.998752], abs=1e-6
    )


def test_the_readme_run_holds_its_reward(tmp_path):
    # The README's PPO command: with ε = 1e-8 the reward reached 1.00, then fell to 0.02 at step 33
    # (seeds 1 and 2: 0.09 at step 30, 0.29 at 24), as whitening stretched a saturated batch's noise
    # to the size of a right answer. With the floor it stays ≥ 0.9 from the step it first gets
    # there to step 40 (docs/learning.md: seed 0 from step 16, min 0.93).
    args = Args(model="tiny", task="digit", lr=3e-3, critic_lr=3e-3, max_new_tokens=8, max_steps=40)
    run_dir = train(dataclasses.replace(args, output_dir=str(tmp_path), save_every=0))
    rewards = [row["reward/mean"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    first = next(step for step, reward in enumerate(rewards) if reward >= 0.9)
    assert min(rewards[first:]) >= 0.9, rewards


def test_explained_variance_by_hand():
    # Valid returns [1, 2, 3, 4]: mean 2.5, population variance (2.25 + 0.25 + 0.25 + 2.25)/4 = 1.25.
    # Values [1, 2, 3, 5]: errors R − V = [0, 0, 0, −1], mean −0.25,
    #   variance (3 · 0.0625 + 0.5625)/4 = 0.1875  ->  EV = 1 − 0.1875/1.25 = 0.85
    # A padded position with a huge error must be ignored.
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    returns = torch.tensor([[1.0, 2.0, 50.0], [3.0, 4.0, 50.0]])
    assert explained_variance(torch.tensor([[1.0, 2.0, -9.0], [3.0, 5.0, -9.0]]), returns, mask) == pytest.approx(0.85)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)  # a perfect critic
    assert explained_variance(torch.full_like(returns, 7.0), returns, mask) == pytest.approx(0.0)  # a constant one
    # Returns that do not vary: nothing to explain, 0 (not NaN, which breaks plots), whatever V is.
    assert explained_variance(returns, torch.ones_like(returns), mask) == 0.0
    assert explained_variance(torch.zeros_like(returns), torch.ones_like(returns), mask) == 0.0


# Two sequences, T = 3, the second with 2 valid tokens; old_logp = 0, so r = exp(logp).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [0.7, 1.1, 3.0]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -2.0], [-1.0, 0.5, 7.0]])


def surrogate(ratios, advantages, mask, num_tokens, eps=0.2, dual_clip=0.0, entropy=None, entropy_coef=0.0):
    logp = torch.log(ratios).clone().requires_grad_(True)
    args = Args(eps_low=eps, eps_high=eps, dual_clip=dual_clip, entropy_coef=entropy_coef)
    loss, stats = ppo_loss(logp, torch.zeros_like(logp), advantages, mask, args, num_tokens=num_tokens, entropy=entropy)
    loss.backward()
    return loss.item(), logp.grad, stats


def test_clipped_surrogate_by_hand():
    # Per-token objective min(r·Â, clip(r, 0.8, 1.2)·Â):
    #   (0,0) r=1,   Â=1:   1
    #   (0,1) r=1.5, Â=1:   min(1.5, 1.2) = 1.2          clipped (high side)
    #   (0,2) r=0.5, Â=−2:  min(−1.0, −1.6) = −1.6       clipped (low side)
    #   (1,0) r=0.7, Â=−1:  min(−0.7, −0.8) = −0.8       clipped (low side)
    #   (1,1) r=1.1, Â=0.5: 0.55 both ways
    #   (1,2) masked
    # Token mean over the 5 valid tokens: (1 + 1.2 − 1.6 − 0.8 + 0.55)/5 = 0.35/5 = 0.07; loss −0.07.
    # d loss / d logp = −Â·r/5 on unclipped tokens, 0 on clipped ones (d r / d logp = r):
    #   (0,0): −0.2;  (1,1): −0.5·1.1/5 = −0.11
    loss, grad, stats = surrogate(RATIOS, ADVANTAGES, MASK, num_tokens=5)
    assert loss == pytest.approx(-0.07, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-0.2, 0, 0], [0, -0.11, 0]]), atol=1e-6)
    assert (stats["clip_high"], stats["clip_low"], stats["tokens"]) == (1, 2, 5)
    # Micro-batches normalised by the whole mini-batch's 5 tokens add up to the same loss:
    #   row 0: −(1 + 1.2 − 1.6)/5 = −0.12;  row 1: −(−0.8 + 0.55)/5 = +0.05;  sum −0.07
    first, _, _ = surrogate(RATIOS[:1], ADVANTAGES[:1], MASK[:1], num_tokens=5)
    second, _, _ = surrogate(RATIOS[1:], ADVANTAGES[1:], MASK[1:], num_tokens=5)
    assert (first, second) == (pytest.approx(-0.12, abs=1e-6), pytest.approx(0.05, abs=1e-6))


def test_dual_clip_and_entropy_bonus_by_hand():
    # Dual-clip, c = 3: two tokens with Â = −1, ratios [5, 2]:
    #   plain: min(−5, −1.2) = −5, min(−2, −1.2) = −2 -> loss 3.5
    #   dual:  max(−5, −3) = −3, −2 unchanged        -> loss 2.5; gradient: token 0 bounded -> 0,
    #          token 1: −Â·r/2 = 1
    ratios, advantages, mask = torch.tensor([[5.0, 2.0]]), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2)
    plain, _, _ = surrogate(ratios, advantages, mask, num_tokens=2)
    dual, grad, stats = surrogate(ratios, advantages, mask, num_tokens=2, dual_clip=3.0)
    assert (plain, dual) == (pytest.approx(3.5, abs=1e-5), pytest.approx(2.5, abs=1e-5))
    assert torch.allclose(grad, torch.tensor([[0.0, 1.0]]), atol=1e-5) and stats["clip_dual"] == 1
    # Entropy bonus c_2 = 0.1 with Â = 0, r = 1: loss = −0.1 · (0.5 + 1.5)/2 = −0.1, and
    # d loss / d H_t = −0.1/2 = −0.05 per token.
    entropy = torch.tensor([[0.5, 1.5]], requires_grad=True)
    loss, _, _ = surrogate(torch.ones(1, 2), torch.zeros(1, 2), mask, 2, entropy=entropy, entropy_coef=0.1)
    assert loss == pytest.approx(-0.1, abs=1e-6)
    assert torch.allclose(entropy.grad, torch.tensor([[-0.05, -0.05]]))


def test_the_value_loss_counts_the_models_tokens_not_the_tools_answers():
    # A mini-batch as a rollout with a tool turn lays it out (Rollout.tensors()): row 0 the model's
    # tokens at columns 0, 1, 4, 5 and a tool's answer at 2, 3 (tool_mask: attended to, never
    # trained); row 1 the model's tokens at 0-2, no answer. critic_backward's loss is
    # Σ_model tokens ½·max(...) / 7, the 4 + 3 tokens of the model, not / 9 with the answer's 2 counted
    # (nor do the answer's positions add a term: old_values and returns are 0 there, and so is the
    # mask). The values are the critic's own, read with the answer in the sequence (critic_values).
    torch.manual_seed(0)
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    critic = load_critic(ppo.Args(model="tiny"), torch.device("cpu"), torch.float32)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [[{"role": "user", "content": "Say a digit."}]], 2, "cpu")
    completion_mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]])
    tool_mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    completion_ids = torch.randint(3, 300, (2, 6)) * (completion_mask + tool_mask)
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "old_values": 0.3 * torch.randn(2, 6) * completion_mask,
        "returns": torch.randn(2, 6) * completion_mask,
    }
    totals = critic_backward(critic, batch, ppo.Args(model="tiny", micro_batch_size=1))  # a row a micro-batch
    with torch.no_grad():
        values = critic_values(critic, prompt_ids, prompt_mask, completion_ids, completion_mask, 2, tool_mask=tool_mask)
    args = (values, batch["old_values"], batch["returns"], completion_mask, 0.2)
    by_model_tokens, _ = value_loss(*args, num_tokens=7)
    with_answers, _ = value_loss(*args, num_tokens=9)
    assert totals["loss"] == pytest.approx(by_model_tokens.item(), rel=1e-5)
    assert abs(by_model_tokens.item() - with_answers.item()) > 1e-3  # the two normalisers tell apart


def test_clipped_value_loss_by_hand():
    # ½·max((V − R)², (clip(V, V_old ± 0.2) − R)²), mean over the 3 valid tokens:
    #   t0: V=0.5, V_old=0.4, R=1: V within the clip range, both errors 0.25     -> 0.125
    #   t1: V=1.0, V_old=0.5, R=0: clipped V = 0.7; errors 1.0 vs 0.49, max 1.0  -> 0.5
    #   t2: V=1.0, V_old=0.5, R=2: clipped V = 0.7; errors 1.0 vs 1.69, max 1.69 -> 0.845 (clipped)
    #   t3: masked (V=9, V_old=0, R=−9)
    #   loss = (0.125 + 0.5 + 0.845)/3 = 0.49
    # d loss / d V = (V − R)/3 where the unclipped error wins: t0: −0.5/3, t1: 1/3;
    # t2: the clipped V does not depend on V -> 0.
    values = torch.tensor([[0.5, 1.0, 1.0, 9.0]], requires_grad=True)
    old_values, returns = torch.tensor([[0.4, 0.5, 0.5, 0.0]]), torch.tensor([[1.0, 0.0, 2.0, -9.0]])
    loss, stats = value_loss(values, old_values, returns, torch.tensor([[1, 1, 1, 0]]), eps_value=0.2, num_tokens=3)
    loss.backward()
    assert loss.item() == pytest.approx(0.49, abs=1e-6)
    assert torch.allclose(values.grad, torch.tensor([[-0.5 / 3, 1 / 3, 0.0, 0.0]]), atol=1e-6)
    assert (stats["value_clipped"], stats["tokens"]) == (1, 3)


# ----------------------------------------------------------------------------------------
# The critic and the update, on a real batch of the tiny model


@pytest.fixture(scope="module")
def sampled():
    """A real batch from the tiny model: 3 prompts × 4 completions of unequal lengths, with a
    critic whose head is random (a zero head would send no gradient into its backbone)."""
    torch.manual_seed(0)
    model, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    task = load_task("countdown", seed=0, num_problems=3)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [task.messages(p) for p in task.problems], 4, "cpu")
    ids, mask, _, _, _ = generate(model, prompt_ids, prompt_mask, 12, eos_ids, tokenizer.pad_token_id, len(tokenizer))
    critic = load_critic(Args(model="tiny"), torch.device("cpu"), torch.float32)
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, len(tokenizer), 4)
        values = critic_values(critic, prompt_ids, prompt_mask, ids, mask, 4)
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": ids,
        "completion_mask": mask,
        # old log-probs and values away from the current ones, so that ratios ≠ 1 and some
        # tokens and values are clipped
        "old_logp": (logp + 0.3 * torch.randn_like(logp)) * mask,
        "advantages": torch.randn(ids.shape) * mask,
        "old_values": (values + 0.3 * torch.randn_like(values)) * mask,
        "returns": torch.randn(ids.shape) * mask,
    }
    return model, critic, tokenizer, batch


def test_values_use_the_positions_of_sequence_logprobs(sampled):
    # V(s_t) is read where log π(o_t) is: at the state before token t, whatever the left
    # padding. So each row scored alone, unpadded, gives the same values; and changing token t
    # leaves V(s_t) alone but changes V(s_{t+1}).
    _, critic, _, batch = sampled
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    assert prompt_mask.sum(-1).unique().numel() > 1, "want prompts of unequal length (left padding)"
    with torch.no_grad():
        values = critic_values(critic, prompt_ids, prompt_mask, ids, mask, chunk_size=5)
        for i in range(ids.shape[0]):
            prompt, length = prompt_ids[i][prompt_mask[i].bool()][None], mask[i].sum().item()
            alone = critic_values(
                critic, prompt, torch.ones_like(prompt), ids[i : i + 1, :length], mask[i : i + 1, :length], 1
            )
            assert torch.allclose(alone[0], values[i, :length], atol=1e-5)
        changed = ids.clone()
        changed[:, 0] = (changed[:, 0] + 1) % 300
        moved = critic_values(critic, prompt_ids, prompt_mask, changed, mask, chunk_size=5)
    assert torch.equal(moved[:, 0], values[:, 0])
    assert (moved[:, 1] - values[:, 1]).abs().max() > 1e-4
    assert values[mask == 0].abs().sum() == 0


def test_gradient_accumulation_equals_one_big_batch(sampled):
    # Σ over micro-batches of losses normalised by the whole mini-batch's token count = the
    # mini-batch loss, so the accumulated gradients of actor and critic must equal the
    # one-batch gradients, for any split (12 = 12, 4·3, and 5 + 5 + 2, uneven).
    model, critic, tokenizer, batch = sampled
    assert batch["completion_mask"].sum(-1).unique().numel() > 1, "want completions of unequal length"
    results = []
    for micro_batch_size in (12, 3, 5):
        # ppo_epochs=2: the off-policy path, which uses the recorded old_logp; an entropy bonus too
        args = Args(micro_batch_size=micro_batch_size, ppo_epochs=2, entropy_coef=0.01)
        model.zero_grad(set_to_none=True), critic.zero_grad(set_to_none=True)
        policy_totals, _ = policy_backward(model, batch, args, len(tokenizer))
        critic_totals = critic_backward(critic, batch, args)
        gradients = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (model, critic)]
        results.append((gradients, policy_totals, critic_totals))
    (policy_gradient, critic_gradient), policy_totals, critic_totals = results[0]
    assert policy_gradient.abs().max() > 0 and critic_gradient[:-97].abs().max() > 0  # backbone too, not just the head
    assert policy_totals["clip_low"] + policy_totals["clip_high"] > 0 and critic_totals["value_clipped"] > 0
    tolerance = batch["completion_mask"].sum().item() * FP32_EPS  # N·eps: the same terms in another order
    for (policy_g, critic_g), policy_t, critic_t in results[1:]:
        assert (policy_g - policy_gradient).abs().max() <= tolerance * policy_gradient.abs().max()
        assert (critic_g - critic_gradient).abs().max() <= tolerance * critic_gradient.abs().max()
        assert policy_t["loss"] == pytest.approx(policy_totals["loss"], rel=tolerance, abs=tolerance)
        assert critic_t["loss"] == pytest.approx(critic_totals["loss"], rel=tolerance, abs=tolerance)
    model.zero_grad(set_to_none=True), critic.zero_grad(set_to_none=True)


def weights(state: dict) -> torch.Tensor:
    return torch.cat([v.flatten().float() for v in state.values()])


def test_value_warmup_trains_only_the_critic(tmp_path):
    # --value_warmup_steps 2: steps 1 and 2 move the critic, never the policy; step 3 moves both.
    # The policy at step-000002 must equal the tiny model bit for bit.
    # --warmup_steps 1 (learning-rate warm-up) counts the steps each network trains: the rate of
    # a network's k-th step is lr · min(1, k / 2). The critic trains at steps 1, 2, 3: 1.5e-3,
    # 3e-3, 3e-3. The actor first trains at step 3, its 1st step: 1.5e-3 (3e-3 if its scheduler
    # had also stepped during the value warm-up).
    start, _, _ = load_model("tiny", torch.device("cpu"))
    args = Args(
        model="tiny", task="digit", lr=3e-3, critic_lr=3e-3, max_new_tokens=4, batch_size=4, group_size=4,
        max_steps=3, value_warmup_steps=2, warmup_steps=1, save_every=1, output_dir=str(tmp_path),
    )  # fmt: skip
    run_dir = train(args)
    warmed = AutoModelForCausalLM.from_pretrained(run_dir / "step-000002").state_dict()
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()
    assert all(torch.equal(warmed[k], v) for k, v in start.state_dict().items())
    assert not all(torch.equal(final[k], v) for k, v in start.state_dict().items())
    head = load_file(run_dir / "final" / CRITIC_DIR / VALUE_HEAD_FILE)  # the newest checkpoint alone keeps it
    assert head["weight"].abs().max() > 0  # it started at zero: the critic did learn
    assert not (run_dir / "step-000002" / CRITIC_DIR).exists()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert ["loss/policy" in r for r in rows] == [False, False, True]
    assert all("loss/value" in r for r in rows)
    assert [r["optim/critic_lr"] for r in rows] == pytest.approx([1.5e-3, 3e-3, 3e-3])
    assert rows[2]["optim/lr"] == pytest.approx(1.5e-3)


def test_train_wires_gae_whitening_and_adaptive_lambda(tmp_path, monkeypatch):
    # One step with --length_adaptive_lam (α = 1, so λ_actor = 1 − 1/|o|: 0 for 1 token, 0.5
    # for 2; --lam_actor 0.9 must be ignored) and --lam_critic 1. train() must call gae twice on
    # the same rewards and values, first with the per-completion λ_actor, then with λ_critic = 1;
    # whiten the first call's advantages; and hand exactly those whitened advantages and the
    # second call's returns to the actor and the critic. 32 completions of ≤ 2 tokens of the random
    # tiny model, which all earn 0 and whose KL penalty is 0 at the first step: every token gets
    # 0.1 more reward here, so that the advantages are not all 0.
    calls, seen = [], {}
    real_gae, real_policy_backward, real_critic_backward = ppo.gae, ppo.policy_backward, ppo.critic_backward

    def recording_gae(rewards, values, mask, gamma, lam):
        rewards = rewards + 0.1 * mask
        calls.append({"mask": mask, "lam": lam, "out": real_gae(rewards, values, mask, gamma, lam)})
        return calls[-1]["out"]

    def recording_policy_backward(policy, batch, *rest, **options):
        seen["advantages"] = batch["advantages"]
        return real_policy_backward(policy, batch, *rest, **options)

    def recording_critic_backward(critic, batch, *rest, **options):
        seen["returns"] = batch["returns"]
        return real_critic_backward(critic, batch, *rest, **options)

    monkeypatch.setattr(ppo, "gae", recording_gae)
    monkeypatch.setattr(ppo, "policy_backward", recording_policy_backward)
    monkeypatch.setattr(ppo, "critic_backward", recording_critic_backward)
    train(
        Args(model="tiny", task="digit", max_new_tokens=2, batch_size=8, group_size=4, max_steps=1,
             num_mini_batches=1, length_adaptive_lam=True, lam_alpha=1.0, lam_actor=0.9, lam_critic=1.0,
             save_every=0, output_dir=str(tmp_path))
    )  # fmt: skip
    assert len(calls) == 2
    lengths = calls[0]["mask"].sum(-1).float()
    assert calls[0]["lam"].tolist() == pytest.approx((1 - 1 / lengths).tolist())  # a tensor, not 0.9
    assert calls[1]["lam"] == 1.0
    mask = calls[0]["mask"]
    whitened = masked_whiten(calls[0]["out"][0], mask, Args.whiten_eps)
    # One mini-batch in a shuffled order: compare as multisets of rows.
    assert sorted(map(tuple, seen["advantages"].tolist())) == sorted(map(tuple, whitened.tolist()))
    assert sorted(map(tuple, seen["returns"].tolist())) == sorted(map(tuple, calls[1]["out"][1].tolist()))
    assert calls[0]["out"][0].abs().max() > 0  # the comparison above is not one of zeros


def test_without_whitening_the_actor_gets_gae_advantages_as_they_are(tmp_path, monkeypatch):
    # --whiten_advantages false: the advantages policy_backward receives are the first gae call's
    # (λ_actor), unchanged: in reward units, so a batch whose returns hardly vary pushes little.
    calls, seen = [], {}
    real_gae, real_policy_backward = ppo.gae, ppo.policy_backward

    def recording_gae(rewards, values, mask, gamma, lam):
        rewards = rewards + 0.1 * mask  # as above: not all 0
        calls.append((real_gae(rewards, values, mask, gamma, lam), mask))
        return calls[-1][0]

    def recording_policy_backward(policy, batch, *rest, **options):
        seen["advantages"] = batch["advantages"]
        return real_policy_backward(policy, batch, *rest, **options)

    monkeypatch.setattr(ppo, "gae", recording_gae)
    monkeypatch.setattr(ppo, "policy_backward", recording_policy_backward)
    train(
        Args(model="tiny", task="digit", max_new_tokens=2, batch_size=8, group_size=4, max_steps=1,
             num_mini_batches=1, whiten_advantages=False, save_every=0, output_dir=str(tmp_path))
    )  # fmt: skip
    (raw, _), mask = calls[0]  # (N, T) each
    # One mini-batch in a shuffled order: compare as multisets of rows.
    assert sorted(map(tuple, seen["advantages"].tolist())) == sorted(map(tuple, raw.tolist()))
    assert raw.abs().max() > 0  # not a comparison of zeros
    assert not torch.allclose(raw, masked_whiten(raw, mask, Args.whiten_eps))  # whitened, they would differ


def test_value_head_stays_fp32_when_the_backbone_is_bf16():
    # --dtype bfloat16 stores the backbone in bf16; the head must stay fp32: bf16 would store
    # 0.99 as 0.98828125 and round a 1e-5-sized update of it away.
    critic = load_critic(Args(model="tiny"), torch.device("cpu"), torch.bfloat16)
    assert next(critic.backbone.parameters()).dtype == torch.bfloat16
    assert critic.value_head.weight.dtype == critic.value_head.bias.dtype == torch.float32
    ids = torch.tensor([[5, 6, 7]])
    values = critic(ids[:, :1], torch.ones_like(ids[:, :1]), ids[:, 1:], torch.ones_like(ids[:, 1:]))
    assert values.dtype == torch.float32 and values.shape == (1, 2)


def test_a_crash_while_saving_the_critic_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    # Save "final" once; save it again with a critic whose save raises halfway. The first save
    # must still be there, policy and critic/, and no second policy without a critic.
    policy, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    critic = load_critic(Args(model="tiny"), torch.device("cpu"), torch.float32)
    write_critic = functools.partial(ppo.save_critic, critic)
    save_checkpoint(tmp_path / "final", policy, tokenizer, {"step": 1}, extra=write_critic)

    def broken_save(*args, **kwargs):
        raise KeyboardInterrupt("simulated crash while writing the critic")

    monkeypatch.setattr(critic.backbone, "save_pretrained", broken_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "final", policy, tokenizer, {"step": 2}, extra=write_critic)
    assert (tmp_path / "final" / CRITIC_DIR / VALUE_HEAD_FILE).exists()
    assert trainer_state(tmp_path / "final" / "trainer_state.pt")["step"] == 1


# The learning run: PPO's actor at GRPO's toy learning rate; the critic learns faster (lr 1e-2,
# two epochs over each rollout) with Monte-Carlo targets (λ_critic = 1, VAPO's decoupled GAE).
# Sampling is chaotic: a last-bit difference between CPUs' kernels (AVX-512 here, AVX2
# elsewhere) flips a sampled token and the trajectory parts, so the test asserts only margins
# that every measured run clears. Measured with OMP_NUM_THREADS=1 for seeds 0-4, each under
# ATEN_CPU_CAPABILITY=avx512 (this CPU's own), avx2 and default (15 runs; each seed's runs part
# by step 6-10; 2 threads, MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 changed no
# sampled token), train(Args(**LEARN, seed=s)), the numbers the test asserts:
#   exact expected reward after step 15            min 0.970, median 0.988 (start 0.025)
#   sampled reward/mean, mean over steps 11-15     min 0.897, median 0.945
#   |value/mean − return/mean|, mean over 11-15    max 0.192, median 0.105
# 15 steps, not more: from step ~12 the reward is ≈ 1, every return is ≈ 1 and the whitened
# advantages are mostly noise; there the policy drifts and at times collapses (the same runs
# taken to 25 steps: in 6 of 15 the sampled reward fell from ≈ 1 to 0.35 or less at some step
# from step 18 on, and 4 of 15 ended below the bars). Explained variance is not asserted past
# step 1: the critic learns the mean return well before it separates good completions from
# bad, so over steps 6-15 the explained variance, pooled with weights Var(R), measured −0.003
# to 0.144 (seed-dependent); in the saturated tail it swings between −1.6 and 0.6 on a single
# sampled token (the last 5 of 25 steps averaged −0.39 under avx2 for seed 0: the failing
# report). To see the test on another kernel set:
#   ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 python -m pytest tests/test_ppo.py -k learns
LEARN = dict(
    model="tiny", task="digit", lr=3e-3, critic_lr=1e-2, ppo_epochs=2, lam_critic=1.0,
    max_new_tokens=4, batch_size=16, max_steps=15,
)  # fmt: skip
REWARD_BAR = 0.6  # the exact and the sampled reward: measured ≥ 0.897; the start is 0.025
VALUE_GAP_BAR = 0.4  # |value/mean − return/mean| over the last 5 steps: measured ≤ 0.192


def test_ppo_learns_the_digit_task(tmp_path):
    # The random tiny model starts near 10/384 ≈ 0.026 expected reward (the exact value from one
    # forward pass, see test_train.expected_digit_reward). The 15 steps of LEARN must lift it
    # above 0.6, and the sampled rewards of the last 5 steps must agree. The critic, whose head
    # starts at zero (values and explained variance exactly 0 at step 1), must follow the mean
    # return: within 0.4 of it over the last 5 steps. A critic that does not learn keeps
    # value/mean at 0, so its gap is the mean return itself, > 0.6 by the assertion before it
    # (measured with critic_lr=1e-12, seed 0: value/mean ≤ 6e-9, gap 0.90, while the actor
    # learned as well as ever: the actor's numbers alone do not show a working critic).
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    start = expected_digit_reward(model, tokenizer)
    assert start < 0.1
    run_dir = train(Args(**LEARN, output_dir=str(tmp_path), save_every=0))
    end = expected_digit_reward(AutoModelForCausalLM.from_pretrained(run_dir / "final"), tokenizer)
    assert end > REWARD_BAR, (start, end)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[0]["value/explained_variance"] == 0.0 and rows[0]["value/mean"] == 0.0
    last = rows[-5:]
    assert sum(r["reward/mean"] for r in last) / 5 > REWARD_BAR  # the sampled rewards agree
    assert sum(r["return/mean"] for r in last) / 5 > REWARD_BAR
    gap = sum(abs(r["value/mean"] - r["return/mean"]) for r in last) / 5
    assert gap < VALUE_GAP_BAR, [(r["value/mean"], r["return/mean"]) for r in rows]


def test_resume_after_a_crash_continues_exactly(tmp_path, monkeypatch):
    # conftest.crash_and_resume: run A goes through 3 steps; run B crashes writing its final
    # checkpoint and resumes from step-000002. B must end with A's policy AND critic bit for bit: both optimizers, schedulers, RNG and the prompt order come back.
    # 32 completions a step; a step without a digit has probability ~0.45, but over 3 steps the
    # actor and the critic move (measured, seeds 0-9 (Args.seed): policy moved and value head
    # non-zero in every run, 5 of them with a step of reward 0 among steps 1-2).
    common = dict(
        model="tiny", task="digit", lr=3e-3, critic_lr=3e-3, max_new_tokens=2, batch_size=8, group_size=4, max_steps=3
    )
    straight, resumed = crash_and_resume(ppo, tmp_path, monkeypatch, **common)
    for load in (
        lambda d: AutoModelForCausalLM.from_pretrained(d / "final").state_dict(),
        lambda d: AutoModel.from_pretrained(d / "final" / CRITIC_DIR).state_dict(),
        lambda d: load_file(d / "final" / CRITIC_DIR / VALUE_HEAD_FILE),
    ):
        a, b = load(straight), load(resumed)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # Both did train: otherwise the comparison above would hold for a run that did nothing.
    assert load_file(straight / "final" / CRITIC_DIR / VALUE_HEAD_FILE)["weight"].abs().max() > 0
    start = AutoModelForCausalLM.from_pretrained(resolve_model_name("tiny")).state_dict()
    final = AutoModelForCausalLM.from_pretrained(straight / "final").state_dict()
    assert not all(torch.equal(start[k], final[k]) for k in start)
    assert (resumed / "final" / "trainer_state.pt").exists()
    assert not (resumed / "step-000002" / "trainer_state.pt").exists()
    assert not (resumed / "step-000002" / CRITIC_DIR).exists()  # the critic only resumes: the newest keeps it
    assert (resumed / "final" / CRITIC_DIR / VALUE_HEAD_FILE).exists()


def run_cli(*arguments, cwd):
    return subprocess.run(
        [sys.executable, str(ROOT / "ppo.py"), *arguments], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.launches
def test_smoke_run_writes_metrics_and_loadable_checkpoints(tmp_path):
    result = run_cli(
        "--model", "tiny", "--max_steps", "3", "--batch_size", "2", "--group_size", "2",
        "--max_new_tokens", "16", "--save_every", "2", "--sample_every", "1", "--output_dir", "out",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert run_dir.name.startswith("ppo-countdown-tiny-")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["completion/length_max"] <= 16 and math.isfinite(m["loss/value"]) for m in metrics)
    assert len(read_jsonl(run_dir / "samples.jsonl")) == 3 * 2
    for checkpoint in ("step-000002", "final"):
        model = AutoModelForCausalLM.from_pretrained(run_dir / checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(run_dir / checkpoint)
        assert model.config.model_type == "qwen2" and tokenizer.chat_template
    assert not (run_dir / "step-000002" / CRITIC_DIR).exists()  # the newest checkpoint alone keeps the critic
    args = Args(model="tiny", resume_from=str(run_dir / "final"))  # as a resumed run loads it
    critic = load_critic(args, torch.device("cpu"), torch.float32)
    assert critic.backbone.config.model_type == "qwen2" and critic.value_head.weight.shape == (1, 96)


@pytest.mark.launches
def test_bad_arguments_stop_with_a_message(tmp_path):
    result = run_cli(
        "--model", "tiny", "--group_size", "0", "--lam_actor", "1.5", "--value_warmup_steps", "600",
        "--eps_value", "0", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    for message in (
        "--group_size must be at least 1",
        "--lam_actor must be between 0 and 1",
        "--value_warmup_steps must be below --max_steps",
        "--eps_value must be > 0",
    ):
        assert message in result.stderr
    assert not (tmp_path / "runs").exists()  # nothing was created
    # Resuming from a checkpoint without a critic (a grpo.py one) stops with a message.
    with pytest.raises(SystemExit, match="has no critic/value_head.safetensors: not a ppo.py checkpoint"):
        train(Args(model="tiny", resume_from=str(tmp_path), output_dir=str(tmp_path)))


def test_every_logged_metric_is_explained_in_the_docs(tmp_path):
    run_dir = train(
        Args(model="tiny", max_steps=1, batch_size=2, group_size=2, max_new_tokens=4, output_dir=str(tmp_path))
    )
    logged = set(read_jsonl(run_dir / "metrics.jsonl")[0])
    documented = set(re.findall(r"^\| `([\w/]+)` \|", (ROOT / "docs" / "metrics.md").read_text(), flags=re.M))
    assert logged - documented == set(), "metrics missing from docs/metrics.md"


@pytest.mark.launches
def test_help_lists_every_hyperparameter_with_its_meaning(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    for field in dataclasses.fields(Args):
        assert f"--{field.name}" in text
    assert "ε_v, clip range of V_φ around V_old in the value loss (default: 0.2)" in text


def test_args_have_a_help_text_each():
    for field in dataclasses.fields(Args):  # every field explains itself in --help
        assert field.metadata.get("help"), field.name
