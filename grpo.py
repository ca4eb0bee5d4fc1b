"""GRPO: Group Relative Policy Optimization, one self-contained training loop.

For every prompt, sample a group of G completions, score each with a rule-based reward, and
use the reward's deviation from its group's mean as the advantage of every token of that
completion: no critic. The policy maximises a PPO-style clipped objective with a k3 KL
penalty to a frozen reference, averaged per completion and then over completions.

The loop of train(), one numbered comment per step (the README draws the same box):
  1. sample B prompts, each repeated G times                      prompt_indices, rollout
  2. generate o_i ~ π_θold(·|q) with the KV cache                  generate
  3. score R_i = reward(o_i, q) with the task's rule               rewards.py
  4. log π_θold(o_i,t) and log π_ref(o_i,t), no grad               old_and_ref_logprobs
  5. Â_i = (R_i − mean(R_group)) / (std(R_group) + ε)              group_advantages
  6. μ times over shuffled mini-batches of whole groups: the loss −J of DAPO Eq. 5, backward
     micro-batch by micro-batch, clip the gradient norm, AdamW       grpo_loss, policy_backward
  7-9. held-out accuracy when due, the metrics row, a checkpoint   common.Run.end_step
Deliberate departures: the mean over the whole mini-batch's completions (1/N, not 1/G per group:
the same when every group is whole), so gradient accumulation is exact; on-policy (μ = 1, one
mini-batch) the ratio is exactly 1 and π_θold is not scored separately (on_policy).

Papers (equation numbers as cited in the code):
  GRPO      Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, Eq. 3-4; as restated by DAPO
            (Yu et al. 2025, arXiv 2503.14476), Eq. 4-6.
  Dr. GRPO  Liu et al. 2025, arXiv 2503.20783, Sec. 3.1 (no std, constant normaliser).
  GSPO      Zheng et al. 2025, arXiv 2507.18071, Eq. 5-7 (sequence-level ratio).
  GPG       Chu et al. 2025, arXiv 2504.02546 (Â = α·(R − mean)).
  CISPO     MiniMax-M1, arXiv 2506.13585, Eq. 4-5 (the clipped IS weight).
  Others    dual-clip, T1's entropy bonus and moving reference, TIS, IcePop, SAPO, DPPO, Clip/KL-Cov,
            OPSM: each cited at its function, after train(); docs/techniques.md compares them.
  Defaults  marked "seed study": PPO, GRPO and DAPO on Countdown with Qwen2.5-1.5B-Instruct,
            arXiv 2512.07611.

Run:
  python grpo.py --model Qwen2.5-1.5B-Instruct                 # one GPU, Countdown
  python grpo.py --model tiny --max_steps 20                   # CPU smoke run, no download
  python grpo.py --model tiny --task digit --lr 3e-3 --max_new_tokens 8 --max_steps 40  # CPU, the reward rises
  torchrun --nproc_per_node 8 grpo.py --model Qwen2.5-7B-Instruct             # 8 GPUs, FSDP2: docs/distributed.md
Shape letters in comments: B prompts per step · G completions per prompt · N = B·G sequences · n rows of a
  micro-batch or of one rollout() · P prompt tokens (left padded) · T completion tokens (right padded) ·
  V vocabulary (the tokenizer's, not the embedding's padded size)
"""

import contextlib
import functools
import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import common
from common import RunArgs, arg
from rewards import Score, TaskArgs, ToolQueue, heldout_task, scored, tool_turns, tool_turns_due, training_task


