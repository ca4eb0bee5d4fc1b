"""PPO: Proximal Policy Optimization with a learned critic and GAE, one self-contained loop.

A critic V_φ (the policy's transformer with a scalar value head in place of the LM head)
predicts, at every completion position, the reward still to come. The task reward arrives
at the last completion token; every token also pays a KL penalty −β·(log π_θold − log π_ref).
Generalised advantage estimation turns these per-token rewards and values into a per-token
advantage Â_t for the policy's clipped objective and a return target for the critic. Unlike
GRPO, no group of completions is needed: the critic is the baseline.

The loop of train(), one numbered comment per step (the README draws the same box):
  1-3. sample B prompts, G completions of each from π_θold, score them  rollout
  4. log π_θold, log π_ref and the critic's V_φold(s_t), no grad    old_and_ref_logprobs, old_critic_values
  5. per-token rewards, then GAE: Â_t for the actor, R_t for the critic   advantages_and_returns
  6. K epochs over shuffled mini-batches of whole groups: the actor's clipped loss (ppo_loss)
     and the critic's clipped value loss (value_loss), one AdamW step each   policy_backward, critic_backward
  7-9. held-out accuracy when due, the metrics row, a checkpoint   common.Run.end_step
Deliberate departures: the token-level mean of VAPO (Eq. 12 of DAPO) rather than a per-sequence
one; the KL is the k1 estimate inside the reward, as InstructGPT's; on-policy the ratio is
exactly 1 (on_policy).

Papers (equation numbers as cited in the code):
  PPO        Schulman et al. 2017, arXiv 1707.06347, Eq. 7 (clipped surrogate), Eq. 9 (value
             loss and entropy bonus), Eq. 11-12 (truncated GAE), Alg. 1 (epochs over mini-batches).
  GAE        Schulman et al. 2016, arXiv 1506.02438, Eq. 16.
  KL reward  Ouyang et al. 2022 (InstructGPT), arXiv 2203.02155, Eq. 2: the reward minus
             β·log(π/π_ref), here as one k1 term per token (Ziegler et al. 2019, 1909.08593).
  VAPO       Yue et al. 2025, arXiv 2504.05118, Sec. 3 (value pretraining, decoupled GAE,
             length-adaptive GAE, the token-level loss, clip-higher as DAPO Eq. 10, the
             positive-example LM loss); the background equations as in the DAPO paper, Eq. 2-3.
  Others     dual-clip, TIS, IcePop: each cited at its function, after train() (docs/techniques.md).
  Defaults   marked "seed study": PPO, GRPO and DAPO on Countdown with Qwen2.5-1.5B-Instruct,
             arXiv 2512.07611.

Run:
  python ppo.py --model Qwen2.5-1.5B-Instruct --gradient_checkpointing true     # one 80 GB GPU (docs/models.md)
  python ppo.py --model tiny --max_steps 20                                      # CPU smoke run, no download
  python ppo.py --model tiny --task digit --lr 3e-3 --critic_lr 3e-3 --max_new_tokens 8 --max_steps 40   # CPU
  torchrun --nproc_per_node 8 ppo.py --model Qwen2.5-7B-Instruct --gradient_checkpointing true   # docs/distributed.md
Shape letters in comments: B prompts per step · G completions per prompt · N = B·G sequences · n rows of
  a micro-batch or of one rollout() · P prompt tokens (left padded) · T completion tokens (right padded) ·
  V vocabulary (the tokenizer's) · H hidden size
"""

import contextlib
import functools
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

import common
from common import RunArgs, arg
from rewards import Score, TaskArgs, ToolQueue, heldout_task, scored, tool_turns, tool_turns_due, training_task


@dataclass
class Args(RunArgs, TaskArgs):
    # The algorithm's hyperparameters; --help lists the shared flags after them (common.RunArgs, rewards.TaskArgs).
    # the PPO objective
    eps_low: float = arg(0.2, "ε_low, lower clip range of the token ratio, DAPO Eq. 10")
    eps_high: float = arg(0.2, "ε_high, upper clip range of the token ratio (clip-higher), DAPO Eq. 10 (VAPO: 0.28)")
    eps_value: float = arg(0.2, "ε_v, clip range of V_φ around V_old in the value loss")
    entropy_coef: float = arg(0.0, "c_2 of PPO Eq. 9, entropy bonus (seed study: it hurt accuracy); 0 = off")
    dual_clip: float = arg(0.0, "c of dual-clip PPO (Ye et al. Eq. 4), > 1 to enable (verl: 3); 0 = off")
    beta: float = arg(0.01, "β, k1 KL penalty in the per-token reward (InstructGPT Eq. 2); 0 = no reference")
    gamma: float = arg(1.0, "γ, discount of GAE (GAE Eq. 16); 1 = the reward at the end counts in full")
    lam_actor: float = arg(0.95, "λ of GAE for the policy's advantages (GAE Eq. 16)")
    lam_critic: float = arg(0.95, "λ of GAE for the critic's return targets (VAPO decoupled GAE: 1.0)")
    length_adaptive_lam: bool = arg(False, "VAPO: λ_actor = 1 − 1/(α·|o|) per completion, clamped at 0")
    lam_alpha: float = arg(0.05, "α of the length-adaptive λ_actor (VAPO)")
    value_warmup_steps: int = arg(0, "VAPO value pretraining: only the critic learns for the first K steps")
    whiten_advantages: bool = arg(True, "whiten Â over valid tokens, population variance (verl: unbiased); false: raw")
    whiten_eps: float = arg(0.0025, "ε added to Â's variance when whitening: √ε = 0.05 floors its std (verl: 1e-8)")
    pos_lm_coef: float = arg(0.0, "μ, VAPO's positive-example LM loss: + μ·NLL of the correct completions (VAPO: 0.1)")
    tis_cap: float = arg(0.0, "C, truncated IS: each token's policy-gradient term × min(π_θold/π_sampler, C); 0 = off")
    is_mask: str = arg("", "α,β of masked IS (IcePop): a token with π_θold/π_sampler outside [α, β] leaves the loss")
    is_mask_level: str = arg("token", "token (IcePop's M per token) or sequence (the geometric mean of a completion's)")
    # sampling: PPO needs no groups (the critic is the baseline), but B prompts × G samples keeps
    # N = B·G = 256 completions a step, the same prompts and compute as grpo.py, so runs compare
    batch_size: int = arg(32, "B, prompts per step")
    group_size: int = arg(8, "G, completions per prompt; 1 is allowed (then reward/zero_std_groups is 1)")
    max_new_tokens: int = arg(1024, "completion cap; every completion longer is truncated")
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same one")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 samples the whole distribution")
    # optimisation: actor and critic each have their own AdamW and clip their own gradient norm
    lr: float | None = arg(None, "actor (policy) learning rate; unset: 1e-6 (seed study: 1e-6 to 3e-6), 1e-5 with LoRA")
    critic_lr: float | None = arg(None, "critic learning rate; unset: 10× the actor's default (its head starts from 0)")
    warmup_steps: int = arg(0, "linear learning-rate warm-up of actor and critic, in steps they train")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    adam_beta2: float = arg(0.999, "AdamW β2")
    max_grad_norm: float = arg(1.0, "gradient clipping by global norm")
    ppo_epochs: int = arg(1, "K, epochs over each rollout (PPO Alg. 1)")
    num_mini_batches: int = arg(4, "optimizer steps per epoch, for actor and critic each; N must split evenly")
    # run
    max_steps: int = arg(500, "training steps (one batch of B·G completions each)")


CRITIC_DIR = "critic"  # each checkpoint keeps the critic in this subfolder
VALUE_HEAD_FILE = "value_head.safetensors"  # the critic's scalar head, beside its backbone


@dataclass
class Rollout:
    """What steps 1-3 produce: n = (prompts)·G rows, the group of prompt i in rows i·G … i·G+G-1."""

    prompt_ids: torch.Tensor  # (n, P) left padded
    prompt_mask: torch.Tensor  # (n, P) 1 for prompt tokens, 0 for padding
    completion_ids: torch.Tensor  # (n, T) right padded with the pad id
    completion_mask: torch.Tensor  # (n, T) the model's own tokens: 1 up to and including the EOS
    truncated: torch.Tensor  # (n,) True where no EOS came within max_new_tokens
    sample_logp: torch.Tensor  # (n, T) log π of each sampled token, as generate drew it
    rewards: torch.Tensor  # (n,) the task's rule-based reward
    texts: list[str]  # the n completions, decoded
    scores: list[Score]  # the n grades: reward, correct, formatted, strict
    seconds: dict[str, float] = field(default_factory=dict)  # time rollout() spent generating and scoring
    tool_mask: torch.Tensor | None = None  # (n, T) the tools' answers: attended, never trained (None: none)
    tool_counts: torch.Tensor | None = None  # (n, 4) each completion's calls, failed ones, turns, calls past them

    def tensors(self) -> dict[str, torch.Tensor]:
        """The (n, …) tensors by name, for the update to slice into mini-batches and micro-batches."""
        names = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated", "sample_logp")
        tool_mask = self.tool_mask if self.tool_mask is not None else torch.zeros_like(self.completion_mask)
        return {name: getattr(self, name) for name in names} | {"tool_mask": tool_mask}


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: per-token rewards, GAE, the PPO losses and their backward passes


