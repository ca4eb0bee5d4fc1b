"""LoRA through peft (--lora_rank r > 0), in all three scripts: the adapters are all that learns,
the reference is the policy with its adapters off, gradient accumulation and resume stay exact,
and the final checkpoint holds a merged full model that plain transformers loads."""

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from test_train import expected_digit_reward
from transformers import AutoModelForCausalLM

import dapo
import grpo
import ppo
from common import LORA_LR, build_tiny_model, load_model, load_policy, load_reference, make_optimizer, read_jsonl
from conftest import crash_and_resume, sample_batch
from grpo import sequence_logprobs

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7: the tolerances below are N·eps, N the tokens summed

CPU = torch.device("cpu")


def lora_args(script=grpo, **overrides):
    return script.Args(**{"model": "tiny", "lora_rank": 4, "max_new_tokens": 12, "beta": 0.04, **overrides})


def sampled_batch(policy, tokenizer, eos_ids) -> dict:
    """conftest.sample_batch from the policy, with the RNG seeded: the same tokens each call."""
    torch.manual_seed(0)
    return sample_batch(policy, tokenizer, eos_ids)


def test_only_the_adapters_learn_and_the_reference_is_the_base_model():
    # One optimizer step of GRPO's loss on a LoRA policy: every weight of --model stays bit for
    # bit (peft freezes them), only lora_A/lora_B tensors move, at the LoRA default lr 1e-5.
    # Then the reference, the same policy with its adapters switched off, scores the batch
    # exactly as a fresh load of --model does, while the adapted policy no longer does.
    args = lora_args(num_iterations=2)
    policy, tokenizer, eos_ids = load_policy(args, CPU, torch.float32)
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    optimizer, _ = make_optimizer(policy, args.lr, args)
    assert optimizer.param_groups[0]["lr"] == LORA_LR == 1e-5
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    batch = sampled_batch(policy, tokenizer, eos_ids)
    grpo.policy_backward(policy, batch, args, len(tokenizer))
    optimizer.step()
    moved = {name for name, p in policy.named_parameters() if not torch.equal(p, before[name])}
    assert moved and moved <= trainable  # lora_A stays while B = 0: its gradient is B^T(...) = 0
    assert any("lora_B" in name for name in moved)

    sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    reference = load_reference(args, policy, CPU, torch.float32)
    fresh, _, _ = load_model("tiny", CPU)
    with torch.no_grad():
        reference_logp, _ = sequence_logprobs(reference, *sequences, 1.0, len(tokenizer), 4)
        base_logp, _ = sequence_logprobs(fresh, *sequences, 1.0, len(tokenizer), 4)
        adapted_logp, _ = sequence_logprobs(policy, *sequences, 1.0, len(tokenizer), 4)
    assert torch.equal(reference_logp, base_logp)
    assert (adapted_logp - base_logp).abs().max() > 1e-6
    assert all(p.requires_grad for name, p in policy.named_parameters() if name in trainable)  # reference froze nothing


@pytest.mark.parametrize("script", [grpo, dapo], ids=["grpo", "dapo"])
def test_gradient_accumulation_equals_one_big_batch_with_lora(script):
    # As tests/test_train.py's test for full fine-tuning, on the adapters' gradients: 12 sequences
    # in one micro-batch, in 4 of 3, and in 5 + 5 + 2.
    args = lora_args(script)
    policy, tokenizer, eos_ids = load_policy(args, CPU, torch.float32)
    for name, p in policy.named_parameters():  # B ≠ 0, so that A has a gradient too
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    batch = sampled_batch(policy, tokenizer, eos_ids)
    gradients = []
    for micro_batch_size in (12, 3, 5):
        policy.zero_grad(set_to_none=True)
        overrides = {"micro_batch_size": micro_batch_size, "num_iterations": 2}
        script.policy_backward(policy, batch, lora_args(script, **overrides), len(tokenizer))
        gradients.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad]))
    assert gradients[0].abs().max() > 0
    tolerance = batch["completion_mask"].sum().item() * FP32_EPS  # N·eps: the same terms in another order
    for gradient in gradients[1:]:
        assert (gradient - gradients[0]).abs().max() <= tolerance * gradients[0].abs().max()