@dataclass
class Args(RunArgs, TaskArgs):
    # The algorithm's hyperparameters; --help lists the shared flags after them (common.RunArgs, rewards.TaskArgs).
    # the GRPO objective
    loss_type: str = arg("grpo", "grpo (sample-level mean), dr_grpo, gspo, gpg, cispo, sapo, dppo, clip_cov, kl_cov")
    eps: float = arg(0.2, "ε, clip range of the token ratio, DAPO Eq. 5 (grpo, dr_grpo)")
    gspo_eps_low: float = arg(3e-4, "ε_low of GSPO's sequence ratio, GSPO Eq. 5")
    gspo_eps_high: float = arg(4e-4, "ε_high of GSPO's sequence ratio, GSPO Eq. 5")
    cispo_eps_low: float = arg(1.0, "ε_low^IS: CISPO's weight ≥ 1 − ε_low^IS, MiniMax-M1 Eq. 5; 1 = no lower bound")
    cispo_eps_high: float = arg(3.0, "ε_high^IS, CISPO's weight ≤ 1 + ε_high^IS, MiniMax-M1 Eq. 5 (3: a cap of 4)")
    beta: float = arg(0.01, "β, KL coefficient, DAPO Eq. 5 (seed study optimum ~0.0075-0.01); 0 = no reference")
    scale_rewards: str = arg("", "Â's scale: group (std), batch (Lite PPO), mean (MaxRL), none; '': dr_grpo's none")
    adv_eps: float = arg(1e-6, "added to Â's scale (the group std, DAPO Eq. 6; verl's value, TRL uses 1e-4)")
    dppo_delta: float = arg(0.2, "δ of DPPO's Binary-TV region |π_θ − π_sampler| (arXiv 2602.04879)")
    dppo_ratio_cap: float = arg(20.0, "C, the cap of DPPO's detached ratio min(r, C) (verl: 3; docs/techniques.md)")
    dppo_type: str = arg("binary_tv", "DPPO's divergence: binary_tv (|p − q| > δ) or binary_kl (Bernoulli KL > δ_KL)")
    dppo_kl_delta: float = arg(0.05, "δ_KL of DPPO's Binary-KL region (--dppo_type binary_kl; the paper's 0.05)")
    kl_tau: float = arg(0.0, "τ of Kimi K2.5's penalty τ·(log π_θ − log π_sampler)² per token (prime-rl: 1e-3)")
    clip_cov_ratio: float = arg(2e-4, "r, Clip-Cov's share of tokens whose gradient is cut (arXiv 2505.22617)")
    clip_cov_bounds: str = arg("1,5", "ω_low,ω_high: Clip-Cov cuts only tokens whose covariance lies in this band")
    kl_cov_ratio: float = arg(2e-4, "k, KL-Cov's share of tokens, of largest covariance, that get its penalty")
    kl_cov_coef: float = arg(1.0, "β of KL-Cov's penalty β·|log π_θ − log π_θold| on its tokens (--loss_type kl_cov)")
    sapo_tau_pos: float = arg(1.0, "τ_pos of SAPO's gate σ(τ(r − 1))·4/τ for Â > 0 (arXiv 2511.20347)")
    sapo_tau_neg: float = arg(1.05, "τ_neg of SAPO's gate for Â < 0 (the paper's: a little steeper than τ_pos)")
    dual_clip: float = arg(0.0, "c of dual-clip PPO (Ye et al. Eq. 4), > 1 to enable (verl: 3); 0 = off")
    entropy_coef: float = arg(0.0, "c_H, T1's entropy bonus: the loss minus c_H·H(π_θ) per token; 0 = off")
    top_entropy_quantile: float = arg(1.0, "ρ: the top-ρ share of tokens by π_θold's entropy keep the gradient")
    off_policy_mask_threshold: float = arg(0.0, "δ, DeepSeek-V3.2's masking of Â < 0 completions off by > δ")
    unbiased_kl: bool = arg(False, "DeepSeek-V3.2's KL estimate k3·π_θ/π_θold, the ratio not detached")
    ref_ema_decay: float = arg(0.0, "λ, T1's moving π_ref ← λ·π_ref + (1−λ)·π_θ after each optimizer step; 0 = frozen")
    tis_cap: float = arg(0.0, "C, truncated IS: each token's policy-gradient term × min(π_θold/π_sampler, C); 0 = off")
    is_mask: str = arg("", "α,β of masked IS (IcePop): a token with π_θold/π_sampler outside [α, β] leaves the loss")
    is_mask_level: str = arg("token", "token (IcePop's M per token) or sequence (the geometric mean of a completion's)")
    # sampling
    batch_size: int = arg(32, "B, prompts per step")
    group_size: int = arg(8, "G, completions per prompt (seed study: 8 beats 2 and 4)")
    max_new_tokens: int = arg(1024, "completion cap; every completion longer is truncated")
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same one")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 samples the whole distribution")
    # optimisation
    lr: float | None = arg(None, "learning rate; unset: 1e-6 (seed study: 1e-6 to 3e-6), 1e-5 with LoRA")
    warmup_steps: int = arg(0, "linear learning-rate warm-up, in steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    adam_beta2: float = arg(0.999, "AdamW β2")
    max_grad_norm: float = arg(1.0, "gradient clipping by global norm")
    num_iterations: int = arg(1, "μ, GRPO iterations over each batch (DeepSeekMath Alg. 1)")
    num_mini_batches: int = arg(1, "optimizer steps per iteration; N must split evenly")
    # run
    max_steps: int = arg(500, "training steps (one batch of B·G completions each)")


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
# ALGO LOGIC: the group-relative advantage, the KL penalty, the GRPO loss and its backward pass


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6):
    """GRPO's outcome advantage, DeepSeekMath Sec. 4.1.2 / DAPO Eq. 6:
        Â_i = (R_i − mean(R_1..R_G)) / (std(R_1..R_G) + eps), the same for every token of o_i.
    std is the unbiased (Bessel-corrected) one, as in verl and TRL. A group whose rewards are
    all equal gets Â = 0 (0 / eps), never NaN. Dr. GRPO (scale_by_std=False) drops the
    division, which otherwise up-weights groups that are nearly all right or all wrong.
    rewards (N,) with groups in consecutive rows -> advantages (N,)."""
    grouped = rewards.view(-1, group_size)  # (B, G)
    centered = grouped - grouped.mean(dim=-1, keepdim=True)
    if scale_by_std:
        centered = centered / (grouped.std(dim=-1, keepdim=True) + eps)
    return centered.flatten()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(π_θ ‖ π_ref) per token (Schulman 2020; DeepSeekMath Eq. 4):
        π_ref/π_θ − log(π_ref/π_θ) − 1, unbiased under samples of π_θ and never negative.
    logp, ref_logp (…, T) -> (…, T)."""
    # e^20 ≈ 5e8: finite. verl clamps at ±20 too, then caps k3 at 10; uncapped here: the whole gradient.
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(log_ratio) - log_ratio - 1


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """PPO's clipped surrogate per token (PPO Eq. 7; DAPO Eq. 10 with ε_low and ε_high):
        min(r·Â, clip(r, 1 − ε_low, 1 + ε_high)·Â)
    the pessimistic bound: once r has moved past the clip in the direction Â pushes it, the token
    gets no gradient, so one batch cannot drag π_θ far from π_θold.
    ratio (n, T), advantages (n, 1) or (n, T) -> (n, T)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    return torch.min(unclipped, clipped)


def clip_range(args: Args) -> tuple[float, float]:
    """(ε_low, ε_high) of the clip that --loss_type uses: ε on both sides (grpo, dr_grpo; DAPO
    Eq. 5), GSPO's own tiny ones for its sequence ratio (GSPO Eq. 5), CISPO's ε^IS for its weight."""
    return {
        "gspo": (args.gspo_eps_low, args.gspo_eps_high),
        "cispo": (args.cispo_eps_low, args.cispo_eps_high),
    }.get(args.loss_type, (args.eps, args.eps))