def token_rewards(
    rewards: torch.Tensor,  # (N,) task reward R_i
    old_logp: torch.Tensor | None,  # (N, T) log π_θold; None when beta = 0 (step 4 may skip it)
    ref_logp: torch.Tensor | None,  # (N, T) log π_ref; None when beta = 0
    completion_mask: torch.Tensor,  # (N, T)
    beta: float,
) -> torch.Tensor:
    """The reward of every completion token (InstructGPT Eq. 2, spread over tokens):
        r_t = −β · (log π_θold(o_t) − log π_ref(o_t))  +  R_i if t is the last token of o_i
    the k1 estimate, whose sum over a completion estimates KL(π_θold ‖ π_ref) without bias. The last
    token is the EOS, or a truncated completion's last. Returns (N, T), 0 where completion_mask is 0."""
    mask = completion_mask.to(rewards.dtype)
    kl = old_logp - ref_logp if ref_logp is not None else torch.zeros_like(mask)  # (N, T) k1
    per_token = -beta * kl * mask  # (N, T)
    last = completion_mask.sum(-1, keepdim=True) - 1  # (N, 1) index of the last valid token
    return per_token.scatter_add(1, last, rewards[:, None].to(per_token.dtype))


def gae(
    per_token_rewards: torch.Tensor,  # (N, T) r_t
    values: torch.Tensor,  # (N, T) V(s_t)
    completion_mask: torch.Tensor,  # (N, T), valid tokens a prefix of each row (right padding)
    gamma: float,
    lam: float | torch.Tensor,  # λ, or (N,) one λ per completion (length-adaptive)
):
    """Generalised advantage estimation, GAE Eq. 16 / PPO Eq. 11-12:
        δ_t = r_t + γ V(s_{t+1}) − V(s_t),   Â_t = Σ_l (γλ)^l δ_{t+l} = δ_t + γλ Â_{t+1}
    with V = 0 and Â = 0 after the last valid token: the episode ends there. The return
    target of the critic is R_t = Â_t + V(s_t) (the λ-return). Returns advantages, returns
    (N, T), 0 where completion_mask is 0."""
    mask = completion_mask.to(values.dtype)
    rewards, values = per_token_rewards * mask, values * mask  # padding: r = 0, V = 0, so δ = 0
    lam = torch.as_tensor(lam, dtype=values.dtype, device=values.device).reshape(-1)  # (N,) or (1,)
    next_value = torch.zeros_like(values[:, 0])  # (N,) V(s_{t+1})
    next_advantage = torch.zeros_like(values[:, 0])  # (N,) Â_{t+1}
    advantages = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        next_value = values[:, t]
        advantages.append(next_advantage)
    advantages = torch.stack(advantages[::-1], dim=1) * mask  # (N, T)
    return advantages, (advantages + values) * mask