def test_resume_with_lora_continues_exactly_and_final_holds_a_merged_model(tmp_path, monkeypatch):
    # conftest.crash_and_resume with LoRA: the resumed run's adapters and merged model equal the
    # straight run's bit for bit. Checkpoints before the last hold the adapters in peft's format
    # (adapter/) and the trainer state; final/ also holds the merged model, which
    # AutoModelForCausalLM loads and which scores like the base model under the adapters
    # (PeftModel.from_pretrained over a fresh --model) to 1e-5.
    settings = dict(model="tiny", task="digit", lora_rank=4, lr=1e-2, max_new_tokens=2, batch_size=16, max_steps=3)
    straight, resumed = crash_and_resume(grpo, tmp_path, monkeypatch, **settings)
    assert sum(row["reward/mean"] for row in read_jsonl(straight / "metrics.jsonl")[:2]) > 0  # a signal to learn
    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        a, b = load_file(straight / "final" / name), load_file(resumed / "final" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    step = sorted(p.name for p in (resumed / "step-000002").iterdir())
    assert "adapter" in step and "model.safetensors" not in step  # the adapters only, before the end

    merged = AutoModelForCausalLM.from_pretrained(straight / "final")
    base, tokenizer, eos_ids = load_model("tiny", CPU)
    adapted = PeftModel.from_pretrained(base, straight / "final" / "adapter")
    batch = sampled_batch(adapted, tokenizer, eos_ids)
    sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    with torch.no_grad():
        merged_logp, _ = sequence_logprobs(merged, *sequences, 1.0, len(tokenizer), 4)
        adapted_logp, _ = sequence_logprobs(adapted, *sequences, 1.0, len(tokenizer), 4)
        with adapted.disable_adapter():
            base_logp, _ = sequence_logprobs(adapted, *sequences, 1.0, len(tokenizer), 4)
    assert (merged_logp - adapted_logp).abs().max() <= 1e-5
    assert (adapted_logp - base_logp).abs().max() > 1e-4  # the adapters learned something to merge
    reloaded, _, _ = load_model(str(straight / "final"), CPU)  # as evaluate.py --model loads it
    assert reloaded.config.model_type == "qwen2"
    with pytest.raises(SystemExit, match="is a LoRA checkpoint: it holds adapters"):
        load_model(str(resumed / "step-000002"), CPU)  # no merged model before the end: a message, not a traceback


def test_gradient_checkpointing_gives_the_same_adapter_gradient():
    # Activation checkpointing recomputes the forward pass in backward; with frozen base weights
    # and adapters in between, the adapters' gradient must not change. Both policies must be the
    # same: peft draws lora_A from the global generator, so each load starts from the same seed
    # (without it the two A's, and so the sampled batches, differed whenever the generator's state
    # did: the test passed or failed by the tests run before it).
    gradients = []
    for checkpointing in (False, True):
        args = lora_args(gradient_checkpointing=checkpointing, num_iterations=2)
        torch.manual_seed(0)
        policy, tokenizer, eos_ids = load_policy(args, CPU, torch.float32)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(sum(map(ord, name))))
        batch = sampled_batch(policy, tokenizer, eos_ids)
        grpo.policy_backward(policy, batch, args, len(tokenizer))
        gradients.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad]))
    assert gradients[0].abs().max() > 0
    tolerance = batch["completion_mask"].sum().item() * FP32_EPS  # N·eps: the same terms in another order
    assert (gradients[1] - gradients[0]).abs().max() <= tolerance * gradients[0].abs().max()


@pytest.mark.parametrize("script", [dapo, ppo], ids=["dapo", "ppo"])
def test_dapo_and_ppo_run_with_lora(script, tmp_path):
    # Two steps each with adapters and a KL reference (the adapters switched off); PPO's critic
    # trains in full beside them and is saved in critic/ as before.
    extra = {"critic_lr": 1e-2} if script is ppo else {"dynamic_sampling": False, "overlong_buffer": 1}
    args = script.Args(
        model="tiny", task="digit", lora_rank=4, beta=0.01, lr=1e-2, max_new_tokens=2, batch_size=4, group_size=4,
        max_steps=2, save_every=1, output_dir=str(tmp_path), **extra,
    )  # fmt: skip
    run_dir = script.train(args)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and all("kl/mean" in row for row in rows)
    assert (run_dir / "final" / "adapter" / "adapter_config.json").exists()
    assert AutoModelForCausalLM.from_pretrained(run_dir / "final").config.model_type == "qwen2"
    if script is ppo:  # the critic's backbone has adapters of its own; its head trains in full
        critic = sorted(p.name for p in (run_dir / "final" / "critic").iterdir())
        assert critic == ["adapter", "value_head.safetensors"]
        resumed = ppo.load_critic(ppo.Args(**{**vars(args), "resume_from": str(run_dir / "final")}), CPU, torch.float32)
        trainable = [name for name, p in resumed.named_parameters() if p.requires_grad]
        assert all("lora_" in name or name.startswith("value_head") for name in trainable)
        saved_head = load_file(run_dir / "final" / "critic" / "value_head.safetensors")
        assert all(torch.equal(resumed.value_head.state_dict()[k], saved_head[k]) for k in saved_head)