def grpo_loss(
    logp: torch.Tensor,  # (n, T) log π_θ, with grad
    old_logp: torch.Tensor,  # (n, T) log π_θold, recorded before the first update
    ref_logp: torch.Tensor | None,  # (n, T) log π_ref; None when beta = 0
    advantages: torch.Tensor,  # (n,) Â_i
    loss_mask: torch.Tensor,  # (n, T) completion_mask, less the tokens --is_mask drops
    args: Args,
    *,
    num_sequences: int,  # N: completions with a token in loss_mask, in the whole mini-batch
    num_tokens: int,  # Σ_i |o_i| over the whole mini-batch (the token-level normaliser)
    **terms,  # (n, T) each, or None: entropy, is_weight, policy_mask, cov_tokens, sample_logp (corrected)
):
    """The negative GRPO objective of one micro-batch, DAPO Eq. 5:
        J = 1/G Σ_i 1/|o_i| Σ_t [ min(r_it Â_i, clip(r_it, 1−ε, 1+ε) Â_i) − β D_KL,it ],  r_it = π_θ / π_θold
    with N (num_sequences) for G: the mean over the mini-batch's completions, not the micro-batch's,
    so gradient accumulation is exact. Variants enter through one function each, after train():
    variant_objective, corrected, kl_estimate, aggregate. Returns (loss, stats over loss_mask's tokens)."""
    mask = loss_mask.to(logp.dtype)  # (n, T)
    adv = advantages[:, None]  # (n, 1) Â_i, the same for every token of o_i
    ratio = torch.exp((logp - old_logp) * mask)  # (n, T) r_it
    if args.loss_type in CLIPPED:
        objective, cut = clipped_surrogate(ratio, adv, args.eps, args.eps), None  # (n, T) min(r·Â, clip(r)·Â)
    else:
        objective, ratio, cut = variant_objective(logp, old_logp, ratio, adv, mask, args, terms)  # (n, T)
    objective, dual_clipped = corrected(objective, adv, args, terms)  # dual-clip, IS weights, masks, entropy
    kl = kl_estimate(logp, old_logp, ref_logp, mask, args)  # (n, T) D_KL,it
    per_token = -objective + args.beta * kl if args.beta > 0 else -objective  # (n, T) −[objective − β·D_KL]
    if args.kl_tau > 0:  # Kimi K2.5's penalty τ·(log π_θ − log μ)²
        per_token = per_token + args.kl_tau * squared_log_ratio(logp, sampler_logp(terms, old_logp), mask)
    loss = aggregate(per_token, mask, args, num_sequences, num_tokens)  # 1/N Σ_i 1/|o_i| Σ_t, sample-level
    cispo, is_weight = args.loss_type == "cispo", terms.get("is_weight")
    stats = common.loss_stats(ratio, adv, loss_mask, *clip_range(args), dual_clipped, kl, is_weight, cispo, cut)
    return loss, stats


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, args: Args, num_sequences: int, num_tokens: int):
    """The per-token losses (n, T) summed into the micro-batch's share of the loss, over the
    normaliser --loss_type chooses:
      grpo, gspo   1/N Σ_i 1/|o_i| Σ_t      sample-level: each completion weighs 1/N (DAPO Eq. 5)
      dr_grpo      1/(N·L_max) Σ_i Σ_t       a constant, L_max = --max_new_tokens: a long wrong answer
                                             is not penalised less per token (Dr. GRPO Sec. 3.1)
      gpg, cispo   1/Σ_i|o_i| Σ_i Σ_t        token-level, each paper's own (GPG's loss; MiniMax-M1 Eq. 4)
    N and Σ_i|o_i| count the whole mini-batch (policy_backward), |o_i| the row's tokens in mask."""
    if args.loss_type == "dr_grpo":
        return (per_token * mask).sum() / (num_sequences * args.max_new_tokens)
    if args.loss_type in ("gpg", "cispo"):
        if num_tokens < 1:
            raise ValueError(f"loss_type {args.loss_type} needs num_tokens, the valid tokens of the whole mini-batch")
        return (per_token * mask).sum() / num_tokens
    lengths = mask.sum(-1).clamp(min=1)  # (n,) |o_i|
    return ((per_token * mask).sum(-1) / lengths).sum() / num_sequences


def scores_needed(args: Args) -> bool:
    """Whether the update needs step 4's π_θold log-probs and entropy before it starts, even on-policy:
    --is_mask counts what stays; --top_entropy_quantile, clip_cov and kl_cov rank the mini-batch's tokens."""
    return bool(args.is_mask) or args.top_entropy_quantile < 1 or args.loss_type in ("clip_cov", "kl_cov")


def on_policy(args: Args) -> bool:
    """True when the batch trains one update (μ = 1 and one mini-batch): π_θold is then the π_θ of
    that update's forward pass, before its optimizer step, which step 4 need not score."""
    return args.num_iterations == 1 and args.num_mini_batches == 1


