"""One optimizer step of each objective from a fixed batch, for test_distributed.py: run as
`python tests/distributed_update.py OUT` (one process) and under
`torchrun --nproc_per_node 2 tests/distributed_update.py OUT` (gloo, each rank its half of the
groups, the model sharded by FSDP2). Each case saves to OUT/<case>.pt the full gradient before
the step, the full weights after it, the gradient norm and the summed loss: the two launches
must agree. The batch (4 Countdown prompts × 4 completions, rewards and log-probs given) is
made on every rank from the same seed, before any sharding, so all ranks hold the same one."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import dapo  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402
from rewards import load_task  # noqa: E402

GROUP_SIZE, MAX_NEW_TOKENS = 4, 12
LR = 3e-5  # AdamW's first step moves each weight by ~LR, round-off of tiny gradients by ~LR·1e-2: 1e-6 holds with room


def fixed_batch(model, tokenizer, eos_ids) -> dict:
    """16 rows: 4 prompts × 4 completions of unequal lengths, some truncated; rewards, old and
    reference log-probs, per-token advantages, values and returns drawn from the seeded RNG."""
    torch.manual_seed(0)
    task = load_task("countdown", seed=0, num_problems=4)
    conversations = [task.messages(p) for p in task.problems]
    prompt_ids, prompt_mask = grpo.encode_prompts(tokenizer, conversations, GROUP_SIZE, "cpu")
    ids, mask, truncated, sample_logp, _ = grpo.generate(
        model, prompt_ids, prompt_mask, MAX_NEW_TOKENS, eos_ids, tokenizer.pad_token_id, len(tokenizer)
    )
    with torch.no_grad():
        logp, _ = grpo.sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, len(tokenizer), 4)
    rows = ids.shape[0]
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": ids,
        "completion_mask": mask,
        "truncated": truncated,
        "sample_logp": sample_logp,
        "old_logp": (logp + 0.3 * torch.randn_like(logp)) * mask,
        "ref_logp": (logp + 0.2 * torch.randn_like(logp)) * mask,
        "rewards": torch.tensor(
            [1.0, 0.0, 0.1, 1.0, 0.0, 0.0, 0.0, 0.0, 0.1, 1.0, 1.0, 0.0, 1.0, 0.1, 0.1, 0.0][:rows]
        ),
        "token_advantages": torch.randn_like(logp) * mask,
        "positive": torch.arange(rows) % 3 == 0,
        "old_values": torch.randn_like(logp) * mask,
        "returns": torch.randn_like(logp) * mask,
        # π_θold's entropy, for --top_entropy_quantile (drawn last: the values above are unchanged)
        "entropy": torch.rand_like(logp) * mask,
    }


def one_step(model, batch: dict, backward, args, lr: float) -> dict:
    """This rank's share of the batch through backward(model, share) and one AdamW step."""
    rows = common.my_share(list(range(batch["completion_ids"].shape[0])))
    share = {k: v[rows] for k, v in batch.items()}
    common.shard_model(model)
    optimizer, _ = common.make_optimizer(model, lr, args)
    totals = backward(model, share)
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g.clone()  # noqa: E731
    gradient = {name: full(p.grad) for name, p in model.named_parameters()}
    clipped, adam_step = {}, optimizer.step

    def step_recording_the_clipped_gradient(*a, **k):  # what AdamW steps with: each rank's shard clipped
        clipped.update({name: full(p.grad) for name, p in model.named_parameters()})
        return adam_step(*a, **k)

    optimizer.step = step_recording_the_clipped_gradient
    grad_norm = common.optimizer_step(model, optimizer, args.max_grad_norm)
    weights = common.full_state_dict(model) if common.world_size() > 1 else model.state_dict()
    loss = common.all_reduce(totals["loss"])
    return {"gradient": gradient, "clipped": clipped, "weights": weights, "grad_norm": grad_norm, "loss": loss}


