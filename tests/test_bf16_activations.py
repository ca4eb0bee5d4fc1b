"""Issue 58's lever 4, a contender no script chooses yet (common.bf16_activations; bench.py --bf16_activations,
tests/precision_run.py --bf16_activations): under bf16 autocast the input embedding's and each RMSNorm's
output within the layers are cast to bf16, so the residual stream, the norms and the rotary products
run in bf16, while the weights, their gradients and AdamW stay fp32. CPU autocast runs the same dtypes as a
GPU's (other kernels): these tests prove where each dtype goes, that nothing changes without autocast, and the
sampler-trainer gap's bounds."""

import copy

import pytest
import torch

import bench
import common
import grpo
import ppo
from common import bf16_activations, load_model
from families import FAMILIES, family_model, family_prompts, unbuildable
from grpo import encode_prompts, generate, sequence_logprobs

PROMPTS = [[{"role": "user", "content": "Reply with a digit."}], [{"role": "user", "content": "Hi"}]]


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def is_norm(module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def activation_dtypes(model, ids) -> tuple:
    """Under whatever autocast is on: the dtypes of each decoder layer's input (the residual stream), of each
    norm's output within the layers, of the rotary cos and sin, of the final norm's output; and the output."""
    seen = {"residual": [], "norms": set(), "rotary": set(), "final": set()}
    watch = [(layer, lambda m, i, o: seen["residual"].append(i[0].dtype)) for layer in model.model.layers]
    watch += [(m, lambda m, i, o: seen["norms"].add(o.dtype)) for m in model.model.layers.modules() if is_norm(m)]
    watch.append((model.model.rotary_emb, lambda m, i, o: seen["rotary"].update(t.dtype for t in o)))
    watch.append((model.model.norm, lambda m, i, o: seen["final"].add(o.dtype)))
    handles = [module.register_forward_hook(hook) for module, hook in watch]
    try:
        out = model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen, out


def test_under_autocast_residual_norms_and_rotary_are_bf16_the_final_norm_weights_and_gradients_fp32():
    # Without the hooks autocast leaves the residual stream fp32 (fp32 embedding, fp32 adds), the norms'
    # outputs fp32 (their fp32 weight's product) and so cos and sin (they take the hidden states' dtype);
    # with them, all bf16, but for the final norm's output, which the fp32 head takes. The weights stay
    # fp32 and so do their gradients, the embedding's included (the casts are differentiated, not detached).
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("3 + 4 = 7")])
    fp32, bf16 = {torch.float32}, {torch.bfloat16}
    with autocast():
        seen, _ = activation_dtypes(model, ids)
        assert set(seen["residual"]) == seen["norms"] == seen["rotary"] == seen["final"] == fp32
        hooked = bf16_activations(copy.deepcopy(model))
        seen, out = activation_dtypes(hooked, ids)
        assert set(seen["residual"]) == seen["norms"] == seen["rotary"] == bf16 and seen["final"] == fp32
        out.logits.float().logsumexp(-1).sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in hooked.parameters())
    assert hooked.get_input_embeddings().weight.grad.abs().sum() > 0


def test_a_lora_policy_gets_the_same_casts():
    # A PeftModel's layers sit deeper in its names (base_model.model.model.layers): its norms are found
    # there too, and a LoRA run's policy gets the same bf16 residual stream and norms.
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    lora = bf16_activations(common.with_adapters(model, grpo.Args(model="tiny", lora_rank=4)))
    with torch.no_grad(), autocast():
        seen, _ = activation_dtypes(lora.get_base_model(), torch.tensor([tokenizer.encode("3 + 4 = 7")]))
    assert set(seen["residual"]) == seen["norms"] == {torch.bfloat16} and seen["final"] == {torch.float32}


def test_the_decode_step_s_query_reaches_attention_in_bf16(monkeypatch):
    # Autocast's fp32 rotary product made the one-token step's query fp32, which the varlen attention
    # casts (query.to(value.dtype)); with the lever the rotary runs in bf16 and the query comes bf16, the
    # cast a no-op. Seen at the grouped attention the CPU's step runs: (query, key) dtypes.
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    seen, attention = [], common.grouped_decode_attention

    def spy(module, query, key, *rest, **settings):
        seen.append((query.dtype, key.dtype))
        return attention(module, query, key, *rest, **settings)

    monkeypatch.setattr(common, "grouped_decode_attention", spy)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 1, "cpu")
    dtypes = []
    for decoded in (model, bf16_activations(copy.deepcopy(model))):
        seen.clear()
        with torch.no_grad(), autocast():
            generate(decoded, prompt_ids, prompt_mask, 3, [], tokenizer.pad_token_id, len(tokenizer), 0.0)
        dtypes.append(set(seen))
    assert dtypes == [{(torch.float32, torch.bfloat16)}, {(torch.bfloat16, torch.bfloat16)}]