def policy_backward(policy, batch: dict, args: Args, vocab_size: int, amp=contextlib.nullcontext) -> tuple[dict, dict]:
    """Step 6's forward and backward over one mini-batch, micro-batch by micro-batch; gradients
    accumulate in .grad. batch holds (n, …) tensors (prompt_ids … advantages; old_logp None when
    on-policy). amp() is the forward's autocast context. Returns (totals, recorded): the summed loss
    and token statistics, and, on-policy, this pass's log π_θ and entropy (n, T), no grad, standing
    in for step 4's. On-policy old = sg(log π_θ) makes the ratio exactly 1 with gradient ∇log π_θ,
    where recorded log-probs would differ by bf16 noise that GSPO's ε ≈ 3e-4 clips."""
    loss_mask, totals = masked_importance(batch, batch["completion_mask"], args)  # (n, T): less what --is_mask drops
    # The whole mini-batch's sequences and tokens, for every micro-batch; under torchrun every
    # rank's (FSDP sums the ranks' gradients): the normalisers of one process's loss. A completion
    # masked out entirely leaves the sequence count too; max(…, 1): all masked gives loss 0, not NaN.
    num_sequences = max(common.all_reduce((loss_mask.sum(-1) > 0).sum().item()), 1)
    num_tokens = max(common.all_reduce(loss_mask.sum().item()), 1)
    batch = {**batch, "loss_mask": loss_mask}
    if args.top_entropy_quantile < 1:  # over the whole mini-batch (every rank's), before its micro-batches
        batch["entropy_keep"] = common.top_share(batch["entropy"], loss_mask, args.top_entropy_quantile)
    if args.loss_type in ("clip_cov", "kl_cov"):  # the same: Clip-Cov's and KL-Cov's tokens
        batch["cov_tokens"] = covariance_tokens(batch, loss_mask, args, common.all_reduce)
    record = batch["old_logp"] is None  # this forward pass stands in for step 4's
    recorded = {name: torch.zeros_like(loss_mask, dtype=torch.float32) for name in ("old_logp", "entropy") if record}
    for rows, micro in micro_batches(batch, args.micro_batch_size, args.micro_batch_tokens):
        with amp():
            logp, entropy = sequence_logprobs(
                policy, micro["prompt_ids"], micro["prompt_mask"], micro["completion_ids"], micro["completion_mask"],
                temperature=args.temperature, vocab_size=vocab_size, chunk_size=len(rows),
                with_entropy=record or args.entropy_coef > 0,  # for the metrics; T1's bonus with grad
                entropy_grad=args.entropy_coef > 0, tool_mask=micro.get("tool_mask"), layout=micro["layout"],
            )  # (m, T) each  # fmt: skip
            old_logp = logp.detach() if on_policy(args) else micro["old_logp"]
            is_weight, policy_mask, correction_stats = corrections(micro, logp, old_logp, args)
            loss, stats = grpo_loss(
                logp, old_logp, micro["ref_logp"], micro["advantages"], micro["loss_mask"], args,
                num_sequences=num_sequences, num_tokens=num_tokens, entropy=entropy, is_weight=is_weight,
                policy_mask=policy_mask, cov_tokens=micro.get("cov_tokens"), sample_logp=micro["sample_logp"],
            )  # fmt: skip
        loss.backward()
        common.accumulate(totals, {"loss": loss.detach(), **stats, **correction_stats})
        if record:
            recorded["old_logp"][rows], recorded["entropy"][rows] = logp.detach(), entropy.detach()
    return common.host_numbers(totals), recorded  # one host sync, after the last micro-batch


# ----------------------------------------------------------------------------------------
# Variants and sampler/trainer corrections, each one function the loss or train() reads: GRPO's own
# (GSPO, GPG; Dr. GRPO's normaliser is in aggregate), then those shared with dapo.py.


CLIPPED = ("grpo", "dr_grpo", "clip_cov")  # the loss types whose objective is the clipped surrogate itself


def variant_objective(logp, old_logp, ratio, advantages, mask, args: Args, terms: dict):
    """The per-token objective of a --loss_type outside CLIPPED: the table from the loss type
    to its function. logp, old_logp, ratio, mask (n, T), advantages (n, 1) -> (objective (n, T), the
    ratio its stats report (n, T), DPPO's dropped tokens (n, T) bool or None)."""
    eps_low, eps_high = clip_range(args)
    match args.loss_type:
        case "gspo":  # one ratio per completion, clipped with GSPO's own ε
            ratio = sequence_ratio(logp, old_logp, mask)  # (n, T)
            return clipped_surrogate(ratio, advantages, eps_low, eps_high), ratio, None
        case "gpg":  # the plain policy gradient, no ratio, no clip
            return logp * advantages, ratio, None
        case "cispo":
            return cispo_objective(logp, ratio, advantages, eps_low, eps_high), ratio, None
        case "sapo":
            return sapo_objective(logp, old_logp, mask, advantages, args.sapo_tau_pos, args.sapo_tau_neg), ratio, None
        case "dppo":
            sampler = sampler_logp(terms, old_logp)  # (n, T) μ
            objective, cut = dppo_objective(logp, sampler, mask, advantages, **dppo_region(args))  # (n, T) each
            return objective, ratio, cut
        case "kl_cov":
            objective = kl_cov_objective(logp, old_logp, ratio, advantages, terms["cov_tokens"], args.kl_cov_coef)
            return objective, ratio, None
    raise ValueError(f"--loss_type {args.loss_type}: no objective")


def corrected(objective: torch.Tensor, advantages: torch.Tensor, args, terms: dict):
    """The policy-gradient term after, in this order, dual-clip's bound c·Â on Â < 0 tokens, truncated
    IS's weight (terms["is_weight"]), the policy mask of OPSM, Clip-Cov and the entropy share
    (terms["policy_mask"]; the KL term stays) and T1's entropy bonus c_H·H_t, each off unless set.
    objective (n, T), advantages (n, 1) -> (objective (n, T), the tokens dual-clip bounded (n, T))."""
    objective, dual_clipped = dual_clip(objective, advantages, args.dual_clip)
    if terms.get("is_weight") is not None:
        objective = terms["is_weight"] * objective
    if terms.get("policy_mask") is not None:
        objective = terms["policy_mask"] * objective
    if args.entropy_coef > 0:
        objective = objective + args.entropy_coef * terms["entropy"]
    return objective, dual_clipped


def kl_estimate(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp, mask: torch.Tensor, args) -> torch.Tensor:
    """D_KL,it, the loss's estimate of KL(π_θ ‖ π_ref) per token: k3 (kl_k3), or with --unbiased_kl
    DeepSeek-V3.2's r·k3 (unbiased_kl); 0 without a reference. (n, T) each -> (n, T)."""
    if ref_logp is None:
        return torch.zeros_like(logp)
    return unbiased_kl(logp, old_logp, ref_logp, mask) if args.unbiased_kl else kl_k3(logp, ref_logp)


