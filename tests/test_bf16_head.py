"""Issue 58's lever 3, its precision half: the LM head's GEMMs with bf16 inputs and fp32 sums and output
(common.HEAD_PRECISION = "bf16", bench.py --head_precision bf16), a contender against TF32, the scripts'
head on a GPU. A GPU runs it as torch.mm's bf16 GEMM with an fp32 output, CUDA's alone; the CPU computes
the same products from the rounded inputs in fp32 (head_mm), which these tests force with head_precision.
The CUDA tier checks the GPU's GEMM against that."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bench
import common
from common import HeadLogprobs, HeadProduct, head_mm, load_model
from grpo import encode_prompts, generate, sequence_logprobs, token_logprobs

PROMPTS = [[{"role": "user", "content": "Reply with a digit."}], [{"role": "user", "content": "Hi"}]]


def test_bf16_inputs_are_rounded_and_their_products_summed_in_fp32():
    # By hand. bf16 keeps 8 significant bits: 1 + 2⁻⁹ rounds to 1 (half a step at 1 is 2⁻⁸), so
    # [1 + 2⁻⁹, 3] · [2, 1 + 2⁻⁹] is 2 + 3 = 5, where fp32 gives 5 + 5·2⁻⁹ = 5.009765625. The sums are
    # fp32's: 256 + 1 = 257, which bf16 cannot hold (its step at 256 is 2), and `into` adds in place.
    a, b = torch.tensor([[1 + 2**-9, 3.0], [256.0, 1.0]]), torch.tensor([[2.0], [1 + 2**-9]])
    assert head_mm(a, b, "ieee").flatten().tolist() == [5.009765625, 513.001953125]  # 512 + 1 + 2⁻⁹
    assert head_mm(a, b, "bf16").flatten().tolist() == [5.0, 513.0]  # summed in bf16, 513 would be 512
    assert head_mm(a[1:], torch.tensor([[1.0], [1.0]]), "bf16").item() == 257.0
    into = torch.ones(2, 1)
    assert head_mm(a, b, "bf16", into=into) is into and into.flatten().tolist() == [6.0, 514.0]


def rounded(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double()


def test_head_logprobs_in_bf16_equal_the_formula_on_the_rounded_product():
    # log π and H of the logits computed in fp64 from the bf16-rounded hidden states and weight (and the
    # fp32 bias): to fp32's rounding, not bf16's; the same head in fp32 ("ieee") differs from them by far
    # more (the rounding of its inputs: what the test tells apart). The gradients equal autograd's
    # through HeadProduct in bf16 over the whole logits, the same products: to 1e-5 of the largest.
    torch.manual_seed(0)
    hidden = torch.randn(64, 16, requires_grad=True)  # (M, d)
    weight, bias = torch.randn(40, 16, requires_grad=True), torch.randn(40, requires_grad=True)  # (V', d), V = 30
    tokens, weights = torch.randint(0, 30, (64,)), torch.randn(64, 2)
    settings = (0.7, 30, True, True)

    def head(precision):
        out = HeadLogprobs.apply(
            hidden, weight, bias, tokens, *settings, precision, 5, token_logprobs, common.logit_gradient
        )
        (out * weights).sum().backward()
        grads = hidden.grad, weight.grad, bias.grad
        hidden.grad = weight.grad = bias.grad = None
        return out.detach(), grads

    out, grads = head("bf16")
    logits = rounded(hidden.detach()) @ rounded(weight.detach()).T + bias.detach().double()  # (M, V') fp64
    expected = token_logprobs(logits, tokens, *settings).float()
    assert (out - expected).abs().max() <= 1e-5
    assert (head("ieee")[0] - expected).abs().max() > 1e-3
    autograd = token_logprobs(HeadProduct.apply(hidden, weight, bias, "bf16"), tokens, *settings)
    (autograd * weights).sum().backward()
    for mine, theirs in zip(grads, (hidden.grad, weight.grad, bias.grad)):
        assert (mine - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_the_weight_is_cast_to_bf16_once_a_pass_not_once_a_chunk():
    # head_operands: HeadLogprobs casts the fp32 weight to bf16 once in forward and once in backward,
    # whatever the chunks (13 here); head_mm's own cast of an already bf16 weight, or of its transpose,
    # makes no copy. (The CPU's emulation then makes fp32 copies of the bf16 operands: not counted.)
    torch.manual_seed(0)
    hidden, weight = torch.randn(64, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    tokens = torch.randint(0, 30, (64,))
    casts = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            bf16 = func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16
            casts.append(bf16 and out.shape in (weight.shape, weight.T.shape))
            return out

    with Casts():
        out = HeadLogprobs.apply(
            hidden, weight, None, tokens, 1.0, 30, True, True, "bf16", 5, token_logprobs, common.logit_gradient
        )
        out.sum().backward()
    assert sum(casts) == 2


def test_the_head_s_precision_is_the_gpu_s_alone():
    # HEAD_PRECISION ("tf32", the scripts') on a GPU; on the CPU None: fp32_lm_head's plain fp32 product.
    assert common.head_precision(SimpleNamespace(is_cuda=True)) == "tf32"
    assert common.head_precision(torch.zeros(1)) is None
    assert common.head_weight(torch.nn.Module()) is None  # no LM head


def test_head_product_in_bf16_has_the_linear_layer_s_gradient_of_the_rounded_inputs():
    # d(h·Wᵀ + b): dh = g·W, dW = gᵀ·h, db = Σ g, each GEMM's inputs rounded to bf16 (g too) and summed
    # in fp32: against fp64 autograd through the rounded product, to 1e-5 of the largest; backward called
    # within bf16 autocast too (its products stay fp32, not autocast's bf16). No rows: no logits.
    torch.manual_seed(1)
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    weight, bias = torch.randn(10, 8, requires_grad=True), torch.randn(10, requires_grad=True)
    grad = torch.randn(2, 3, 10)
    out = HeadProduct.apply(hidden, weight, bias, "bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.backward(grad)
    assert HeadProduct.apply(hidden[:, :0], weight, bias, "bf16").shape == (2, 0, 10)
    g, h, w = rounded(grad).reshape(6, 10), rounded(hidden.detach()).reshape(6, 8), rounded(weight.detach())
    assert (out.detach().double() - (h @ w.T + bias.detach().double()).reshape(2, 3, 10)).abs().max() <= 1e-5
    assert (hidden.grad.double() - (g @ w).reshape(2, 3, 8)).abs().max() <= 1e-5 * hidden.grad.abs().max()
    assert (weight.grad.double() - g.T @ h).abs().max() <= 1e-5 * weight.grad.abs().max()
    assert torch.allclose(bias.grad, grad.sum((0, 1)))


def gaps(model, tokenizer, sampler: str | None, trainer: str | None, monkeypatch) -> tuple[float, float]:
    """The sampler's log-probs against the trainer's under CPU bf16 autocast, each head's GEMMs in the precision
    given (None: fp32, the CPU's): (mean, max) |Δ log π|."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS * 4, 4, "cpu")
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        monkeypatch.setattr(common, "head_precision", lambda hidden: sampler)
        ids, mask, _, sample_logp, _ = generate(
            model, prompt_ids, prompt_mask, 48, [tokenizer.eos_token_id], tokenizer.pad_token_id, len(tokenizer)
        )
        monkeypatch.setattr(common, "head_precision", lambda hidden: trainer)
        with torch.no_grad():
            logp, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, len(tokenizer), 4)
    gap = (logp - sample_logp).abs()[mask.bool()]
    return gap.mean().item(), gap.max().item()