def masked_whiten(x: torch.Tensor, completion_mask: torch.Tensor, eps: float, total=lambda sum_: sum_) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps), mean and population variance over the valid tokens of the whole
    batch (total: every rank's). eps is a floor, not only a guard against 0: once every answer is
    right, what is left of Â (the KL penalty, the critic's errors) has a spread of ~0.01, which
    eps = 1e-8 (verl's, TRL's) stretches to 1, the size a right answer had; √eps = 0.05 stretches it
    at most 20× (docs/learning.md). x, mask (N, T) -> (N, T), 0 where masked."""
    mask = completion_mask.to(x.dtype)
    count = total(mask.sum())
    mean = total((x * mask).sum()) / count
    variance = total(((x - mean) ** 2 * mask).sum()) / count
    return (x - mean) * torch.rsqrt(variance + eps) * mask


def advantages_and_returns(
    rewards: torch.Tensor,  # (N,) the task's reward of each completion
    old_logp: torch.Tensor | None,  # (N, T) log π_θold; None when beta = 0 (unused then)
    ref_logp: torch.Tensor | None,  # (N, T) log π_ref; None when beta = 0
    old_values: torch.Tensor,  # (N, T) V_φold(s_t)
    completion_mask: torch.Tensor,  # (N, T)
    args: Args,
):
    """Step 5: the per-token rewards (token_rewards), then GAE with λ_actor (VAPO: length-adaptive)
    for the policy's advantages and with λ_critic for the critic's return targets (VAPO's decoupled
    GAE). Returns the raw advantages, those the policy trains on (whitened over the batch's valid
    tokens unless --whiten_advantages false) and the returns, (N, T) each. With tools, the model's
    tokens go to the front of each row first (model_tokens_first), so GAE steps across a tool's
    answer in one step (the answer is part of the next state), and back after."""
    order = model_tokens_first(completion_mask)  # (N, T) the identity without tools
    old_logp, ref_logp, old_values, completion_mask = (
        x.gather(1, order) if x is not None else None for x in (old_logp, ref_logp, old_values, completion_mask)
    )
    per_token_reward = token_rewards(rewards, old_logp, ref_logp, completion_mask, beta=args.beta)  # (N, T)
    lengths = completion_mask.sum(-1)  # (N,)
    lam_actor = adaptive_lambda(lengths, args.lam_alpha) if args.length_adaptive_lam else args.lam_actor
    raw_advantages, _ = gae(per_token_reward, old_values, completion_mask, gamma=args.gamma, lam=lam_actor)
    _, returns = gae(per_token_reward, old_values, completion_mask, gamma=args.gamma, lam=args.lam_critic)
    # Whitened, Â has unit scale even in a batch whose returns hardly vary (every completion
    # 0.1): the critic's noise then pushes the policy as hard as a right answer would.
    advantages = raw_advantages  # (N, T)
    if args.whiten_advantages:
        advantages = masked_whiten(raw_advantages, completion_mask, args.whiten_eps, common.all_reduce)
    return tuple(torch.zeros_like(x).scatter(1, order, x) for x in (raw_advantages, advantages, returns))


def model_tokens_first(completion_mask: torch.Tensor) -> torch.Tensor:
    """The column order that puts each row's model tokens (completion_mask 1) first, in their order,
    and the rest (the tools' answers, padding) after: (N, T) -> (N, T) indices for gather, and for
    scatter back. Without tools the model's tokens are already a prefix: the identity."""
    return (1 - completion_mask.long()).argsort(dim=1, stable=True)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """PPO's clipped surrogate per token (PPO Eq. 7; DAPO Eq. 10 with ε_low and ε_high):
        min(r·Â, clip(r, 1 − ε_low, 1 + ε_high)·Â)
    the pessimistic bound: once r has moved past the clip in the direction Â pushes it, the token
    gets no gradient, so one batch cannot drag π_θ far from π_θold.
    ratio (n, T), advantages (n, 1) or (n, T) -> (n, T)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    return torch.min(unclipped, clipped)


def ppo_loss(
    logp: torch.Tensor,  # (n, T) log π_θ, with grad
    old_logp: torch.Tensor,  # (n, T) log π_θold, recorded before the first update
    advantages: torch.Tensor,  # (n, T) Â_t, whitened unless --whiten_advantages false
    loss_mask: torch.Tensor,  # (n, T) completion_mask, less what --is_mask drops
    args: Args,  # reads eps_low, eps_high, dual_clip, entropy_coef
    *,
    num_tokens: int,  # the valid tokens of the whole mini-batch
    entropy: torch.Tensor | None = None,  # (n, T) H(π_θ(·|s_t)) with grad; None when entropy_coef = 0
    is_weight: torch.Tensor | None = None,  # (n, T) truncated IS weights (tis_weights); None = off
):
    """The negative PPO objective of one micro-batch, PPO Eq. 7 (plus Eq. 9's entropy bonus):
        J = 1/|tokens| Σ_i Σ_t [ min(r_t Â_t, clip(r_t, 1−ε_low, 1+ε_high) Â_t) + c_2 H_t ]
    a mean over the whole mini-batch's valid tokens (VAPO's token-level loss, DAPO Eq. 12), so the
    micro-batches' losses add up to the mini-batch's. ε_high > ε_low is clip-higher (DAPO Eq. 10; VAPO:
    0.2, 0.28). The value loss is separate: separate networks, separate optimizers. Dual-clip and
    truncated IS enter as one function each, after train(). Returns (loss, stats over loss_mask)."""
    mask = loss_mask.to(logp.dtype)  # (n, T)
    ratio = torch.exp((logp - old_logp) * mask)  # (n, T) r_t
    objective = clipped_surrogate(ratio, advantages, args.eps_low, args.eps_high)  # (n, T)
    objective, dual_clipped = dual_clip(objective, advantages, args.dual_clip)  # c·Â bounds Â < 0 tokens below
    if is_weight is not None:
        objective = is_weight * objective  # truncated IS: the clipped term only
    if args.entropy_coef > 0:
        objective = objective + args.entropy_coef * entropy  # PPO Eq. 9's bonus c_2·H_t
    loss = -(objective * mask).sum() / num_tokens
    stats = common.loss_stats(
        ratio, advantages, loss_mask, eps_low=args.eps_low, eps_high=args.eps_high, dual_clipped=dual_clipped,
        is_weight=is_weight,
    )  # fmt: skip
    return loss, stats


def value_loss(
    values: torch.Tensor,  # (n, T) V_φ(s_t), with grad
    old_values: torch.Tensor,  # (n, T) V_φold(s_t), recorded with the rollout
    returns: torch.Tensor,  # (n, T) R_t, the GAE return targets
    completion_mask: torch.Tensor,  # (n, T)
    eps_value: float,
    num_tokens: int,
):
    """The clipped value loss (PPO Eq. 9's L^VF with OpenAI baselines' PPO2 clipping):
        L = 1/|tokens| Σ ½ · max((V − R_t)², (clip(V, V_old − ε_v, V_old + ε_v) − R_t)²)
    pessimistic: a value that moved more than ε_v from V_old gets no gradient once the clipped error
    is the larger. Returns (loss, stats): sums over valid tokens."""
    mask = completion_mask.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-eps_value, eps_value)  # (n, T)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    loss = (0.5 * torch.max(unclipped_error, clipped_error) * mask).sum() / num_tokens
    with torch.no_grad():
        valid = completion_mask.bool()
        stats = {
            "tokens": valid.sum(),
            "value_clipped": (valid & (clipped_error > unclipped_error)).sum(),
        }
    return loss, stats


def on_policy(args: Args) -> bool:
    """True when the batch trains one update (K = 1 epoch and one mini-batch): π_θold is then the π_θ
    of that update's forward pass, before its optimizer step, which step 4 need not score."""
    return args.ppo_epochs == 1 and args.num_mini_batches == 1


def policy_backward(policy, batch: dict, args: Args, vocab_size: int, amp=contextlib.nullcontext) -> tuple[dict, dict]:
    """Step 6's forward and backward of the policy over one mini-batch, micro-batch by micro-batch;
    gradients accumulate in .grad. amp() is the forward's autocast context. Returns (totals, recorded):
    the summed loss and token statistics, and, on-policy (batch["old_logp"] None), this pass's log π_θ
    and entropy (n, T), no grad, standing in for step 4's; old = sg(log π_θ) makes the ratio exactly 1.
    A token --is_mask drops leaves ppo_loss; VAPO's NLL term, with no ratio in it, keeps it."""
    loss_mask, totals = masked_importance(batch, batch["completion_mask"], args)  # (n, T): less what --is_mask drops
    # The whole mini-batch's tokens, for every micro-batch; under torchrun every rank's (FSDP sums
    # the ranks' gradients): the normalisers of one process's loss. max(…, 1): all masked, loss 0.
    num_tokens = max(common.all_reduce(loss_mask.sum().item()), 1)
    batch = {**batch, "loss_mask": loss_mask}
    if args.pos_lm_coef > 0:  # VAPO's Σ_{o_i∈T} |o_i| over the whole mini-batch
        num_positive_tokens = common.all_reduce((batch["completion_mask"] * batch["positive"][:, None]).sum().item())
    record = batch["old_logp"] is None  # this forward pass stands in for step 4's
    recorded = {name: torch.zeros_like(loss_mask, dtype=torch.float32) for name in ("old_logp", "entropy") if record}
    for rows, micro in micro_batches(batch, args.micro_batch_size, args.micro_batch_tokens):
        with amp():
            logp, entropy = sequence_logprobs(
                policy, micro["prompt_ids"], micro["prompt_mask"], micro["completion_ids"], micro["completion_mask"],
                temperature=args.temperature, vocab_size=vocab_size, chunk_size=len(rows),
                with_entropy=args.entropy_coef > 0 or record, entropy_grad=args.entropy_coef > 0,
                tool_mask=micro.get("tool_mask"), layout=micro["layout"],
            )  # (m, T) each  # fmt: skip
            old_logp = logp.detach() if on_policy(args) else micro["old_logp"]
            is_weight = None
            if args.tis_cap:
                is_weight = tis_weights(old_logp, micro["sample_logp"], micro["completion_mask"], args.tis_cap)
            loss, stats = ppo_loss(
                logp, old_logp, micro["advantages"], micro["loss_mask"], args, num_tokens=num_tokens,
                entropy=entropy, is_weight=is_weight,
            )  # fmt: skip
            if args.pos_lm_coef > 0:
                nll = positive_lm_loss(logp, micro["completion_mask"], micro["positive"], num_positive_tokens)
                loss = loss + args.pos_lm_coef * nll
                stats |= {
                    "pos_nll": nll.detach(),
                    "pos_tokens": (micro["completion_mask"] * micro["positive"][:, None]).sum(),
                }
        loss.backward()
        common.accumulate(totals, {"loss": loss.detach(), **stats})
        if record:
            recorded["old_logp"][rows], recorded["entropy"][rows] = logp.detach(), entropy.detach()
    return common.host_numbers(totals), recorded  # one host sync, after the last micro-batch


def critic_backward(critic: "Critic", batch: dict, args: Args, amp=contextlib.nullcontext) -> dict:
    """Step 6's forward and backward of the critic over one mini-batch (the same rows the policy
    just trained on), in the policy's micro-batches (micro_batches), the value loss normalised by the
    mini-batch's token count. Returns the summed loss and statistics of the whole mini-batch."""
    num_tokens = common.all_reduce(batch["completion_mask"].sum().item())  # under torchrun every rank's
    totals = {}
    for rows, micro in micro_batches(batch, args.micro_batch_size, args.micro_batch_tokens):
        with amp():
            values = critic_values(
                critic, micro["prompt_ids"], micro["prompt_mask"], micro["completion_ids"], micro["completion_mask"],
                chunk_size=len(rows), tool_mask=micro.get("tool_mask"), layout=micro["layout"],
            )  # (m, T)  # fmt: skip
            loss, stats = value_loss(
                values, micro["old_values"], micro["returns"], micro["completion_mask"], eps_value=args.eps_value,
                num_tokens=num_tokens,
            )  # fmt: skip
        loss.backward()
        common.accumulate(totals, {"loss": loss.detach(), **stats})
    return common.host_numbers(totals)


# ----------------------------------------------------------------------------------------
# Variants and sampler/trainer corrections, each one function the loss or train() reads: VAPO's
# length-adaptive λ and positive-example LM loss, dual-clip, truncated and masked importance sampling.


def adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive GAE (Sec. 3): λ_actor = 1 − 1/(α·|o_i|) per completion, so that
    Σ_t λ^t ≈ α·|o_i| grows with the length and a long answer's reward reaches its first tokens;
    clamped at 0 for |o_i| < 1/α. lengths (N,) -> λ (N,)."""
    return (1 - 1 / (alpha * lengths.to(torch.float32))).clamp(min=0.0)


def positive_lm_loss(
    logp: torch.Tensor,  # (n, T) log π_θ, with grad
    completion_mask: torch.Tensor,  # (n, T)
    positive: torch.Tensor,  # (n,) True for a completion the task scored correct
    num_positive_tokens: int,
):
    """VAPO's positive-example LM loss (arXiv 2504.05118, Sec. 3), the NLL of the batch's correct
    completions T (Score.correct; on Countdown not the 0.1 format-only reward):
        L_NLL = −1/Σ_{o_i∈T} |o_i| · Σ_{o_i∈T} Σ_t log π_θ(o_i,t)
    added to the policy loss with weight μ: imitating its rare successes. No correct completion: 0."""
    positive_mask = completion_mask.to(logp.dtype) * positive[:, None]  # (n, T)
    return -(logp * positive_mask).sum() / max(num_positive_tokens, 1)


def dual_clip(objective: torch.Tensor, advantages: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020, Eq. 4): where Â < 0 the objective is bounded below by c·Â, c > 1,
        max(min(r·Â, clip(r)·Â), c·Â)
    so a token whose ratio exploded cannot dominate the batch. c = 0: off.
    -> (objective (n, T), the bounded tokens (n, T) bool)."""
    if c <= 0:
        return objective, torch.zeros_like(objective, dtype=torch.bool)
    bound = c * advantages.expand_as(objective)  # (n, T)
    bounded = (advantages < 0) & (objective < bound)
    return torch.where(bounded, bound, objective), bounded


def tis_weights(old_logp: torch.Tensor, sample_logp: torch.Tensor, completion_mask: torch.Tensor, cap: float):
    """Truncated importance sampling (Yao et al. 2025): sampler and trainer score a token differently,
    so each policy-gradient term is weighted by
        w_t = min(π_θold(y_t) / π_sampler(y_t), C)
    a constant, no gradient. (n, T) each -> w (n, T), 1 where masked."""
    log_ratio = ((old_logp - sample_logp) * completion_mask).clamp(max=20.0)  # e^20: finite, as in kl_k3
    return torch.exp(log_ratio).clamp(max=cap).detach()


def importance_mask(
    old_logp: torch.Tensor, sample_logp: torch.Tensor, completion_mask: torch.Tensor, bounds: tuple, level: str
) -> torch.Tensor:
    """Masked importance sampling (IcePop, arXiv 2510.18855): a token keeps its policy-gradient term
    only while k_t = π_θold(y_t) / π_sampler(y_t) lies in [α, β]; level "sequence" judges a completion
    by the geometric mean of its k_t. -> keep (n, T): 1 for a valid token that stays, else 0."""
    low, high = bounds
    log_ratio = ((old_logp - sample_logp) * completion_mask).detach()  # (n, T) log k_t, 0 on padding
    if level == "sequence":
        lengths = completion_mask.sum(-1, keepdim=True).clamp(min=1)  # (n, 1) |o_i|
        log_ratio = (log_ratio.sum(-1, keepdim=True) / lengths).expand_as(log_ratio)  # (n, T) log of the mean
    ratio = torch.exp(log_ratio)  # overflow gives inf, which is outside [α, β] as it should be
    return completion_mask * ((ratio >= low) & (ratio <= high)).to(completion_mask.dtype)


def masked_importance(batch: dict, loss_mask: torch.Tensor, args) -> tuple[torch.Tensor, dict]:
    """--is_mask over a whole mini-batch (importance_mask), before its micro-batches, so the loss's
    normalisers count what stays. Returns loss_mask less the masked tokens (n, T), and their counts."""
    bounds = common.is_mask_bounds(args.is_mask)
    if bounds is None:
        return loss_mask, {}
    keep = importance_mask(batch["old_logp"], batch["sample_logp"], loss_mask, bounds, args.is_mask_level)
    counts = {
        "masked_tokens": (loss_mask.sum() - keep.sum()).item(),
        "masked_sequences": ((loss_mask.sum(-1) > 0) & (keep.sum(-1) == 0)).sum().item(),
        "sequences": (loss_mask.sum(-1) > 0).sum().item(),
    }
    return keep, counts


# ----------------------------------------------------------------------------------------
# Training: train() runs the numbered steps of the docstring; its metrics and helpers follow.


def train(args: Args) -> Path:
    """Runs PPO and returns the run directory."""
    check_args(args)
    device = common.init_distributed(common.resolve_device(args.device))  # under torchrun: this rank's device
    common.check_distributed(args, args.batch_size)  # B prompts split over K ranks, a group never spans two
    weight_dtype, compute_dtype = common.resolve_precision(args.dtype, device)
    amp = functools.partial(common.autocast, device, compute_dtype)  # bf16 on a GPU; CPU: nothing
    common.seed_everything(common.rank_seed(args.seed))  # --seed itself in one process
    # The task first: a wrong --task or --data_dir stops before any model loads.
    task = training_task(args)  # --task, its data and --reward_fn
    heldout = heldout_task(args) if args.eval_every else None
    policy, tokenizer, eos_ids = common.load_policy(args, device, weight_dtype, compute_dtype, task)  # --lora_rank
    common.shard_model(policy, compute_dtype).train()  # FSDP2 under torchrun, a unit per decoder layer; else as is
    critic = load_critic(args, device, weight_dtype, compute_dtype)
    common.shard_model(critic, compute_dtype, fp32_modules=("value_head",))
    reference = None  # π_ref, only for a KL term
    if args.beta > 0:
        reference = common.shard_model(common.load_reference(args, policy, device, weight_dtype), compute_dtype)
    vocab_size = len(tokenizer)  # ids the tokenizer has; the embedding may have more rows
    optimizer, scheduler = common.make_optimizer(policy, args.lr, args)  # AdamW, linear warm-up
    critic_lr = args.critic_lr or 10 * (common.LORA_LR if args.lora_rank else common.FULL_LR)  # 10× the actor's
    critic_optimizer, critic_scheduler = common.make_optimizer(critic, critic_lr, args)
    evaluate = functools.partial(  # run.end_step calls it every eval_every steps and at the end
        common.evaluate_heldout, rollout, policy, tokenizer, eos_ids, heldout, max_new_tokens=args.max_new_tokens,
        batch_size=args.eval_batch_size, amp=amp, **common.tool_limits(args),
    )  # fmt: skip
    resumable = {"optimizer": optimizer, "scheduler": scheduler}
    resumable |= {"critic_optimizer": critic_optimizer, "critic_scheduler": critic_scheduler}
    write_critic = functools.partial(save_critic, critic)  # into every checkpoint's critic/ folder
    run = common.Run(
        args, "ppo", policy, tokenizer, resumable=resumable, evaluate=evaluate,
        write_extra=write_critic, resume_only=(CRITIC_DIR,),  # the critic only resumes: the newest checkpoint keeps it
        compute_dtype=compute_dtype,  # checkpoints in bf16 on a GPU, the fp32 masters in the newest's trainer state
    )  # fmt: skip
    passes = actor_critic_passes(policy, critic, args, vocab_size, amp)  # the preflight's, on a GPU
    common.size_micro_batches(args, task, tokenizer, [policy, critic], *passes)  # per pass; args.json keeps the flags
    num_sequences = args.batch_size * args.group_size // common.world_size()  # N, or this rank's N/K under torchrun

    with run:  # Ctrl-C stops with one line naming the newest checkpoint
        for step in run.steps():
            # 1-3. Sample B prompts, G completions of each from π_θold, every completion scored.
            indices = common.prompt_indices(step, args.batch_size, len(task.problems), args.seed)
            problems = [task.problems[i] for i in indices]
            with common.unsharded(policy):  # under torchrun: full weights for the decode loop, B/K prompts a rank
                batch = rollout(
                    policy, tokenizer, eos_ids, task, common.my_share(problems), group_size=args.group_size,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, amp=amp,
                    **common.tool_limits(args),
                )  # fmt: skip

            # 4. Log-probs under π_θold and π_ref, and values V_φ(s_t), no grad. On-policy with β = 0,
            #    in a step that updates the policy, only the metrics read old_logp: the update's forward
            #    pass gives it (old_and_ref_logprobs). With β > 0 the per-token reward of step 5 needs it.
            train_policy = step >= args.value_warmup_steps
            timer = time.perf_counter()
            # --is_mask needs π_θold's log-probs before the update: the pass runs with it.
            skip_policy_pass = on_policy(args) and args.beta == 0 and train_policy and not args.is_mask
            old_logp, entropy, ref_logp = old_and_ref_logprobs(
                policy, reference, batch, args, vocab_size=vocab_size, amp=amp, score_policy=not skip_policy_pass
            )  # (N, T) each; old_logp and entropy None until step 6 when skipped
            old_values = old_critic_values(critic, batch, args, amp)  # (N, T) V_φold(s_t)
            seconds_logprobs = time.perf_counter() - timer

            # 5. Per-token rewards; GAE gives the actor's Â (λ_actor, whitened unless
            #    --whiten_advantages false) and the critic's return targets (λ_critic).
            raw_advantages, advantages, returns = advantages_and_returns(
                batch.rewards, old_logp, ref_logp, old_values, batch.completion_mask, args
            )  # (N, T) each

            # 6. PPO epochs over shuffled mini-batches: one actor step (none during the value
            #    warm-up) and one critic step per mini-batch.
            timer = time.perf_counter()
            tensors = batch.tensors() | {"old_logp": old_logp, "advantages": advantages, "old_values": old_values}
            tensors |= {"returns": returns, "positive": torch.tensor([s.correct for s in batch.scores], device=device)}
            update, grad_norms, critic_update, critic_grad_norms = {}, [], {}, []
            for _ in range(args.ppo_epochs):
                # A fresh random split into mini-batches each epoch, a group's rows in one (whole_groups).
                order = common.whole_groups(torch.randperm(num_sequences, device=device), args.group_size)  # (N,)
                for rows in order.tensor_split(args.num_mini_batches):
                    mini = {k: v[rows] if v is not None else None for k, v in tensors.items()}
                    if train_policy:
                        totals, recorded = policy_backward(policy, mini, args, vocab_size, amp)
                        if recorded:  # on-policy: step 4's log-probs and entropy, in the batch's row order again
                            old_logp, entropy = (recorded[name][rows.argsort()] for name in ("old_logp", "entropy"))
                        common.accumulate(update, totals)
                        none = not common.all_reduce(totals["tokens"] + totals.get("pos_tokens", 0))  # all masked
                        grad_norms.append(common.optimizer_step(policy, optimizer, args.max_grad_norm, skip=none))
                    common.accumulate(critic_update, critic_backward(critic, mini, args, amp))
                    critic_grad_norms.append(common.optimizer_step(critic, critic_optimizer, args.max_grad_norm))
            learning_rates = scheduler.get_last_lr()[0], critic_scheduler.get_last_lr()[0]  # the rates this step used
            if train_policy:  # the actor's warm-up counts the steps in which it trains
                scheduler.step()
            critic_scheduler.step()
            seconds = {**batch.seconds, "logprobs": seconds_logprobs, "update": time.perf_counter() - timer}

            # 7-9. Every metric from the tensors the losses used, over the whole batch; then Run.end_step:
            #      the held-out evaluation when due, the metrics row and samples, a checkpoint when due.
            metrics = common.all_reduce_metrics(  # under torchrun, over every rank's share of the batch
                common.step_metrics(batch, entropy, old_logp, args.group_size)
                | rollout_value_metrics(
                    old_logp,
                    ref_logp,
                    batch.completion_mask,
                    beta=args.beta,
                    advantages=raw_advantages,
                    returns=returns,
                    old_values=old_values,
                )
            )
            update, critic_update = common.all_reduce_totals(update), common.all_reduce_totals(critic_update)
            metrics |= {
                **update_metrics(update, grad_norms, critic_update, critic_grad_norms, learning_rates),
                "throughput/tokens_per_s": common.all_reduce(batch.completion_mask.sum().item()) / seconds["generate"],
            }
            run.end_step(step, metrics, seconds, batch)
        run.save_final()
    return run.dir


def update_metrics(
    update: dict, grad_norms: list[float], critic_update: dict, critic_grad_norms: list[float], learning_rates
) -> dict:
    """Statistics of step 6, from the sums policy_backward and critic_backward collected over
    every micro-batch (never the last micro-batch alone). The actor's keys are absent in a
    value warm-up step: the policy did not update, and a 0 would read as a measured loss."""
    critic_tokens = critic_update["tokens"]
    metrics = {
        "loss/value": critic_update["loss"] / len(critic_grad_norms),  # mean over the optimizer steps
        "value/clip_fraction": critic_update["value_clipped"] / critic_tokens,
        "optim/critic_grad_norm": sum(critic_grad_norms) / len(critic_grad_norms),
        "optim/critic_lr": learning_rates[1],
    }
    if not grad_norms:
        return metrics
    tokens = max(update["tokens"], 1)  # --is_mask may have dropped every token
    actor = {
        "loss/policy": update["loss"] / len(grad_norms),
        "clip/low": update["clip_low"] / tokens,
        "clip/high": update["clip_high"] / tokens,
        "clip/fraction": (update["clip_low"] + update["clip_high"]) / tokens,
        "clip/dual": update["clip_dual"] / tokens,
        "clip/ratio_max": update["ratio_max"],
        "optim/grad_norm": sum(grad_norms) / len(grad_norms),
        "optim/lr": learning_rates[0],
    }
    if "tis_weight" in update and update["tokens"]:  # --tis_cap: the truncated IS weights the loss used
        actor |= {"tis/weight_mean": update["tis_weight"] / tokens, "tis/weight_max": update["tis_weight_max"]}
    if "pos_nll" in update:  # --pos_lm_coef: VAPO's NLL of the correct completions, and their token share
        actor |= {
            "loss/pos_nll": update["pos_nll"] / len(grad_norms),
            "pos/token_fraction": update["pos_tokens"] / (update["tokens"] + update.get("masked_tokens", 0)),
        }
    return {**actor, **metrics, **common.is_mask_metrics(update)}


def rollout_value_metrics(old_logp, ref_logp, completion_mask, beta, advantages, returns, old_values) -> dict:
    """What the critic and the per-token rewards looked like this step, over valid tokens:
    old_logp, ref_logp (or None), mask, the advantages before whitening, returns and the
    rollout's values, all (N, T)."""
    valid = completion_mask.bool()
    k1 = (old_logp - ref_logp)[valid] if ref_logp is not None else torch.zeros_like(old_logp[valid])
    k3 = kl_k3(old_logp, ref_logp)[valid] if ref_logp is not None else torch.zeros_like(k1)
    return {
        "kl/mean": k3.mean().item(),
        "kl/penalty": (beta * k1).mean().item(),
        "value/explained_variance": explained_variance(old_values, returns, completion_mask),
        "value/mean": old_values[valid].mean().item(),
        "return/mean": returns[valid].mean().item(),
        "return/std": returns[valid].std().item() if valid.sum() > 1 else 0.0,
        "advantage/mean": advantages[valid].mean().item(),
        "advantage/std": advantages[valid].std().item() if valid.sum() > 1 else 0.0,
    }


def explained_variance(values: torch.Tensor, returns: torch.Tensor, completion_mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over valid tokens: 1 for a perfect critic, 0 for one that knows only the
    mean, below 0 for a worse one; 0 when the returns do not vary (nothing to explain; CleanRL returns
    NaN there, verl a spike). values, returns, mask (N, T)."""
    valid = completion_mask.bool()
    target, error = returns[valid], (returns - values)[valid]
    target_variance = target.var(unbiased=False)
    if target_variance == 0:
        return 0.0
    return (1 - error.var(unbiased=False) / target_variance).item()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(π_θ ‖ π_ref) per token (Schulman 2020; DeepSeekMath Eq. 4):
        π_ref/π_θ − log(π_ref/π_θ) − 1, unbiased under samples of π_θ and never negative.
    logp, ref_logp (…, T) -> (…, T)."""
    # e^20 ≈ 5e8: finite. verl clamps at ±20 too, then caps k3 at 10; uncapped here: the whole gradient.
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(log_ratio) - log_ratio - 1


def actor_critic_passes(policy, critic, args: Args, vocab_size: int, amp) -> tuple:
    """What the preflight (common.size_micro_batches) measures: step 6's forward and backward of the
    policy, then of the critic, and step 4's no-grad passes of both, each as one chunk of all the rows
    it is given. common.logprob_passes, with the critic."""

    def update(sequences):
        with amp():
            logp, _ = sequence_logprobs(policy, *sequences, args.temperature, vocab_size, len(sequences[0]))
        logp.sum().backward()
        del logp
        policy.zero_grad(set_to_none=True)
        with amp():
            values = critic_values(critic, *sequences, len(sequences[0]))
        values.sum().backward()

    def score(sequences):
        policy.eval()
        critic.eval()
        with torch.no_grad(), amp():
            sequence_logprobs(policy, *sequences, args.temperature, vocab_size, len(sequences[0]), with_entropy=True)
            critic_values(critic, *sequences, len(sequences[0]))
        policy.train()
        critic.train()

    return update, score


# ----------------------------------------------------------------------------------------
# The critic V_φ: the policy's architecture with a scalar head, and its checkpoints


class Critic(torch.nn.Module):
    """V_φ(s_t): the policy's transformer (its AutoModel backbone) and a scalar value head on the last
    hidden state, a separate copy. The head starts at zero: V_φ = 0 everywhere at the start."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask, layout=None) -> torch.Tensor:
        """(n, p) and (n, t) ids and masks -> (n, t) fp32 value of the state in which each completion
        token is chosen (at position p-1+j for token j), each prompt forwarded once (forward_completions;
        layout: the chunk's, as chunks_of read it)."""
        hidden = common.forward_completions(
            self.backbone, prompt_ids, prompt_mask, completion_ids, completion_mask, "last_hidden_state", layout=layout
        )  # (n, t, H)
        # The head runs in fp32, outside autocast and whatever --dtype the backbone has: it is
        # one dot product per token, and bf16 would round values near 1 to steps of ~0.004-0.008
        # (noise GAE sums over tokens) and round critic_lr-sized updates of the head away.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return self.value_head(hidden.float()).squeeze(-1)


def load_critic(args, device: torch.device, dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> Critic:
    """The critic: its backbone from --model (or --resume_from's critic/), its head from zero (or the
    checkpoint's value_head.safetensors). With --lora_rank: --model's frozen backbone under adapters of its own."""
    if args.lora_rank:
        dtype = common.frozen_dtype(dtype, compute_dtype)
    saved = Path(args.resume_from) / CRITIC_DIR if args.resume_from else None
    name = str(saved) if saved and not args.lora_rank else args.model
    path = common.resolve_model_name(name)
    source, gguf = common.model_source(path)  # a GGUF file: from_pretrained(directory, gguf_file=name)
    try:
        backbone = AutoModel.from_pretrained(source, dtype=dtype, **gguf)  # drops the LM head's weights
        if gguf:
            common.dequantised(backbone)
    except (OSError, ValueError, RuntimeError) as error:
        raise SystemExit(
            f"Could not load the critic's backbone from {name!r} (resolved to {path!r}): {error}"
        ) from error
    if args.gradient_checkpointing:
        common.enable_activation_checkpointing(backbone)
    backbone.to(device=device, dtype=dtype)
    if args.lora_rank:  # after the cast: peft keeps the adapters of a bf16 backbone in fp32
        backbone = common.with_adapters(backbone, args, saved / common.ADAPTER_DIR if saved else None)
    critic = Critic(common.compile_blocks(backbone, args.compile))  # --compile: as the policy's
    critic.value_head.to(device=device, dtype=torch.float32)  # fp32 always (see Critic.forward)
    if saved:
        critic.value_head.load_state_dict(load_file(saved / VALUE_HEAD_FILE, device=str(device)))
    return critic.train()


def save_critic(critic: Critic, directory: Path) -> None:
    """Writes the critic into a checkpoint's critic/ folder: the backbone by save_pretrained (with LoRA its
    adapters), the head in value_head.safetensors. Run calls it on the staging directory, so policy and
    critic are renamed into place together."""
    backbone_dir = Path(directory) / CRITIC_DIR / (common.ADAPTER_DIR if common.is_lora(critic.backbone) else "")
    if common.world_size() > 1:  # torchrun: every rank gathers, rank 0 writes the full weights
        state = common.full_state_dict(critic)
        if common.rank() == 0:
            backbone = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
            critic.backbone.save_pretrained(backbone_dir, state_dict=backbone, safe_serialization=True)
            head = {k.removeprefix("value_head."): v.contiguous() for k, v in state.items() if "value_head." in k}
            save_file(head, Path(directory) / CRITIC_DIR / VALUE_HEAD_FILE)
        return
    critic.backbone.save_pretrained(backbone_dir, safe_serialization=True)
    head = {k: v.contiguous() for k, v in critic.value_head.state_dict().items()}
    save_file(head, Path(directory) / CRITIC_DIR / VALUE_HEAD_FILE)


def old_critic_values(critic: Critic, batch: Rollout, args: Args, amp) -> torch.Tensor:
    """Step 4's values V_φold(s_t) of every completion token, no grad, logprob_chunk_size (or _tokens) rows
    at a time: (N, T). Autocast of its own: autocast keeps the bf16 copy of every trainable weight
    it casts until its context ends, so one context would hold policy and critic copies at once."""
    critic.eval()  # same mode as sampling (matters for models with dropout)
    with torch.no_grad(), amp():
        sequences = batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        old_values = critic_values(
            critic, *sequences, args.logprob_chunk_size, args.logprob_chunk_tokens, tool_mask=batch.tool_mask
        )  # (N, T)
    critic.train()
    return old_values


def critic_values(
    critic: Critic,
    prompt_ids: torch.Tensor,  # (N, P)
    prompt_mask: torch.Tensor,  # (N, P)
    completion_ids: torch.Tensor,  # (N, T)
    completion_mask: torch.Tensor,  # (N, T)
    chunk_size: int,
    chunk_tokens: int = 0,
    tool_mask: torch.Tensor | None = None,  # (N, T) the tools' answers: in the sequence, no value read
    layout: "common.Layout | None" = None,  # the rows as one chunk, its Layout read by the caller (micro_batches)
) -> torch.Tensor:
    """V_φ(s_t) for every completion position t, s_t = (q, o_<t), read at position P-1+t, the one whose
    logits give log π(o_t) in sequence_logprobs (same padding, mask and positions), chunk by chunk in
    order of length. Returns values (N, T), 0 where completion_mask is 0, rows in the order given."""
    num_tokens = completion_ids.shape[1]  # T
    in_sequence = completion_mask if tool_mask is None else completion_mask + tool_mask  # (N, T) attended
    chunking = chunk_size, chunk_tokens
    order = torch.arange(len(prompt_ids), device=prompt_ids.device)  # one chunk: the rows as they come
    if not layout and (not chunk_size or len(prompt_ids) > chunk_size):  # whole groups, each trimmed (a sync)
        order = common.length_order(prompt_ids, prompt_mask, in_sequence)
    chunks = [(order, layout)] if layout else common.chunks_of(order, prompt_ids, prompt_mask, in_sequence, *chunking)
    values = []
    for rows, shape in chunks:  # no host sync in this loop: each chunk's shape was read before it
        chunk = common.trim_padding(prompt_ids[rows], prompt_mask[rows], completion_ids[rows], in_sequence[rows], shape)
        chunk_values = critic(*chunk, layout=shape)  # (n, t), t ≤ T the chunk's longest completion
        values.append(torch.nn.functional.pad(chunk_values, (0, num_tokens - chunk_values.shape[1])))  # (n, T)
    return torch.cat(values)[order.argsort()] * completion_mask.to(torch.float32)  # (N, T)


# ----------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: the sampler and scorer, steps 1-4's machinery and step 6's micro-batches; a reader
# may skip it: rollout() returns the Rollout above, sequence_logprobs() the log-probs the loss reads.


def rollout(
    policy,
    tokenizer,
    eos_ids: list[int],
    task,  # a rewards.Task: its prompts and its reward
    problems: list[dict],  # items of task.problems, one group each
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    amp=contextlib.nullcontext,
    max_turns: int = 0,
    max_tool_tokens: int = 0,
    tool_timeout: float = 0.0,
    tool_workers: int = 1,
) -> Rollout:
    """Steps 1-3 for a list of problems: each prompt through the chat template, G times; G completions
    of each from π_θold with the KV cache; each decoded and scored by the task's reward. temperature
    0 is greedy. With task.tools a completion may call them, up to max_turns times, their answers
    (at most max_tool_tokens a turn) in it as the environment's tokens (Rollout.tool_mask)."""
    device = next(policy.parameters()).device
    timer = time.perf_counter()
    conversations = [task.messages(problem) for problem in problems]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, conversations, group_size, device, task.tools)  # (n, P)
    tool_turn, tool_counts = None, None  # without tools: one turn, ended by an EOS or max_new_tokens
    if task.tools:
        limits = len(prompt_ids), max_turns, max_tool_tokens, tool_timeout, tool_workers
        tool_turn, tool_counts = tool_turns(tokenizer, task.tools, *limits)
    with amp():
        completion_ids, completion_mask, truncated, sample_logp, tool_mask = generate(
            policy, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
            pad_id=tokenizer.pad_token_id, vocab_size=len(tokenizer), temperature=temperature, top_p=top_p,
            tool_turn=tool_turn, max_turns=max_turns, max_tool_tokens=max_tool_tokens,
        )  # (n, T), (n, T), (n,), (n, T), (n, T)  # fmt: skip
    seconds = {"generate": time.perf_counter() - timer}
    timer = time.perf_counter()
    lengths = (completion_mask + tool_mask).sum(-1).tolist()  # the model's tokens and the tools' answers
    texts = tokenizer.batch_decode(
        [ids[:length] for ids, length in zip(completion_ids.tolist(), lengths)], skip_special_tokens=True
    )
    # A completion cut at max_new_tokens passes its truncation on: GSM8K's reward gives it 0.
    cut = truncated.tolist()
    scores = scored(task, texts, problems, group_size, cut, tool_turn)  # a reward may read the tools' state
    rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32, device=device)  # (n,)
    seconds["reward"] = time.perf_counter() - timer
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=truncated,
        sample_logp=sample_logp,
        rewards=rewards,
        texts=texts,
        scores=scores,
        seconds=seconds,
        tool_mask=tool_mask,
        tool_counts=tool_counts.to(device) if tool_counts is not None else None,
    )


def encode_prompts(tokenizer, conversations: list[list[dict]], group_size: int, device: torch.device, tools=()):
    """Chat-templated prompts (common.render_chat; the tools' schemas in them as the template writes
    them), left padded, each repeated G times in a row, so that rows i·G … i·G+G-1 are the group of
    prompt i. Returns prompt_ids, prompt_mask (N, P)."""
    texts = [common.render_chat(tokenizer, c, tools=list(tools) or None) for c in conversations]
    encoded = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    prompt_ids = encoded["input_ids"].repeat_interleave(group_size, dim=0).to(device)  # (N, P)
    prompt_mask = encoded["attention_mask"].repeat_interleave(group_size, dim=0).to(device)  # (N, P)
    return prompt_ids, prompt_mask


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,  # (N, P) left padded
    prompt_mask: torch.Tensor,  # (N, P) 1 for prompt tokens, 0 for padding
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    vocab_size: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    check_every: int | None = None,
    compact_below: float = 0.5,
    tool_turn=None,
    max_turns: int = 0,
    max_tool_tokens: int = 0,
):
    """Autoregressive sampling with a KV cache: one forward pass over the prompts, then one
    single-token pass per new token. temperature 0 is greedy; only ids below vocab_size are sampled.
    A completion ends with its first EOS, which is part of it (it teaches the model to stop). Returns
      completion_ids  (N, T) T ≤ max_new_tokens (with tools, + their answers), right padded with pad_id
      completion_mask (N, T) 1 at the model's own tokens, up to and including the EOS
      truncated       (N,)   True where no EOS came within max_new_tokens
      sample_logp     (N, T) log π(token) under the sampling distribution, before top-p, 0 where masked
      tool_mask       (N, T) 1 at the tokens a tool turn put in
    Tools: a row whose turn ends hands its ids to tool_turn(row, ids): the environment's tokens, a Future of them
    (it waits in place till they land: ToolQueue.held) or None (it ends); it takes them one a step, forced."""
    was_training = model.training
    model.eval()  # no dropout, and gradient checkpointing (train-mode only) keeps the cache
    device = prompt_ids.device
    cuda = device.type == "cuda"
    if cuda and device.index != torch.cuda.current_device():  # streams and graphs go to the current device
        raise ValueError(f"generate on {device} while cuda:{torch.cuda.current_device()} is current: set_device first")
    num_rows, prompt_length = prompt_ids.shape  # N, P
    steps = max_new_tokens + (max_turns * max_tool_tokens if tool_turn else 0)  # columns a completion may fill
    eos = torch.tensor(eos_ids, device=device)
    cache = KVCache(num_rows, prompt_length + max_new_tokens)  # columns for tools' answers as they come (grow)
    check_every = check_every or (16 if cuda else 1)

    # 1. Prefill each distinct prompt once (B rows), then copy its keys and values to its G rows.
    distinct, counts = torch.unique_consecutive(torch.cat([prompt_ids, prompt_mask], -1), dim=0, return_counts=True)
    distinct_ids, distinct_mask = distinct[:, :prompt_length], distinct[:, prompt_length:]  # (B, P)
    # Positions count real tokens only (left padding shifts prompts): a prompt scores the same in any batch.
    position_ids = (distinct_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    cache.slots, cache.width = torch.arange(prompt_length, device=device), prompt_length
    with common.fp32_lm_head(model):
        out = model(
            input_ids=distinct_ids,
            attention_mask=common.prefill_mask(model, distinct_mask, prompt_length + steps),  # causal, padding hidden
            position_ids=position_ids,
            **{common.cache_argument(model): cache},
            use_cache=True,
            logits_to_keep=1,
        )
    cache.repeat_rows(counts)
    logits = out.logits[:, -1, :vocab_size].float().repeat_interleave(counts, dim=0, output_size=num_rows)  # (N, V)

    # 2. The one-token step: each row's last token at its next column, through the cache.
    position = position_ids[:, -1:].repeat_interleave(counts, dim=0, output_size=num_rows) + 1  # (N, 1)
    step = common.DecodeStep(model, cache, prompt_mask, position, steps, pad_id, vocab_size)
    completion_ids = torch.full((num_rows, steps + 1), pad_id, device=device)  # (N, steps + 1)
    completion_mask = torch.zeros(num_rows, steps + 1, dtype=torch.long, device=device)
    tool_mask = torch.zeros_like(completion_mask)
    sample_logp = torch.zeros(num_rows, steps + 1, device=device)  # + 1: where finished rows write their pads
    filled = torch.zeros(num_rows, dtype=torch.long, device=device)  # (N,) the columns each row has filled
    finished = torch.zeros(num_rows, dtype=torch.bool, device=device)  # (n,) of the rows decoded
    truncated = torch.zeros(num_rows, dtype=torch.bool, device=device)  # (N,) set as rows finish without an EOS
    env = ToolQueue.empty(num_rows, max_tool_tokens, pad_id, device) if tool_turn else None  # forced tokens
    rows = torch.arange(num_rows, device=device)  # (n,) the row of the output each decoded row is
    rng_states = []  # rng_states[t]: the state of the random generator before token t was drawn
    draw = common.compiled_for(model, sample)  # --compile: through torch.compile
    # 3. Decode, one token a step for every unfinished row.
    for t in itertools.count():
        # logit − logsumexp, as sequence_logprobs scores, not F.log_softmax (biased on the CPU: docs/metrics.md)
        if temperature > 0:
            rng_states.append(torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state())
            token, token_logp = draw(logits if temperature == 1.0 else logits / temperature, top_p)  # (n,), (n,)
        else:  # greedy: the log-probability of the chosen token only, no (n, V) log-softmax
            token = logits.argmax(dim=-1)  # (n,)
            token_logp = logits.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (n,)
        alive = ~finished
        moved = sampled = alive  # (n,) the rows that fill a column; those whose token is the model's own
        at = filled[rows]  # (n,) the column each row fills next
        if env is not None:  # a row in a tool turn takes the environment's next token; one awaiting it, none
            moved = alive & ~env.held(rows, filled, alive, t, step.holds)
            forced = moved & (env.queued > 0)  # (n,)
            token = torch.where(forced, env.ids.gather(1, env.next[:, None]).squeeze(-1), token)
            tool_mask[rows, at] = forced.long()
            sampled = moved & ~forced
            env.next = (env.next + forced.long()).clamp(max=max_tool_tokens - 1)
            env.queued -= forced.long()
            env.spent += sampled.long()
        completion_ids[rows, at] = torch.where(moved, token, pad_id)
        completion_mask[rows, at] = sampled.long()
        sample_logp[rows, at] = torch.where(sampled, token_logp, 0.0)
        filled[rows] += moved.long()
        ended = sampled & torch.isin(token, eos)  # (n,) the row's turn ends here
        if env is not None:  # a turn that called a tool goes on with its answers; a row out of budget stops
            ended = tool_turns_due(env, ended, completion_ids, rows, filled, t, tool_turn, max_new_tokens)
            out_of_budget = alive & ~ended & (env.spent >= max_new_tokens)
            truncated[rows] |= out_of_budget
            ended |= out_of_budget
        finished = finished | ended
        if t >= steps - 1 + (int(env.waits.max()) if env is not None and t >= steps - 1 else 0):  # all filled
            break
        if (t + 1) % check_every == 0:  # the only host syncs
            live = (~finished).nonzero().squeeze(-1)  # (n',)
            if len(live) == 0:
                break
            if len(live) <= compact_below * len(rows):  # the finished rows leave the batch
                rows, finished, token, moved = rows[live], finished[live], token[live], moved[live]
                env = env.keep(live) if env is not None else None
                step.keep(live)  # its buffers and the cache
        logits = step(token, t, None if env is None else ~moved)  # (n, V) the next logits; held rows stay
    # 4. Cut to the longest completion; the random draws past its EOS never happened.
    model.train(was_training)
    truncated[rows] |= ~finished  # the rows still decoded at the last step; those that left had ended
    num_tokens = filled.max().item()  # T: the longest completion, its EOS included
    drawn = num_tokens if env is None else (filled + env.waits).max().item()  # the steps to the last token
    if drawn < len(rng_states):  # tokens were drawn past the last EOS: as if they never were
        torch.cuda.set_rng_state(rng_states[drawn], device) if cuda else torch.set_rng_state(rng_states[drawn])
    cut = slice(0, num_tokens)
    return (
        completion_ids[:, cut].contiguous(),
        completion_mask[:, cut].contiguous(),
        truncated,
        sample_logp[:, cut].contiguous(),
        tool_mask[:, cut].contiguous(),
    )


def sample(scaled: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(scaled) (top-p: from its nucleus), and its log-prob before top-p.
    The exponential race: with E ~ Exp(1) per id, argmax(log π − log E) is distributed as π; it takes
    the random numbers torch.multinomial takes, without its checks. Non-finite logits stop the run.
    scaled (n, V) -> token (n,), log-prob (n,)."""
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (n, 1)
    torch._assert_async(lse.isfinite().all(), "generate: a row's logits are NaN or infinite (diverged weights?)")
    logp = scaled - lse  # (n, V)
    keys = logp if top_p >= 1.0 else logp.masked_fill(top_p_filter(logp.exp(), top_p) == 0, float("-inf"))
    noise = torch.empty_like(logp).exponential_()  # (n, V) E ~ Exp(1)
    token = (keys - noise.log_()).argmax(dim=-1)  # (n,)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes the tail of each row outside the smallest set of tokens whose mass reaches
    top_p (Holtzman et al. 2020). probs (N, V) -> (N, V), unnormalised."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked higher
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


class KVCache:
    """The keys and values of every layer for N rows and S = P + max_new_tokens columns, allocated
    once and written in place: attention calls update() with the new tokens' keys and values and
    attends over what it returns; generate sets the columns they go to (slots) and how many it reads
    (width). Left-aligned on a GPU (align_left): row i's prompt in its first columns, then its tokens."""

    def __init__(self, rows: int, length: int):
        self.rows, self.length = rows, length  # N, S
        self.keys, self.values = [], []  # a (N, kv heads, S, head dim) buffer per layer
        self.slots = None  # (q,) the columns the next forward pass writes: 0 … P-1, then one per token
        self.width = length  # the columns attention reads: 0 … width-1
        self.aligned = False  # align_left: each row from column 0, slots one a row
        self.row_index = None  # align_left: (n,) 0 … n-1, the rows slots index

    # Whatever else a release passes (5.24: kwargs=...; before: cache_kwargs) is not needed here:
    # the columns come from slots, the positions from the model's own position_ids.
    def update(self, keys, values, layer: int, *unused, **unused_named):  # keys, values (n, kv heads, q, head dim)
        # Indexing (index_put_) the whole buffer: compiled, TorchInductor writes the new columns in place,
        # where index_copy_, scatter_ or a slice of the rows copied the layer's whole cache every step.
        if self.aligned:  # one token a row, row i's to its own column slots[i]; attention reads all S
            at = (self.row_index, self.slots)  # (n,), (n,): buffer[i, slots[i]] is (kv heads, d)
            self.keys[layer].index_put_(at, keys[:, :, 0].to(values.dtype))
            self.values[layer].index_put_(at, values[:, :, 0])
            return self.keys[layer].transpose(1, 2), self.values[layer].transpose(1, 2)  # (n, kv heads, S, d)
        if layer == len(self.keys):  # the first pass allocates, from the shapes and dtype it brings
            shape = (self.rows, keys.shape[1], self.length, keys.shape[3])
            self.keys.append(values.new_zeros(shape))
            self.values.append(values.new_zeros(shape))
        rows = keys.shape[0]  # the prefill runs on the distinct prompts only: the first rows
        at = (slice(None) if rows == self.rows else slice(rows), slice(None), self.slots)  # (rows, kv heads, q)
        self.keys[layer][at] = keys.to(values.dtype)
        self.values[layer][at] = values
        return self.keys[layer][:rows, :, : self.width], self.values[layer][:rows, :, : self.width]

    def align_left(self, prompt_mask: torch.Tensor) -> None:
        """After the prefill of these prompts (N, P) (1 at a prompt's tokens, 0 at its padding):
        each row's keys and values move to columns 0 … len-1, in their order, into (N, S, kv heads,
        head dim) buffers (one layer's copy at a time), and row i writes its next token at column len_i."""
        order = prompt_mask.argsort(dim=-1, descending=True, stable=True)  # (N, P) the prompt's columns first
        after = torch.arange(prompt_mask.shape[1], self.length, device=order.device).expand(len(order), -1)
        source = torch.cat([order, after], dim=-1)[:, :, None, None]  # (N, S, 1, 1) the column each comes from
        for buffers in (self.keys, self.values):
            for layer, buffer in enumerate(buffers):  # (N, kv heads, S, head dim) -> (N, S, kv heads, head dim)
                moved = buffer.transpose(1, 2)
                buffers[layer] = moved.gather(1, source.expand(-1, -1, *moved.shape[2:]))
        self.slots, self.aligned = prompt_mask.sum(-1), True
        self.row_index = torch.arange(len(order), device=order.device)  # (N,)

    def repeat_rows(self, counts: torch.Tensor) -> None:
        """After the prefill: the first len(counts) rows, row i repeated counts[i] times, fill all N."""
        for buffer in self.keys + self.values:
            buffer.copy_(buffer[: len(counts)].repeat_interleave(counts, dim=0, output_size=self.rows))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Saves the decode work of finished rows: only these rows (n,) stay, in new, smaller buffers."""
        self.keys = [buffer[rows] for buffer in self.keys]
        self.values = [buffer[rows] for buffer in self.values]
        self.rows = len(rows)
        if self.aligned:
            self.slots, self.row_index = self.slots[rows], self.row_index[: len(rows)]


def token_logprobs(logits, tokens, scale: float, vocab_size: int, with_entropy: bool, entropy_grad: bool):
    """log π(token) = logit/τ − logsumexp(logits/τ) over the tokenizer's ids, and the entropy
    H = logsumexp − Σ_v π_v · logit_v/τ (0 without with_entropy; differentiable only with
    entropy_grad, so that no softmax is kept for a backward pass that does not need it).
    logits (…, V'), tokens (…) -> (…, 2): log π and H, fp32."""
    logits = logits[..., :vocab_size].float()  # (…, V) a view, fp32 from the head (a no-op .float())
    if scale != 1.0:  # τ = 1 divides by nothing (x / 1 is x, bit for bit)
        # in place where no backward runs through it (no second fp32 copy); else a new tensor: in place on
        # a view of the head's output, backward would copy the whole logits (autograd's CopySlices)
        logits = logits / scale if logits.requires_grad else logits.div_(scale)
    log_normaliser = torch.logsumexp(logits, dim=-1)  # (…)
    logp = logits.gather(-1, tokens[..., None]).squeeze(-1) - log_normaliser  # (…)
    entropy = torch.zeros_like(logp)
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropy = log_normaliser - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # (…)
    return torch.stack([logp, entropy], dim=-1)  # (…, 2)


# ----------------------------------------------------------------------------------------
# Scoring: log-probs of the sampled tokens, each prompt forwarded once per group


def old_and_ref_logprobs(policy, reference, batch: Rollout, args, vocab_size: int, amp, score_policy: bool):
    """Step 4, no grad: log π_θold, its entropy and log π_ref of every sampled token (N, T) each; None
    for a missing reference, and for π_θold when score_policy is False (on-policy: policy_backward
    records them)."""
    sequences = batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
    old_logp, entropy, ref_logp = None, None, None
    policy.eval()  # same mode as sampling (matters for models with dropout)
    chunking = {"chunk_tokens": args.logprob_chunk_tokens, "tool_mask": batch.tool_mask}
    with torch.no_grad(), amp():
        if score_policy:
            old_logp, entropy = sequence_logprobs(
                policy, *sequences, args.temperature, vocab_size, args.logprob_chunk_size, with_entropy=True, **chunking
            )  # (N, T), (N, T)
        if reference is not None:
            ref_logp, _ = sequence_logprobs(
                reference, *sequences, args.temperature, vocab_size, args.logprob_chunk_size, **chunking
            )  # (N, T)
    policy.train()
    return old_logp, entropy, ref_logp


def sequence_logprobs(
    model,
    prompt_ids: torch.Tensor,  # (N, P)
    prompt_mask: torch.Tensor,  # (N, P)
    completion_ids: torch.Tensor,  # (N, T)
    completion_mask: torch.Tensor,  # (N, T)
    temperature: float,
    vocab_size: int,
    chunk_size: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = 0,
    tool_mask: torch.Tensor | None = None,  # (N, T) the tools' answers: in the sequence, not scored
    layout: "common.Layout | None" = None,  # the rows as one chunk, its Layout read by the caller (micro_batches)
):
    """log π(o_t | q, o_<t) of every completion token from logits / temperature, as `generate` sampled
    them (token_logprobs). The runtime lays out the passes (common.chunks_of, forward_completions:
    each prompt once per group) and reads the head a chunk at a time (common.logprob_head); rows come
    back in their order. Returns logp (N, T) and the entropy (N, T) or None, 0 where completion_mask
    is 0; the entropy has a gradient only with entropy_grad."""
    num_tokens = completion_ids.shape[1]  # T
    scale = temperature if temperature > 0 else 1.0
    in_sequence = completion_mask if tool_mask is None else completion_mask + tool_mask  # (N, T) attended
    chunking = chunk_size, chunk_tokens
    order = torch.arange(len(prompt_ids), device=prompt_ids.device)  # one chunk: the rows as they come
    if not layout and (not chunk_size or len(prompt_ids) > chunk_size):  # whole groups of similar length (a sync)
        order = common.length_order(prompt_ids, prompt_mask, in_sequence)
    chunks = [(order, layout)] if layout else common.chunks_of(order, prompt_ids, prompt_mask, in_sequence, *chunking)
    scored = []
    for rows, shape in chunks:  # no host sync in this loop: each chunk's shape was read before it
        chunk = common.trim_padding(prompt_ids[rows], prompt_mask[rows], completion_ids[rows], in_sequence[rows], shape)
        kept = chunk[2].shape[1]  # t ≤ T: the chunk's longest completion
        # fp32 logits, as generate's; position p-1+j predicts token j
        head = common.logprob_head(model, token_logprobs, chunk[2], scale, vocab_size, with_entropy, entropy_grad)
        with common.fp32_lm_head(model), head as read:
            out = read(
                common.forward_completions(model, *chunk, layout=shape)
            )  # (n, t, 2): log π and entropy of each token
        scored.append(torch.nn.functional.pad(out, (0, 0, 0, num_tokens - kept)))  # (n, T, 2)
    unsort = order.argsort()  # the rows back in the order they came in
    logp, entropy = (torch.cat(scored)[unsort] * completion_mask[..., None]).unbind(-1)  # (N, T) each
    return (logp, entropy) if with_entropy else (logp, None)


def micro_batches(batch: dict, size: int, tokens: int = 0):
    """The rows of a mini-batch (a dict of (n, …) tensors, None kept as None) in micro-batches of
    `size` rows, or of about `tokens` tokens, rows of similar length and a group's rows together
    (common.chunks_of). Yields (rows (m,), micro): the micro-batch's indices in `batch`, and its
    tensors with micro["layout"], its common.Layout, read for every micro-batch before the first."""
    in_sequence = batch["completion_mask"]  # (n, T) the model's tokens, and the tools' answers it attends to
    if batch.get("tool_mask") is not None:
        in_sequence = in_sequence + batch["tool_mask"]
    order = common.length_order(batch["prompt_ids"], batch["prompt_mask"], in_sequence)  # (n,)
    for rows, layout in common.chunks_of(order, batch["prompt_ids"], batch["prompt_mask"], in_sequence, size, tokens):
        yield rows, {k: v[rows] if v is not None else None for k, v in batch.items()} | {"layout": layout}


# ----------------------------------------------------------------------------------------
# Argument checks: a setting that cannot work stops before anything loads.


def check_args(args: Args) -> None:
    """Stops with a message on settings that cannot work, before anything is loaded."""
    problems = common.check_run_args(args, "ppo")
    if args.num_mini_batches < 1 or (args.batch_size * args.group_size) % args.num_mini_batches:
        rows = args.batch_size * args.group_size
        problems.append(
            f"--num_mini_batches must be at least 1 and divide batch_size * group_size ({args.batch_size} × "
            f"{args.group_size} = {rows} rows; got {args.num_mini_batches}): e.g. --num_mini_batches 1."
        )
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        problems.append("Training needs --temperature > 0 and 0 < --top_p <= 1.")
    if args.critic_lr is not None and not args.critic_lr > 0:
        problems.append(f"--critic_lr must be > 0 (got {args.critic_lr}); the critic learns from scratch: ~10× --lr.")
    if args.dual_clip and args.dual_clip <= 1:
        problems.append("--dual_clip must be > 1 (e.g. 3), or 0 to disable it.")
    for name in ("gamma", "lam_actor", "lam_critic"):
        if not 0 <= getattr(args, name) <= 1:
            problems.append(f"--{name} must be between 0 and 1.")
    if not 0 <= args.eps_low < 1 or args.eps_high < 0:
        problems.append(
            "Clip ranges need 0 <= --eps_low < 1 and --eps_high >= 0 (PPO: 0.2 and 0.2; VAPO: 0.2 and 0.28)."
        )
    if args.pos_lm_coef < 0:
        problems.append(f"--pos_lm_coef must be >= 0 (got {args.pos_lm_coef}); VAPO uses 0.1.")
    if args.tis_cap and args.tis_cap < 1:
        problems.append(f"--tis_cap must be >= 1, or 0 to disable it (got {args.tis_cap}); Yao et al. use 2.")
    problems += common.check_is_mask(args)
    for name in ("eps_value", "lam_alpha", "whiten_eps"):
        if getattr(args, name) <= 0:
            problems.append(f"--{name} must be > 0.")
    for name in ("beta", "entropy_coef", "value_warmup_steps"):
        if getattr(args, name) < 0:
            problems.append(f"--{name} must be >= 0.")
    if args.value_warmup_steps >= args.max_steps > 0:
        problems.append("--value_warmup_steps must be below --max_steps, or the policy never learns.")
    for name in ("batch_size", "group_size", "max_new_tokens", "ppo_epochs"):
        if getattr(args, name) < 1:
            problems.append(f"--{name} must be at least 1.")
    if args.resume_from and not (Path(args.resume_from) / CRITIC_DIR / VALUE_HEAD_FILE).exists():
        problems.append(
            f"--resume_from {args.resume_from} has no {CRITIC_DIR}/{VALUE_HEAD_FILE}: not a ppo.py checkpoint."
        )
    if problems:
        raise SystemExit(common.said_once("Invalid arguments:\n  " + "\n  ".join(problems)))  # once a node


if __name__ == "__main__":
    try:
        train(common.parse_args(Args))
    except KeyboardInterrupt:  # during set-up, before the first step
        raise SystemExit("Interrupted before the first training step: nothing to resume.") from None