def sampler_logp(terms: dict, old_logp: torch.Tensor) -> torch.Tensor:
    """μ, the behaviour policy's log-probs that DPPO and --kl_tau measure from: the sampler's
    (terms["sample_logp"]), or π_θold's where none are given. (n, T)."""
    return old_logp if terms.get("sample_logp") is None else terms["sample_logp"]


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level ratio (arXiv 2507.18071, Eq. 7), the unit the reward judges:
        s_i = (π_θ(o_i|q) / π_θold(o_i|q))^(1/|o_i|) = exp(1/|o_i| · Σ_t log r_it)
    the length normalisation keeps it near 1 whatever |o_i|. (n, T) each -> (n, T), s_i along row i."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # (n, 1) |o_i|
    log_ratio = (logp - old_logp) * mask  # (n, T)
    return torch.exp(log_ratio.sum(-1, keepdim=True) / lengths).expand_as(logp)


def variant_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Â of a variant, in place of group_advantages: GPG's (gpg_advantages), or the scale
    --scale_rewards names (scaled_advantages). rewards (N,) -> (N,)."""
    if args.loss_type == "gpg":
        return gpg_advantages(rewards, args.group_size, total=common.all_reduce)
    return scaled_advantages(rewards, args.group_size, reward_scale(args), eps=args.adv_eps, total=common.all_reduce)


def gpg_advantages(rewards: torch.Tensor, group_size: int, total=lambda count: count) -> torch.Tensor:
    """GPG's advantage (arXiv 2504.02546; F_norm = 1, α over the whole batch):
        Â_i = α · (R_i − mean(R_1..R_G)),   α = B / (B − M)
    M of the B completions are in groups whose rewards are all equal (Â = 0); α scales the rest up so
    the gradient does not shrink as such groups grow. total(count): the count over every rank.
    rewards (N,) with groups in consecutive rows -> advantages (N,)."""
    grouped = rewards.view(-1, group_size)  # (B/G groups, G)
    informative = grouped.max(-1).values != grouped.min(-1).values  # (groups,)
    # B / (B − M), unbounded (gradient clipping bounds the step); the authors resampled until α ≤ 2.
    alpha = total(len(informative)) / max(total(informative.sum().item()), 1)
    return (alpha * (grouped - grouped.mean(dim=-1, keepdim=True))).flatten()


def sapo_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
) -> torch.Tensor:
    """SAPO's soft-gated objective per token (arXiv 2511.20347):
        f(r)·Â,   f(r) = σ(τ (r − 1)) · 4/τ,   τ = τ_pos where Â > 0, τ_neg where Â < 0
    ∂f/∂r is 1 at r = 1 (on-policy: the plain policy gradient) and decays as r leaves 1: a token far
    off-policy is damped, not cut. logp, old_logp, mask (n, T), advantages (n, 1) -> (n, T)."""
    ratio = torch.exp(((logp - old_logp) * mask).clamp(-20.0, 20.0))  # (n, T) r, finite
    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # (n, 1) or (n, T)
    return torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * advantages


def unbiased_kl(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor):
    """DeepSeek-V3.2's unbiased KL estimate (arXiv 2512.02556, Sec. 3.1):
        D_t = (π_θ(o_t) / π_θold(o_t)) · k3_t,   the ratio not detached
    the tokens came from π_θold, so k3 alone is biased once θ moves; ∇D is the KL's own gradient.
    logp, old_logp, ref_logp, mask (n, T) -> (n, T)."""
    return torch.exp(((logp - old_logp) * mask).clamp(-20.0, 20.0)) * kl_k3(logp, ref_logp)  # e^20: finite


def corrections(micro: dict, logp: torch.Tensor, old_logp: torch.Tensor, args: Args):
    """The sampler/trainer corrections of one micro-batch, each off unless its flag is set: truncated
    IS weights (tis_weights) and the policy mask (OPSM's completions, Clip-Cov's tokens, the top-ρ
    entropy share). Returns is_weight (m, T) or None, the policy mask (m, T) or None, their counts."""
    is_weight, policy_mask, stats = None, None, {}
    if args.tis_cap:
        is_weight = tis_weights(old_logp, micro["sample_logp"], micro["completion_mask"], args.tis_cap)
    if args.off_policy_mask_threshold:
        keep = off_policy_sequence_mask(
            micro["sample_logp"],
            logp,
            micro["completion_mask"],
            micro["advantages"][:, None],
            args.off_policy_mask_threshold,
        )  # (m, 1)
        policy_mask, stats = keep.expand_as(logp), opsm_stats(keep, micro["loss_mask"])
    if args.loss_type in ("clip_cov", "kl_cov"):
        stats |= {"cov_tokens": (micro["cov_tokens"] & micro["loss_mask"].bool()).sum()}
    if args.loss_type == "clip_cov":  # Clip-Cov: its tokens' policy-gradient term leaves
        keep = (~micro["cov_tokens"]).to(logp.dtype)  # (m, T)
        policy_mask = keep if policy_mask is None else policy_mask * keep
    if args.top_entropy_quantile < 1:
        keep = micro["entropy_keep"].to(logp.dtype)  # (m, T)
        policy_mask = keep if policy_mask is None else policy_mask * keep
        stats |= {"entropy_kept": (keep * micro["loss_mask"]).sum()}
    return is_weight, policy_mask, stats


def off_policy_sequence_mask(
    sample_logp: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, threshold: float
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556, Sec. 3.1), per completion:
        M_i = 0  if Â_i < 0 and 1/|o_i| Σ_t log(π_sampler(o_i,t) / π_θ(o_i,t)) > δ,  else 1
    such a completion leaves the policy term (not the KL term, not the normaliser).
    sample_logp, logp, mask (n, T), advantages (n, 1) -> M (n, 1), no gradient."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # (n, 1) |o_i|
    divergence = ((sample_logp - logp.detach()) * mask).sum(-1, keepdim=True) / lengths  # (n, 1)
    return 1 - ((advantages < 0) & (divergence > threshold)).to(logp.dtype)


def scaled_advantages(
    rewards: torch.Tensor, group_size: int, scale: str, eps: float, total=lambda sum_: sum_, success=None
) -> torch.Tensor:
    """Â_i = (R_i − mean of its group) / s, with s as --scale_rewards chooses:
      group  the group's std (GRPO, DAPO Eq. 6: group_advantages)
      none   1 (Dr. GRPO Sec. 3.1)
      batch  the unbiased std of the whole batch's rewards, every rank's (Lite PPO, arXiv 2508.08221)
      mean   the group's mean of `success` (MaxRL, arXiv 2602.02710); a group of mean 0 gets Â = 0
    eps is added to s (not for none). rewards (N,) with groups in consecutive rows -> advantages (N,)."""
    if scale in ("group", "none"):
        return group_advantages(rewards, group_size, scale_by_std=scale == "group", eps=eps)
    grouped = rewards.view(-1, group_size)  # (B, G)
    centered = grouped - grouped.mean(dim=-1, keepdim=True)  # (B, G)
    if scale == "batch":
        count = total(rewards.numel())
        batch_mean = total(rewards.sum().item()) / count
        std = math.sqrt(total(((rewards - batch_mean) ** 2).sum().item()) / max(count - 1, 1))
        return (centered / (std + eps)).flatten()
    success = rewards if success is None else success
    if success.min() < 0:
        raise SystemExit(
            "--scale_rewards mean divides by a group's success rate: rewards below 0 have none. Use group or batch."
        )
    group_mean = success.view(-1, group_size).mean(dim=-1, keepdim=True)  # (B, 1) MaxRL's scale
    return torch.where(group_mean > 0, centered / (group_mean + eps), 0.0).flatten()


def reward_scale(args: Args) -> str:
    """--scale_rewards, or the loss type's own when unset: none for dr_grpo (Dr. GRPO), else group."""
    return args.scale_rewards or ("none" if args.loss_type == "dr_grpo" else "group")