def test_without_autocast_nothing_changes():
    # The CPU's fp32 runs (the scripts' default there): the same logits bit for bit.
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("3 + 4 = 7")])
    with torch.no_grad():
        assert torch.equal(bf16_activations(copy.deepcopy(model))(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("name", [name for name in FAMILIES if unbuildable(name) is None])
def test_every_family_s_residual_stream_and_norms_are_bf16(name):
    # Whatever a family does after its embedding (Gemma's scaling, a norm) or around its norms (Olmo2's
    # after each block, Qwen3's on q and k, Cohere2's LayerNorm), its layers take bf16 and its norms give
    # it. With the embedding's cast alone Qwen3-MoE's residual stream was fp32 again from its second layer:
    # its sparse block's routing weights take the dtype of its input, the fp32 norm's output.
    model = bf16_activations(copy.deepcopy(family_model(name)))
    with torch.no_grad(), autocast():
        seen, _ = activation_dtypes(model, family_prompts()[0][:, -8:])
    assert seen["residual"] == [torch.bfloat16] * len(model.model.layers), name
    assert seen["norms"] == {torch.bfloat16}, name


def test_the_norms_casts_change_no_number_in_a_dense_model_and_take_six_ops_a_layer_away():
    # In a dense layer a norm's output goes only to products, which under autocast round it to bf16
    # anyway: casting it once at the norm gives the same logits bit for bit as the embedding's cast alone.
    # What they save against the embedding's cast alone (bench's row of it), by hand, a Qwen2 layer: the
    # attention's norm, one cast for autocast's three (q, k, v: -2), the MLP's one for two (gate, up: -1);
    # backward, three fp32 casts of the gradient and two fp32 adds become two bf16 adds and one cast (-2),
    # two casts and an add an add and a cast (-1): -6. (Against fp32 activations the difference depends
    # on transformers' rotary and norm code: 6 ops on 5.24, 10 on 5.4.)
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("3 + 4 = 7")])
    embedding_only = copy.deepcopy(model)
    embedding_only.get_input_embeddings().register_forward_hook(lambda m, i, out: out.to(torch.bfloat16))
    with torch.no_grad(), autocast():
        assert torch.equal(embedding_only(input_ids=ids).logits, bf16_activations(model)(input_ids=ids).logits)
    fp32, embedding, bf16 = bench.bench_update_kernels(2, torch.device("cpu"), rows=1, tokens=16)
    assert embedding["ops a layer"] - bf16["ops a layer"] == 6
    assert (
        bf16["MB a layer, products apart"]
        < embedding["MB a layer, products apart"]
        < fp32["MB a layer, products apart"]
    )


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
    hooked = bf16_activations(copy.deepcopy(model))
    before, after, one_side = (
        gaps(model, model, tokenizer),
        gaps(hooked, hooked, tokenizer),
        gaps(hooked, model, tokenizer),
    )
    print(f"sampler vs trainer, bf16 autocast: fp32 residual {before}, bf16 residual {after}, one side {one_side}")
    assert after[0] < 0.05 and after[1] < 1.0
    assert before[0] < after[0] < one_side[0]


def test_bench_s_contender_hooks_the_policy_the_reference_and_the_critic(tmp_path):
    # bench.with_bf16_activations: within it the loaders a script calls hook their models; after it, the
    # loaders are the scripts' again.
    loaders = common.load_policy, common.load_reference, ppo.load_critic
    hooked = lambda model: bool(model.get_input_embeddings()._forward_hooks)  # noqa: E731
    args = ppo.Args(model="tiny", output_dir=str(tmp_path))
    device = torch.device("cpu")
    with bench.with_bf16_activations():
        policy, _, _ = common.load_policy(args, device, torch.float32)
        reference = common.load_reference(args, policy, device, torch.float32)
        critic = ppo.load_critic(args, device, torch.float32)
    assert hooked(policy) and hooked(reference) and hooked(critic.backbone)
    assert (common.load_policy, common.load_reference, ppo.load_critic) == loaders
    with bench.with_bf16_activations(False):
        assert not hooked(common.load_policy(args, device, torch.float32)[0])
