"""Issue 58's lever 4, a contender no script chooses yet (common.bf16_residual; bench.py --bf16_residual,
tests/precision_run.py --bf16_residual): under bf16 autocast the input embedding's output is cast to bf16,
so the residual stream and the rotary products run in bf16, while the weights, their gradients and AdamW
stay fp32. CPU autocast runs the same dtypes as a GPU's (other kernels): these tests prove where each
dtype goes, that nothing changes without autocast, and the sampler-trainer gap's bounds."""

import copy

import pytest
import torch

import bench
import common
import ppo
from common import bf16_residual, load_model
from families import FAMILIES, family_model, family_prompts, unbuildable
from grpo import encode_prompts, generate, sequence_logprobs

PROMPTS = [[{"role": "user", "content": "Reply with a digit."}], [{"role": "user", "content": "Hi"}]]


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def hidden_dtypes(model, ids) -> tuple:
    """The dtypes of each decoder layer's input (the residual stream) and of the rotary cos and sin; the output."""
    rotary = set()
    handle = model.model.rotary_emb.register_forward_hook(lambda m, i, out: rotary.update(t.dtype for t in out))
    try:
        out = model(input_ids=ids, output_hidden_states=True)
    finally:
        handle.remove()
    return [h.dtype for h in out.hidden_states[:-1]], rotary, out  # the last: after the final norm


def test_under_autocast_the_residual_stream_and_rotary_are_bf16_the_weights_and_gradients_fp32():
    # Without the hook autocast leaves the residual stream fp32 (fp32 embedding, fp32 adds) and so cos
    # and sin (they take its dtype); with it, both bf16. The weights stay fp32 and so do their
    # gradients, the embedding's included (the cast is differentiated, not detached).
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("3 + 4 = 7")])
    with autocast():
        residual, rotary, _ = hidden_dtypes(model, ids)
        assert set(residual) == {torch.float32} and rotary == {torch.float32}
        hooked = bf16_residual(copy.deepcopy(model))
        residual, rotary, out = hidden_dtypes(hooked, ids)
        assert set(residual) == {torch.bfloat16} and rotary == {torch.bfloat16}
        out.logits.float().logsumexp(-1).sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in hooked.parameters())
    assert hooked.get_input_embeddings().weight.grad.abs().sum() > 0


def test_without_autocast_nothing_changes():
    # The CPU's fp32 runs (the scripts' default there): the same logits bit for bit.
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("3 + 4 = 7")])
    with torch.no_grad():
        assert torch.equal(bf16_residual(copy.deepcopy(model))(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("name", [name for name in FAMILIES if unbuildable(name) is None])
def test_every_family_s_residual_stream_is_bf16(name):
    # Whatever a family does after its embedding (Gemma's scaling, a norm), its layers take bf16. But
    # Qwen3-MoE's sparse block returns fp32 (its routing weights are fp32), so from its second layer
    # on its residual stream is fp32 again: there the lever does less.
    model = bf16_residual(copy.deepcopy(family_model(name)))
    seen = []
    handles = [layer.register_forward_hook(lambda m, i, o: seen.append(i[0].dtype)) for layer in model.model.layers]
    try:
        with torch.no_grad(), autocast():
            model(input_ids=family_prompts()[0][:, -8:])
    finally:
        for handle in handles:
            handle.remove()
    expected = [torch.bfloat16] + [torch.float32 if name == "qwen3-moe" else torch.bfloat16] * 3
    assert seen == expected, name


def gaps(sampler, scorer, tokenizer) -> tuple[float, float]:
    """The sampler's log-probs against the scorer's under CPU bf16 autocast: (mean, max) |Δ log π|."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS * 4, 4, "cpu")
    torch.manual_seed(0)
    with autocast():
        ids, mask, _, sample_logp, _ = generate(
            sampler, prompt_ids, prompt_mask, 48, [tokenizer.eos_token_id], tokenizer.pad_token_id, len(tokenizer)
        )
        with torch.no_grad():
            logp, _ = sequence_logprobs(scorer, prompt_ids, prompt_mask, ids, mask, 1.0, len(tokenizer), 4)
    gap = (logp - sample_logp).abs()[mask.bool()]
    return gap.mean().item(), gap.max().item()


def test_the_sampler_and_the_trainer_stay_within_the_cuda_tier_s_bounds():
    # Sampler and scorer both run the hooked model, so they differ only by their kernels' bf16
    # rounding: within test_cuda.py's bounds (mean 0.05, max 1 nat), and closer than a sampler with
    # the hook and a scorer without it (a hook on one side only, as a contender applied to the
    # sampler's model alone would be). On the tiny model: 9.6e-5 / 1.5e-3 without the hook, 4.0e-4 /
    # 2.2e-3 with it, 8.7e-4 / 4.1e-3 on the sampler's side alone.
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    hooked = bf16_residual(copy.deepcopy(model))
    before, after, one_side = (
        gaps(model, model, tokenizer),
        gaps(hooked, hooked, tokenizer),
        gaps(hooked, model, tokenizer),
    )
    print(f"sampler vs trainer, bf16 autocast: fp32 residual {before}, bf16 residual {after}, one side {one_side}")
    assert after[0] < 0.05 and after[1] < 1.0
    assert before[0] < after[0] < one_side[0]


def test_bench_s_contender_hooks_the_policy_the_reference_and_the_critic(tmp_path):
    # bench.bf16_residuals: within it the loaders a script calls hook their models; after it, the
    # loaders are the scripts' again.
    loaders = common.load_policy, common.load_reference, ppo.load_critic
    hooked = lambda model: bool(model.get_input_embeddings()._forward_hooks)  # noqa: E731
    args = ppo.Args(model="tiny", output_dir=str(tmp_path))
    device = torch.device("cpu")
    with bench.bf16_residuals():
        policy, _, _ = common.load_policy(args, device, torch.float32)
        reference = common.load_reference(args, policy, device, torch.float32)
        critic = ppo.load_critic(args, device, torch.float32)
    assert hooked(policy) and hooked(reference) and hooked(critic.backbone)
    assert (common.load_policy, common.load_reference, ppo.load_critic) == loaders
    with bench.bf16_residuals(False):
        assert not hooked(common.load_policy(args, device, torch.float32)[0])