def token_covariance(old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, total=lambda sum_: sum_):
    """Each token's centred cross term (arXiv 2505.22617, Sec. 4.1), the means over the mini-batch:
        Cov_t = (log π(o_t) − mean log π) · (Â_t − mean Â)
    log π is π_θold's, so the tokens are chosen once, before the micro-batches (verl: per micro-batch).
    old_logp, mask (n, T), advantages (n,) -> (n, T), 0 on padding, no gradient."""
    weight = mask.to(old_logp.dtype)  # (n, T)
    adv = advantages[:, None].expand_as(old_logp)  # (n, T) Â_i on every token of o_i
    count = max(total(weight.sum().item()), 1)
    mean_logp, mean_adv = total((old_logp * weight).sum().item()) / count, total((adv * weight).sum().item()) / count
    return ((old_logp - mean_logp) * (adv - mean_adv) * weight).detach()


def covariance_tokens(batch: dict, loss_mask: torch.Tensor, args: Args, total=lambda value, op="sum": value):
    """The tokens Clip-Cov and KL-Cov act on (arXiv 2505.22617, Sec. 4.2), of the mini-batch's N:
      kl_cov    the ⌈kl_cov_ratio·N⌉ of largest Cov
      clip_cov  ⌈clip_cov_ratio·N⌉ of those with Cov in [ω_low, ω_high], the band's highest (the paper
                draws them at random: this way a run is reproducible)
    ties at the cut go by top_share's rule. -> (n, T) bool."""
    cov = token_covariance(batch["old_logp"], batch["advantages"], loss_mask, total)  # (n, T)
    if args.loss_type == "kl_cov":
        return common.top_share(cov, loss_mask, args.kl_cov_ratio, total)
    low, high = (float(bound) for bound in args.clip_cov_bounds.split(","))
    band = loss_mask.bool() & (cov >= low) & (cov <= high)  # (n, T)
    wanted = common.share_of(args.clip_cov_ratio, total(int(loss_mask.sum().item())))  # ⌈r·N⌉ tokens, of the band's
    return common.top_share(cov, band, 1.0, total, wanted=wanted)


def kl_cov_objective(
    logp: torch.Tensor, old_logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, tokens, coef: float
):
    """KL-Cov's per-token objective (arXiv 2505.22617, Sec. 4.2):
        r_t·Â − β·|log π_θ(o_t) − log π_θold(o_t)|·[t chosen]
    on-policy the penalty's gradient is 0; it acts once θ moves. tokens (n, T) bool -> (n, T)."""
    return ratio * advantages - coef * (logp - old_logp).abs() * tokens