def test_the_sampler_and_the_trainer_share_the_bf16_head(monkeypatch):
    # The decode step reads the head's weight cast to bf16 once a generate call (head_weight), the
    # trainer casts it once a pass: the same products, so their gap is the backbone's, as with the fp32
    # head, and within the CUDA tier's bounds (mean 0.05, max 1 nat); a bf16 head on the sampler's side
    # alone (planted) doubles the mean.
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    fp32 = gaps(model, tokenizer, None, None, monkeypatch)
    bf16 = gaps(model, tokenizer, "bf16", "bf16", monkeypatch)
    one_side = gaps(model, tokenizer, "bf16", None, monkeypatch)
    print(f"sampler vs trainer, bf16 autocast: fp32 head {fp32}, bf16 head {bf16}, sampler's alone {one_side}")
    assert bf16[0] < 0.05 and bf16[1] < 1.0
    assert bf16[0] < 2 * fp32[0] and one_side[0] > 2 * bf16[0]


def test_the_decode_step_casts_the_head_once_a_generate_call(monkeypatch):
    # head_weight: a bf16 copy for the bf16 head under autocast; none for TF32 or the CPU's fp32, nor
    # without autocast (fp32_lm_head leaves the head alone), nor for a weight that is no Parameter (a
    # DTensor shard); each step's head reads DecodeStep's copy.
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    sharded = copy.deepcopy(model)
    del sharded.lm_head.weight
    sharded.lm_head.weight = model.lm_head.weight.detach().clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert common.head_weight(model) is None
        monkeypatch.setattr(common, "head_precision", lambda hidden: "bf16")
        weight = common.head_weight(model)
        assert common.head_weight(sharded) is None
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, model.lm_head.weight.detach().bfloat16())
    assert common.head_weight(model) is None
    read, apply = [], HeadProduct.apply
    monkeypatch.setattr(common, "head_weight", lambda model: weight)
    monkeypatch.setattr(
        HeadProduct, "apply", lambda hidden, w, *rest: read.append(w is weight) or apply(hidden, w, *rest)
    )
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 1, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        generate(model, prompt_ids, prompt_mask, 6, [], tokenizer.pad_token_id, len(tokenizer), 0.0)
    assert read == [False] + [True] * 5  # the prefill reads the head's own (cast in head_mm, once); 5 steps the copy


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_bench_s_head_precision_is_the_runtime_s_for_the_step(precision, monkeypatch):
    # bench.py --head_precision: the step runs with common.HEAD_PRECISION as given, and after it as it was.
    seen = []
    monkeypatch.setattr(bench.grpo, "train", lambda args: seen.append(common.HEAD_PRECISION) or 1 / 0)
    args = bench.Args(train_steps="grpo", head_precision=precision)
    with pytest.raises(ZeroDivisionError):
        bench.one_step(args, "grpo", "unused")
    assert seen == [precision] and common.HEAD_PRECISION == "tf32"
    with pytest.raises(SystemExit, match="--head_precision fp16"):
        bench.one_step(bench.Args(head_precision="fp16"), "grpo", "unused")