def test_ppo_resume_with_lora_continues_exactly(tmp_path, monkeypatch):
    # Policy adapters, critic adapters and value head of the resumed run equal the straight run's.
    settings = dict(model="tiny", task="digit", lora_rank=4, lr=1e-2, critic_lr=1e-2, max_new_tokens=2)
    settings |= dict(batch_size=8, group_size=4, max_steps=3)
    straight, resumed = crash_and_resume(ppo, tmp_path, monkeypatch, **settings)
    names = ("adapter/adapter_model.safetensors", "critic/adapter/adapter_model.safetensors")
    for name in (*names, "critic/value_head.safetensors", "model.safetensors"):
        a, b = load_file(straight / "final" / name), load_file(resumed / "final" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


# The learning run with LoRA. On the random tiny model the adapters of "all-linear" (attention
# and MLP) cannot lift the digit reward far: its final RMSNorm fixes the hidden state's norm and
# its embeddings are tiny (std 0.02), so without touching the LM head the best reachable expected
# reward is ~0.05 (Adam on the reward itself, 30 steps, lr 1e-2: 0.025 -> 0.049). With an adapter
# on the LM head too (--lora_targets ...,lm_head; tiny-llama, whose LM head is not tied to its
# embedding), GRPO learns the task as full fine-tuning does. β = 0: with β = 0.01, once every
# group's rewards are equal the KL term's tiny gradient is all Adam sees and it scales it up to
# full-size steps; in 4 of 5 runs so measured (lr 1e-2 and 5e-3, 30 steps) the sampled reward
# fell from ≈ 1 to 0.79 or below, down to 0.0, at some step after reaching it.
# Measured, OMP_NUM_THREADS=1, grpo.train(grpo.Args(**LEARN, seed=s)) for seeds 0-2, each under
# ATEN_CPU_CAPABILITY=avx512 (this CPU's own) and avx2, 6 runs (the two kernel sets gave the
# same figures here):
#   exact expected reward after step 20          1.000 in every run (start 0.02)
#   sampled reward/mean, mean over steps 16-20   min 0.998
LEARN = dict(
    model="tiny-llama", task="digit", lora_rank=8, lr=5e-3, beta=0.0, max_new_tokens=8, max_steps=20, save_every=0,
    lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head",
)  # fmt: skip


def test_grpo_with_lora_learns_the_digit_task(tmp_path):
    # The bars are margins every measured run clears; a policy that does not learn stays near 0.02.
    _, tokenizer, _ = load_model("tiny-llama", CPU)
    start = expected_digit_reward(AutoModelForCausalLM.from_pretrained(build_tiny_model(name="tiny-llama")), tokenizer)
    assert start < 0.1
    run_dir = grpo.train(grpo.Args(**LEARN, output_dir=str(tmp_path)))
    end = expected_digit_reward(AutoModelForCausalLM.from_pretrained(run_dir / "final"), tokenizer)
    assert end > 0.6, (start, end)
    rewards = [row["reward/mean"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(rewards) == 20 and sum(rewards[-5:]) / 5 > 0.6


def test_a_target_the_model_does_not_have_names_the_ones_it_has():
    # peft's own error (a ValueError) names the pattern; ours adds the model's linear layers to pick from.
    args = grpo.Args(model="tiny", lora_rank=4, lora_targets="q_prj")
    with pytest.raises(SystemExit, match=r"--lora_targets q_prj: .*linear layers are named .*q_proj.*or all-linear"):
        load_policy(args, torch.device("cpu"), torch.float32)