def dppo_objective(
    logp: torch.Tensor,
    sample_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    divergence: str,
    delta: float,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPPO's per-token objective (arXiv 2602.04879, Eq. 13-14), p = π_θ(o_t), μ = π_sampler(o_t):
        sg(min(p/μ, C)) · Â · log π_θ(o_t) · kept_t
    a token leaves when p moved too far from μ the way Â pushes it: binary_tv p − μ > δ (Â > 0) or
    < −δ (Â ≤ 0); binary_kl the Bernoulli KL of "this token or another" > δ and p moved Â's way
    (1 − p floored at 1e-6). -> (objective (n, T), dropped tokens (n, T) bool)."""
    p, q = logp.detach().exp(), sample_logp.exp()  # (n, T)
    gap = p - q  # (n, T)
    if divergence == "binary_kl":
        rest_p, rest_q = (1 - p).clamp(min=1e-6), (1 - q).clamp(min=1e-6)  # (n, T) the other tokens' mass
        moved = q * (sample_logp - logp.detach()) + rest_q * (rest_q.log() - rest_p.log())  # (n, T) D
        cut = (moved > delta) & torch.where(advantages > 0, gap > 0, gap < 0)  # (n, T)
    else:
        cut = torch.where(advantages > 0, gap > delta, gap < -delta)  # (n, T)
    ratio = torch.exp(((logp - sample_logp) * mask).clamp(max=math.log(cap))).detach()  # (n, T) min(r, C)
    return ratio * advantages * logp * ~cut, cut


def dppo_region(args: Args) -> dict:
    """The settings of dppo_objective's trust region that --dppo_type picks: its δ and the ratio's cap."""
    delta = args.dppo_kl_delta if args.dppo_type == "binary_kl" else args.dppo_delta
    return {"divergence": args.dppo_type, "delta": delta, "cap": args.dppo_ratio_cap}


def squared_log_ratio(logp: torch.Tensor, sample_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Kimi K2.5's penalty per valid token (arXiv 2602.02276): (log π_θ − log μ)², μ the sampler's,
    dropped tokens included. (n, T) each -> (n, T)."""
    return ((logp - sample_logp) * mask) ** 2


def cispo_objective(
    logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """CISPO's per-token objective (MiniMax-M1, arXiv 2506.13585, Eq. 4-5):
        sg(r̂_t) · Â · log π_θ(o_t),   r̂_t = clip(r_t, 1 − ε_low^IS, 1 + ε_high^IS)
    the weight is clipped and detached, so no token loses its gradient to the clip.
    logp, ratio (n, T), advantages (n, 1) -> (n, T)."""
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()  # (n, T) sg(r̂_t)
    return weight * advantages * logp


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


@torch.no_grad()
def ema_update(reference, policy, decay: float) -> None:
    """T1's moving reference (arXiv 2501.11651), after each optimizer step:
        θ_ref ← λ·θ_ref + (1 − λ)·θ
    the KL then anchors the policy to its recent weights, not to the start. decay 0: frozen."""
    if not decay:
        return
    weights = dict(policy.named_parameters())
    for name, ref_param in reference.named_parameters():
        ref_param.lerp_(weights[name].to(ref_param.dtype), 1 - decay)


# ----------------------------------------------------------------------------------------
# Training: train() runs the numbered steps of the docstring; its metrics and helpers follow.


def train(args: Args) -> Path:
    """Runs GRPO and returns the run directory."""
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
    reference = None  # π_ref, only for a KL term
    if args.beta > 0:
        reference = common.shard_model(common.load_reference(args, policy, device, weight_dtype), compute_dtype)
    vocab_size = len(tokenizer)  # ids the tokenizer has; the embedding may have more rows
    optimizer, scheduler = common.make_optimizer(policy, args.lr, args)  # AdamW, linear warm-up
    evaluate = functools.partial(  # run.end_step calls it every eval_every steps and at the end
        common.evaluate_heldout, rollout, policy, tokenizer, eos_ids, heldout, max_new_tokens=args.max_new_tokens,
        batch_size=args.eval_batch_size, amp=amp, **common.tool_limits(args),
    )  # fmt: skip
    resumable = {"optimizer": optimizer, "scheduler": scheduler}
    if args.ref_ema_decay:  # T1's reference moves with the policy: a resumed run needs where it was
        resumable["reference"] = reference
    run = common.Run(
        args, "grpo", policy, tokenizer, resumable=resumable, same_on_resume=("ref_ema_decay",), evaluate=evaluate,
        compute_dtype=compute_dtype,  # checkpoints in bf16 on a GPU, the fp32 masters in the newest's trainer state
    )  # fmt: skip
    passes = common.logprob_passes(policy, sequence_logprobs, args.temperature, vocab_size, amp)  # preflight's
    common.size_micro_batches(args, task, tokenizer, [policy], *passes)  # per pass; args.json keeps the flags given
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

            # 4. Log-probs of the sampled tokens under π_θold and π_ref, no grad. On-policy (μ = 1, one
            #    mini-batch) the update's forward pass gives π_θold's: only π_ref is scored here, unless
            #    --is_mask must know which tokens stay before the update counts its normalisers.
            timer = time.perf_counter()
            score_old = not on_policy(args) or scores_needed(args)  # else step 6 records π_θold's
            old_logp, entropy, ref_logp = old_and_ref_logprobs(
                policy, reference, batch, args, vocab_size, amp, score_policy=score_old
            )
            seconds_logprobs = time.perf_counter() - timer

            # 5. Group-relative advantages: one number per completion, shared by its tokens.
            if args.loss_type != "gpg" and reward_scale(args) == "group":
                advantages = group_advantages(batch.rewards, args.group_size, eps=args.adv_eps)  # (N,)
            else:  # GPG's, or another scale's (Dr. GRPO's none, Lite PPO's batch, MaxRL's mean)
                advantages = variant_advantages(batch.rewards, args)  # (N,)

            # 6. μ iterations over shuffled mini-batches; one optimizer step per mini-batch.
            timer = time.perf_counter()
            tensors = batch.tensors() | {"old_logp": old_logp, "ref_logp": ref_logp, "advantages": advantages}
            tensors |= {"entropy": entropy}  # π_θold's, for --top_entropy_quantile
            update, grad_norms = {}, []
            for _ in range(args.num_iterations):
                # A fresh random split into mini-batches each iteration, a group's rows in one (whole_groups).
                order = common.whole_groups(torch.randperm(num_sequences, device=device), args.group_size)  # (N,)
                for rows in order.tensor_split(args.num_mini_batches):
                    mini = {k: v[rows] if v is not None else None for k, v in tensors.items()}
                    totals, recorded = policy_backward(policy, mini, args, vocab_size, amp)
                    if recorded:  # on-policy: step 4's log-probs and entropy, in the batch's row order again
                        old_logp, entropy = (recorded[name][rows.argsort()] for name in ("old_logp", "entropy"))
                    none = not common.all_reduce(totals["tokens"])  # --is_mask left no token: no step, π_ref stays
                    grad_norms.append(common.optimizer_step(policy, optimizer, args.max_grad_norm, skip=none))
                    ema_update(reference, policy, 0.0 if none else args.ref_ema_decay)  # T1; 0: none
                    common.accumulate(update, totals)
            learning_rate = scheduler.get_last_lr()[0]  # the rate this step trained with
            scheduler.step()
            seconds = {**batch.seconds, "logprobs": seconds_logprobs, "update": time.perf_counter() - timer}

            # 7-9. Every metric from the tensors the loss used, over the whole batch; then Run.end_step:
            #      the held-out evaluation when due, the metrics row and samples, a checkpoint when due.
            metrics = {  # under torchrun, over every rank's share of the batch
                **common.all_reduce_metrics(common.step_metrics(batch, entropy, old_logp, args.group_size)),
                **update_metrics(common.all_reduce_totals(update), grad_norms, learning_rate),
                "throughput/tokens_per_s": common.all_reduce(batch.completion_mask.sum().item()) / seconds["generate"],
            }
            run.end_step(step, metrics, seconds, batch)
        run.save_final()
    return run.dir


def update_metrics(update: dict, grad_norms: list[float], learning_rate: float) -> dict:
    """Statistics of step 6, from the sums policy_backward collected over every micro-batch
    (never the last micro-batch alone)."""
    tokens = max(update["tokens"], 1)  # --is_mask may have dropped every token
    metrics = {
        "loss/policy": update["loss"] / len(grad_norms),  # mean over the optimizer steps
        "kl/mean": update["kl"] / tokens,
        "clip/low": update["clip_low"] / tokens,
        "clip/high": update["clip_high"] / tokens,
        "clip/fraction": (update["clip_low"] + update["clip_high"]) / tokens,
        "clip/dual": update["clip_dual"] / tokens,
        "clip/ratio_max": update["ratio_max"],
        "optim/grad_norm": sum(grad_norms) / len(grad_norms),
        "optim/lr": learning_rate,
    }
    if "tis_weight" in update and update["tokens"]:  # --tis_cap: the truncated IS weights the loss used
        metrics |= {"tis/weight_mean": update["tis_weight"] / tokens, "tis/weight_max": update["tis_weight_max"]}
    metrics |= {"entropy/kept_fraction": update["entropy_kept"] / tokens} if "entropy_kept" in update else {}
    metrics |= {"cov/token_fraction": update["cov_tokens"] / tokens} if "cov_tokens" in update else {}
    return metrics | common.is_mask_metrics(update) | common.opsm_metrics(update)


def opsm_stats(keep: torch.Tensor | None, loss_mask: torch.Tensor) -> dict:
    """The completions off-policy sequence masking took out of the policy term, and those it judged."""
    if keep is None:
        return {}
    judged = loss_mask.sum(-1) > 0  # (m,)
    return {"opsm_masked": (judged & (keep[:, 0] == 0)).sum(), "opsm_sequences": judged.sum()}


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
    problems = common.check_run_args(args, "grpo")
    if args.group_size < 2:
        problems.append("--group_size must be at least 2: a group of one has no relative advantage.")
    loss_types = ("grpo", "dr_grpo", "gspo", "gpg", "cispo", "sapo", "clip_cov", "kl_cov", "dppo")
    if args.loss_type not in loss_types:
        problems.append(f"--loss_type {args.loss_type!r} is not one of: {', '.join(loss_types)}.")
    if args.loss_type == "cispo" and args.dual_clip:
        problems.append("--loss_type cispo clips the IS weight, not the objective: dual-clip has nothing to bound (0).")
    if args.loss_type == "gpg" and (args.beta or args.dual_clip):
        problems.append("--loss_type gpg has no reference model and no ratio to clip: add --beta 0 --dual_clip 0.")
    if args.loss_type == "gspo" and args.tis_cap:
        problems.append("--tis_cap weights tokens, and GSPO's ratio is one per sequence: use --tis_cap 0 with gspo.")
    if args.loss_type == "gpg" and (args.num_iterations > 1 or args.num_mini_batches > 1):
        problems.append("--loss_type gpg is the on-policy gradient: use --num_iterations 1 --num_mini_batches 1.")
    if args.num_mini_batches < 1 or (args.batch_size * args.group_size) % args.num_mini_batches:
        rows = args.batch_size * args.group_size
        problems.append(
            f"--num_mini_batches must be at least 1 and divide batch_size * group_size ({args.batch_size} × "
            f"{args.group_size} = {rows} rows; got {args.num_mini_batches}): e.g. --num_mini_batches 1."
        )
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        problems.append("Training needs --temperature > 0 and 0 < --top_p <= 1.")
    for name in ("eps", "gspo_eps_low", "gspo_eps_high", "cispo_eps_high"):
        if getattr(args, name) <= 0:
            problems.append(f"--{name} must be > 0 (got {getattr(args, name)}).")
    if args.cispo_eps_low < 0:
        problems.append(f"--cispo_eps_low must be >= 0 (got {args.cispo_eps_low}); 1 or more: no lower bound.")
    for name in ("beta", "adv_eps"):
        if getattr(args, name) < 0:
            problems.append(f"--{name} must be >= 0 (got {getattr(args, name)}).")
    if args.dual_clip and args.dual_clip <= 1:
        problems.append("--dual_clip must be > 1 (e.g. 3), or 0 to disable it.")
    problems += common.check_technique_args(args)
    for name in ("batch_size", "max_new_tokens", "num_iterations"):
        if getattr(args, name) < 1:
            problems.append(f"--{name} must be at least 1.")
    if problems:
        raise SystemExit(common.said_once("Invalid arguments:\n  " + "\n  ".join(problems)))  # once a node


if __name__ == "__main__":
    try:
        train(common.parse_args(Args))
    except KeyboardInterrupt:  # during set-up, before the first step
        raise SystemExit("Interrupted before the first training step: nothing to resume.") from None
