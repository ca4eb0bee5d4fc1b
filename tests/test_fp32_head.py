"""Under bf16 autocast (the GPU recipe) the LM head computes in fp32, in generate and in
sequence_logprobs alike (fp32_lm_head): logits rounded to bf16 lie on a grid of 2^-7 of their
size (0.125 near 20), and that rounding reaches the sampler's and the trainer's log-probs. Run
here under CPU bf16 autocast, which takes the same code."""

import pytest
import torch

import common
import dapo
import grpo
import ppo

SCRIPTS = [grpo, dapo, ppo]


def tiny():
    model, tokenizer, _ = common.load_model("tiny", torch.device("cpu"), torch.float32)
    return model.eval(), tokenizer


def test_the_logits_are_the_fp32_product_of_the_hidden_state_and_the_head():
    model, _ = tiny()
    ids = torch.tensor([[5, 9, 13, 2]])
    head = model.get_output_embeddings()
    seen = {}
    hook = head.register_forward_hook(lambda module, inputs, output: seen.update(hidden=inputs[0], logits=output))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(input_ids=ids).logits
        rounded = seen["logits"]
        with common.fp32_lm_head(model):
            fp32 = model(input_ids=ids).logits
    hook.remove()
    assert bf16.dtype == rounded.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    # the head's product in fp32 of what reached it (the backbone stays bf16 under autocast)
    expected = seen["hidden"].float() @ head.weight.float().T
    torch.testing.assert_close(fp32, expected, rtol=0, atol=1e-5)
    # not bf16's numbers: most fp32 logits fall between two bf16 values, and autocast's differ
    assert (fp32 != fp32.to(torch.bfloat16).float()).float().mean() > 0.9
    assert (bf16.float() - expected).abs().max() > 0
    assert "forward" not in head.__dict__  # the head is itself again outside


def test_no_autocast_no_change_and_a_lora_head_is_left_alone():
    model, _ = tiny()
    head = model.get_output_embeddings()
    with common.fp32_lm_head(model):  # fp32 everywhere already: nothing to do
        assert "forward" not in head.__dict__

    class Adapted(torch.nn.Module):  # stands for peft's LoRA-wrapped head: not a plain Linear
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, hidden):
            return self.base_layer(hidden)

    model.lm_head = Adapted(head)
    with torch.autocast("cpu", dtype=torch.bfloat16), common.fp32_lm_head(model):
        assert "forward" not in model.lm_head.__dict__


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_generate_and_sequence_logprobs_both_read_fp32_logits(script):
    model, tokenizer = tiny()
    head = model.get_output_embeddings()
    dtypes = []
    hook = head.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    ids = torch.randint(3, 300, (4, 7))
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        completion, completion_mask, _, sample_logp, _ = script.generate(
            model, ids, mask, 6, [], 0, 300, temperature=1.0
        )
        logp, _ = script.sequence_logprobs(model, ids, mask, completion, completion_mask, 1.0, 300, chunk_size=2)
    hook.remove()
    assert dtypes and set(dtypes) == {torch.float32}  # the prefill, every decode step, every chunk
    # sampler and scorer agree to what the bf16 backbone's batch shapes leave
    assert (logp - sample_logp)[completion_mask.bool()].abs().max() < 0.1


def test_the_lora_reference_scores_with_the_fp32_head_too():
    # With LoRA the reference is the policy with its adapters off (common.AdaptersOff): its
    # log-probs must come from the same fp32 head as the policy's, or the KL term would read
    # bf16's rounding. The default targets (all-linear) leave the LM head a plain Linear.
    from types import SimpleNamespace

    model, _ = tiny()
    policy = common.with_adapters(model, SimpleNamespace(lora_rank=4, lora_alpha=8.0, lora_targets="all-linear"))
    reference = common.AdaptersOff(policy)
    common.plain_head(reference)  # its one-token look at the head (once per model), before the counting
    dtypes = []
    hook = policy.get_output_embeddings().register_forward_hook(lambda m, i, output: dtypes.append(output.dtype))
    ids = torch.randint(3, 300, (2, 5))
    completion = torch.randint(3, 300, (2, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grpo.sequence_logprobs(
            reference, ids, torch.ones_like(ids), completion, torch.ones_like(completion), 1.0, 300, 2
        )
    hook.remove()
    assert dtypes == [torch.float32]


def test_the_tf32_head_product_has_the_gradient_of_the_linear_layer():
    # HeadProduct (the LM head on a GPU, TF32) computes the forward and both backward GEMMs
    # itself: in float64 at torch's "ieee" precision they must be the linear layer's exactly
    # (gradcheck: against finite differences), with and without a bias.
    torch.manual_seed(0)
    hidden = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    product = common.HeadProduct.apply
    assert torch.autograd.gradcheck(lambda h, w, b: product(h, w, b, "ieee"), (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w: product(h, w, None, "ieee"), (hidden, weight))
    assert torch.equal(product(hidden, weight, bias, "ieee"), torch.nn.functional.linear(hidden, weight, bias))


def test_the_head_precision_is_set_for_its_gemms_alone():
    # matmul_precision restores what was set before, and sets nothing outside it; autocast() turns
    # autocast on only with a compute dtype.
    before = torch.backends.cuda.matmul.fp32_precision
    with common.matmul_precision("tf32"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == before
    with common.autocast(torch.device("cpu"), torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    with common.autocast(torch.device("cpu"), None):  # fp32 on the CPU: no autocast
        assert not torch.is_autocast_enabled("cpu")