def main(out: Path) -> None:
    common.init_distributed(torch.device("cpu"))
    results = {}
    base, tokenizer, eos_ids = common.load_model("tiny", torch.device("cpu"))
    batch = fixed_batch(base, tokenizer, eos_ids)
    vocab = len(tokenizer)

    def fresh():
        return common.load_model("tiny", torch.device("cpu"))[0].train()

    # sapo with the unbiased KL; clip_cov with the batch's reward scale, the top half by entropy and
    # off-policy sequence masking; kl_cov with MaxRL's scale; dppo's Binary-KL with Kimi K2.5's penalty:
    # each choice over the whole batch, every rank's
    techniques = {
        "sapo": {"unbiased_kl": True},
        "clip_cov": {"clip_cov_ratio": 0.1, "clip_cov_bounds": "-100,100", "scale_rewards": "batch"},
        "kl_cov": {"kl_cov_ratio": 0.1, "scale_rewards": "mean"},
        "dppo": {"dppo_type": "binary_kl", "kl_tau": 0.01},
    }
    techniques["clip_cov"] |= {"top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.05}
    for loss_type in ("grpo", "dr_grpo", "gspo", "gpg", "sapo", "clip_cov", "kl_cov", "dppo"):
        off_policy = loss_type != "gpg"  # the recorded old_logp (ratios ≠ 1, clipping) where the loss has a ratio
        args = grpo.Args(
            loss_type=loss_type, beta=0.04 if off_policy else 0.0, micro_batch_size=3,
            max_new_tokens=MAX_NEW_TOKENS, num_iterations=2 if off_policy else 1, group_size=GROUP_SIZE,
            **techniques.get(loss_type, {}),
        )  # fmt: skip

        def backward(model, share, args=args, loss_type=loss_type):
            if loss_type == "gpg":
                share["advantages"] = grpo.gpg_advantages(share["rewards"], GROUP_SIZE, total=common.all_reduce)
            else:
                scale = grpo.reward_scale(args)  # group's std; none for dr_grpo; batch, mean as asked
                share["advantages"] = grpo.scaled_advantages(
                    share["rewards"], GROUP_SIZE, scale, args.adv_eps, common.all_reduce
                )
            if loss_type == "gpg":
                share["ref_logp"] = None
            return grpo.policy_backward(model, share, args, vocab)[0]  # the totals

        results[f"grpo-{loss_type}"] = one_step(fresh(), batch, backward, args, LR)

    # Micro-batches by tokens (chunks_of), 800 a micro-batch: rank 0's rows (prompts of 255 tokens,
    # completions of 12) would go 2 at a time (3 · 267 > 800), rank 1's (252) 3 at a time (3 · 264 =
    # 792): 4 forward passes against 3, and FSDP, which pairs each rank's forward pass with one of
    # every other, would hang. Under torchrun the budget buys rows, the same on every rank.
    token_args = grpo.Args(beta=0.04, micro_batch_tokens=800, max_new_tokens=MAX_NEW_TOKENS, num_iterations=2)

    def token_backward(model, share):
        scale = grpo.reward_scale(token_args)
        share["advantages"] = grpo.scaled_advantages(share["rewards"], GROUP_SIZE, scale, 1e-6, common.all_reduce)
        return grpo.policy_backward(model, share, token_args, vocab)[0]

    results["grpo-tokens"] = one_step(fresh(), batch, token_backward, token_args, LR)

    args = dapo.Args(
        overlong_filter=True, overlong_buffer=4, micro_batch_size=3, max_new_tokens=MAX_NEW_TOKENS,
        num_iterations=2, group_size=GROUP_SIZE, beta=0.04,
    )  # fmt: skip

    def dapo_backward(model, share):
        lengths = share["completion_mask"].sum(-1)
        share["advantages"], _ = dapo.shaped_advantages(
            share["rewards"], lengths, GROUP_SIZE, MAX_NEW_TOKENS, args.overlong_buffer, args.adv_eps
        )
        return dapo.policy_backward(model, share, args, vocab)[0]

    results["dapo-overlong_filter"] = one_step(fresh(), batch, dapo_backward, args, LR)

    ppo_args = ppo.Args(micro_batch_size=3, ppo_epochs=2, group_size=GROUP_SIZE, pos_lm_coef=0.1)

    def actor_backward(model, share):
        share["advantages"] = ppo.masked_whiten(
            share["token_advantages"], share["completion_mask"], ppo_args.whiten_eps, common.all_reduce
        )
        return ppo.policy_backward(model, share, ppo_args, vocab)[0]

    results["ppo-actor"] = one_step(fresh(), batch, actor_backward, ppo_args, LR)
    critic = ppo.load_critic(ppo.Args(model="tiny"), torch.device("cpu"), torch.float32).train()
    torch.manual_seed(1)
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)  # not zero, so the backbone gets a gradient
    results["ppo-critic"] = one_step(critic, batch, lambda m, s: ppo.critic_backward(m, s, ppo_args), ppo_args, LR)

    if common.rank() == 0:
        for case, result in results.items():
            torch.save(result, out / f"{case}.pt")
    if torch.distributed.is_initialized():  # as a finished run leaves (common.leave_process_group)
        common.leave_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
