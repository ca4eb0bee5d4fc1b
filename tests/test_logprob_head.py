"""The LM head of scoring and of the update, chunked (logprob_head): log-probs and entropies
straight from the hidden states, HEAD_CHUNK_BYTES of logits at a time, checkpointed so that no
(n, t, V) tensor is kept for backward. token_logprobs by hand; the chunked head against the whole
logits (values and gradients); what autograd keeps; plain_head's probe."""

import copy
import functools
import math

import pytest
import torch

import common
import dapo
import grpo
import ppo
from common import load_model
from conftest import sample_batch
from families import family_model, unbuildable

SCRIPTS = [grpo, dapo, ppo]


def test_token_logprobs_by_hand():
    # logits (1, 2, 3), token 2, τ = 1: logsumexp = log(e + e² + e³) = 3.407606, so
    #   log π = 3 − 3.407606 = −0.407606; π = (0.090031, 0.244728, 0.665241),
    #   H = 3.407606 − (0.090031·1 + 0.244728·2 + 0.665241·3) = 0.832396.
    # τ = 2 on token 0: z = (0.5, 1, 1.5), logsumexp 2.180270, log π = 0.5 − 2.180270 = −1.680270,
    #   H = 1.020191. Ids at or past vocab_size (the 4th column, 99) take no part.
    logits = torch.tensor([[1.0, 2.0, 3.0, 99.0], [1.0, 2.0, 3.0, 99.0]])
    out = grpo.token_logprobs(logits.clone(), torch.tensor([2, 0]), 1.0, 3, True, False)
    assert out[0].tolist() == pytest.approx([-0.407606, 0.832396], abs=1e-6)
    out = grpo.token_logprobs(logits.clone(), torch.tensor([0, 2]), 2.0, 3, True, False)
    assert out[0].tolist() == pytest.approx([-1.680270, 1.020191], abs=1e-6)
    assert grpo.token_logprobs(logits.clone(), torch.tensor([2, 0]), 1.0, 3, False, False)[:, 1].tolist() == [0, 0]


@pytest.mark.parametrize("scale", [1.0, 0.7])
def test_backward_makes_no_copies_of_the_logits(scale):
    # Backward through token_logprobs makes, of the logits' size ((…, V) or (…, V')), only what
    # its formula needs: the gather's and logsumexp's gradients (zeros, scatter_add, sub, exp, mul,
    # add), the division's where τ ≠ 1, and the slice's back to V' columns: 7 tensors at τ = 1,
    # 8 at τ = 0.7. Dividing in place on the slice (planted: the code before this test) makes
    # autograd copy the whole logits several times over (CopySlices), at τ = 1 too.
    from torch.utils._python_dispatch import TorchDispatchMode

    class LogitSized(TorchDispatchMode):  # the backward's results as large as the logits
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) in ((8, 30), (8, 40)):  # (…, V), (…, V')
                self.made.append(str(func))
            return out

    hidden, weight = torch.randn(8, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    out = grpo.token_logprobs(hidden @ weight.T, torch.randint(0, 30, (8,)), scale, 30, False, False)
    with LogitSized() as made:
        out[:, 0].sum().backward()
    assert len(made.made) <= (7 if scale == 1.0 else 8), made.made


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    return model, len(tokenizer), sample_batch(model, tokenizer, eos_ids)


def scored_with_gradient(script, model, batch, vocab_size, chunked: bool, monkeypatch, scale=0.7, entropy_grad=True):
    """log π and H of the batch, and the gradient of Σ w·log π + Σ u·H (fixed random w, u; H's part
    only with entropy_grad) at temperature `scale`, with the head chunked (chunks of 5 positions:
    many per row; HeadLogprobs' backward) or whole (autograd's through the whole logits)."""
    with monkeypatch.context() as patch:
        patch.setattr(common, "HEAD_CHUNK_BYTES", 4 * vocab_size * 5)
        if not chunked:
            patch.setattr(common, "plain_head", lambda model: False)
        model.zero_grad(set_to_none=True)
        sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
        logp, entropy = script.sequence_logprobs(model, *sequences, scale, vocab_size, 4, True, entropy_grad)
        weights = torch.Generator().manual_seed(1)
        w, u = torch.randn(logp.shape, generator=weights), torch.randn(logp.shape, generator=weights)
        ((w * logp).sum() + (u * entropy).sum()).backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy.detach(), gradient


def one_pass(script, monkeypatch, on: bool):
    """With on, forward_completions' one pass over prompt + completion a row (G = 1, gradient
    checkpointing), columns rounded up to 8 as on CUDA, where the head is handed the t positions
    that predict the completion (logits_to_keep) of rows padded on both sides."""
    if on:
        monkeypatch.setattr(common, "shape_multiple", lambda device: 8)
        monkeypatch.setattr(common, "forward_completions", functools.partial(common.forward_completions, share=False))


@pytest.mark.parametrize("settings", [(0.7, True), (1.0, False)], ids=["tau-0.7-entropy-grad", "tau-1"])
@pytest.mark.parametrize("whole_rows", [False, True], ids=["", "one-pass"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_the_chunked_head_equals_the_whole_logits(tiny, script, whole_rows, settings, monkeypatch):
    # The same products and formula chunk by chunk: log π and H to fp32 rounding (values of a few
    # nats, eps 1.2e-7: 1e-6), and the gradient to 1e-5 of its largest entry (HeadLogprobs' backward
    # is the formula dL/dz = g·(onehot − p) − g_H·p·(log p + H), and the head's weight gradient
    # sums its chunks in another order: ~50 terms of eps each). A sign or a 1/τ dropped from that
    # backward (planted) fails it; so does the entropy's term without H.
    if settings[0] == 1.0 and (script is not grpo or whole_rows):  # the same code (test_lockstep), CI's minutes
        pytest.skip("τ = 1 runs in grpo's shared-prompt case")
    model, vocab_size, batch = tiny
    one_pass(script, monkeypatch, whole_rows)
    model.train()
    chunked = scored_with_gradient(script, model, batch, vocab_size, True, monkeypatch, *settings)
    whole = scored_with_gradient(script, model, batch, vocab_size, False, monkeypatch, *settings)
    assert (chunked[0] - whole[0]).abs().max() <= 1e-6
    assert (chunked[1] - whole[1]).abs().max() <= 1e-6
    assert whole[2].abs().max() > 0
    assert (chunked[2] - whole[2]).abs().max() <= 1e-5 * whole[2].abs().max()


def test_the_head_weight_gradient_is_summed_in_place(tiny, monkeypatch):
    # HeadLogprobs adds each chunk's weight gradient into one (V', d) buffer (addmm_), so backward
    # makes as many tensors of the weight's size (that buffer, the tied embedding's gradients, the
    # prompt pass's head, their sums) with 5 positions a chunk (~30 chunks) as with one chunk.
    # Autograd's backward through checkpointed chunks (planted: the path before HeadLogprobs) made
    # two more a chunk, a product and a sum (144 against 30).
    from torch.utils._python_dispatch import TorchDispatchMode

    model, vocab_size, batch = tiny
    weight = model.get_output_embeddings().weight

    class WeightSized(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += isinstance(out, torch.Tensor) and out.shape == weight.shape and not func._schema.is_mutable
            return out

    model.train()
    made = {}
    for positions in (5, 10**6):
        with monkeypatch.context() as patch:
            patch.setattr(common, "HEAD_CHUNK_BYTES", 4 * vocab_size * positions)
            sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
            logp, _ = grpo.sequence_logprobs(model, *sequences, 1.0, vocab_size, 4)
            with WeightSized() as counted:
                logp.sum().backward()
        model.zero_grad(set_to_none=True)
        made[positions] = counted.made
    assert batch["completion_mask"].sum() > 20 * 5 and made[5] == made[10**6], made


def test_a_bf16_head_is_upcast_once_and_its_gradient_summed_in_fp32():
    # FSDP2 gathers the head in bf16, and LoRA keeps a frozen one in bf16, on a GPU; under autocast
    # fp32_lm_head's product reads it upcast to fp32, and HeadLogprobs reads it so, once a pass.
    # Against autograd through that product over the whole logits: log π and H to fp32 rounding
    # (1e-6 of each),
    # the hidden states' gradient to 1e-5 of its largest, and the weight's, summed over the 32
    # chunks in fp32 and rounded to bf16 once, equal to autograd's one rounding but where the two
    # fp32 sums straddle a bf16 step: one step, 2⁻⁷ of the entry at most. Summed chunk by chunk in bf16
    # (planted: autograd's accumulation through the checkpointed chunks before), it is not.
    torch.manual_seed(0)
    hidden = torch.randn(64, 16, requires_grad=True)  # (M, d)
    weight = (0.5 * torch.randn(40, 16)).bfloat16().requires_grad_()  # (V', d), V = 30 of them tokens
    tokens, weights = torch.randint(0, 30, (64,)), torch.randn(64, 2)
    precision = torch.backends.cuda.matmul.fp32_precision
    with torch.autocast("cpu", torch.bfloat16):
        out = common.HeadLogprobs.apply(
            hidden,
            weight,
            None,
            tokens,
            0.7,
            30,
            True,
            True,
            precision,
            2,
            grpo.token_logprobs,
            common.logit_gradient,
        )
    (out * weights).sum().backward()
    got = out.detach(), hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    expected = grpo.token_logprobs(hidden @ weight.float().T, tokens, 0.7, 30, True, True)  # (M, 2)
    (expected * weights).sum().backward()
    assert got[2].dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.allclose(got[0], expected.detach(), rtol=1e-6, atol=1e-6)  # log π down to −11: a few ulps
    assert (got[1] - hidden.grad).abs().max() <= 1e-5 * hidden.grad.abs().max()
    assert ((got[2].float() - weight.grad.float()).abs() <= 2**-7 * weight.grad.float().abs()).all()  # one step
    assert weight.grad.abs().max() > 0


def test_a_bf16_head_under_autocast_goes_through_head_logprobs(tiny, monkeypatch):
    # The tiny model in bf16 under CPU autocast, as FSDP2's bf16 gather computes on a GPU: the
    # update and scoring (no grad) take HeadLogprobs (not a checkpoint, nor an fp32 copy of the
    # weight, a chunk), and log π equals the whole logits' (the same bf16 layers, the same fp32
    # head product) to 1e-5, scoring's the update's bit for bit.
    from common import autocast

    model, vocab_size, batch = tiny
    bf16 = copy.deepcopy(model).to(torch.bfloat16).train()
    calls = []
    apply = common.HeadLogprobs.apply
    monkeypatch.setattr(common.HeadLogprobs, "apply", lambda *a: calls.append(1) or apply(*a))
    sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    scored = []
    for chunked in (True, False):
        with monkeypatch.context() as patch, autocast(torch.device("cpu"), torch.bfloat16):
            patch.setattr(common, "HEAD_CHUNK_BYTES", 4 * vocab_size * 5)
            if not chunked:
                patch.setattr(common, "plain_head", lambda model: False)
            logp, _ = grpo.sequence_logprobs(bf16, *sequences, 0.7, vocab_size, 4)
        logp.sum().backward()
        scored.append(logp.detach())
    assert len(calls) == 3  # the three chunks of 4 rows, each its own pass
    with torch.no_grad(), autocast(torch.device("cpu"), torch.bfloat16):  # scoring: the same function
        assert torch.equal(grpo.sequence_logprobs(bf16, *sequences, 0.7, vocab_size, 4)[0], scored[0])
    assert len(calls) == 6
    assert bf16.get_output_embeddings().weight.grad.dtype == torch.bfloat16
    assert (scored[0] - scored[1]).abs().max() <= 1e-5


def vocabulary_wide_saved(script, model, batch, vocab_size, chunked: bool, monkeypatch) -> int:
    """The elements of the tensors with a vocabulary-wide last dimension (logits, softmax) that
    autograd keeps for backward while scoring with grad, the head's weight aside."""
    sizes, weights = [0], {p.untyped_storage().data_ptr() for p in model.parameters()}

    def keep(tensor):
        if tensor.dim() and tensor.shape[-1] >= vocab_size and tensor.untyped_storage().data_ptr() not in weights:
            sizes.append(tensor.numel())
        return tensor

    with monkeypatch.context() as patch:
        patch.setattr(common, "HEAD_CHUNK_BYTES", 4 * vocab_size * 5)
        if not chunked:
            patch.setattr(common, "plain_head", lambda model: False)
        sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            logp, _ = script.sequence_logprobs(model, *sequences, 1.0, vocab_size, 4)
        logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return sum(sizes)


@pytest.mark.parametrize("whole_rows", [False, True], ids=["", "one-pass"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_no_logits_are_kept_for_backward(tiny, script, whole_rows, monkeypatch):
    # Whole: the logits of every chunk of rows are kept, at least 12 rows × 12 positions × 384 ids
    # (and their log-softmax's). Chunked: none (each chunk of positions is checkpointed: its
    # hidden states and tokens are kept, and backward recomputes its logits). The one pass hands the
    # head each row's t positions alone (logits_to_keep).
    model, vocab_size, batch = tiny
    one_pass(script, monkeypatch, whole_rows)
    whole = vocabulary_wide_saved(script, model, batch, vocab_size, False, monkeypatch)
    assert whole >= batch["completion_ids"].numel() * vocab_size
    assert vocabulary_wide_saved(script, model, batch, vocab_size, True, monkeypatch) == 0


def test_plain_head_finds_what_follows_the_head():
    # Gemma 2 soft-caps its logits (final_logit_softcapping 30) and Cohere2 scales them (logit_scale):
    # their logits are not the head's output; Qwen2, Llama and gpt-oss hand it back as it is. The
    # tiny models' logits are so small that tanh(x/30)·30 rounds to x: the probe's marker is not.
    for family, plain in {"qwen2": True, "llama3": True, "gpt-oss": True, "gemma2": False, "cohere2": False}.items():
        if unbuildable(family) is None:  # transformers 5.4 cannot build Cohere2's config
            assert common.plain_head(family_model(family)) is plain, family
    model = family_model("qwen2")
    model.get_output_embeddings = lambda: None  # no head to read: the whole logits
    assert common.plain_head(model) is False


@pytest.mark.parametrize("scale", [1.0, 2.0])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_logit_gradient_by_hand(scale, entropy_grad):
    # One position, z/τ = [0, ln 2, ln 5]: p = [1/8, 2/8, 5/8], the token is id 1, g = 1 on log π
    # and g_H = 0.5 on H = −Σ p ln p. d log π/dz = onehot − p; dH/dz_v = −p_v (ln p_v + H); both / τ.
    p = [1 / 8, 2 / 8, 5 / 8]
    entropy = -sum(q * math.log(q) for q in p)
    g_entropy = 0.5 if entropy_grad else 0.0
    expected = [((v == 1) - p[v] - g_entropy * p[v] * (math.log(p[v]) + entropy)) / scale for v in range(3)]
    z = scale * torch.tensor([[0.0, math.log(2), math.log(5)]])  # (1, 3)
    out = torch.tensor([[math.log(2 / 8), entropy]])  # the forward's log π and H
    grad = torch.tensor([[1.0, 0.5]])  # g, g_H (g_H read only with entropy_grad)
    dz = common.logit_gradient(z, torch.tensor([1]), out, grad, scale, entropy_grad)
    assert dz[0].tolist() == pytest.approx(expected, abs=1e-7)


def test_compile_fuses_the_heads_math_and_keeps_its_numbers(tiny, monkeypatch):
    # --compile: logprob_head hands HeadLogprobs the formula and logit_gradient through TorchInductor
    # (compiled_for: a model compile_blocks registered), a pass or two over a chunk's logits instead of
    # one an op; log π and H to fp32 rounding (1e-6), the gradient to 1e-5 of its largest entry.
    # A model compile_blocks did not compile keeps them eager.
    model, vocab_size, batch = tiny
    assert common.compiled_for(model, common.logit_gradient) is common.logit_gradient
    compiled = copy.deepcopy(model).train()
    handed = []
    apply = common.HeadLogprobs.apply
    monkeypatch.setattr(common.HeadLogprobs, "apply", lambda *a: handed.append(a[-2:]) or apply(*a))
    eager = scored_with_gradient(grpo, compiled, batch, vocab_size, True, monkeypatch)
    common.DECODE_BACKBONES[compiled] = compiled.model  # what compile_blocks registers: the head alone compiled
    fused = scored_with_gradient(grpo, compiled, batch, vocab_size, True, monkeypatch)
    assert handed[0] == (grpo.token_logprobs, common.logit_gradient)
    assert handed[-1] == tuple(common.COMPILED[f, "inductor"] for f in (grpo.token_logprobs, common.logit_gradient))
    assert (fused[0] - eager[0]).abs().max() <= 1e-6
    assert (fused[1] - eager[1]).abs().max() <= 1e-6
    assert (fused[2] - eager[2]).abs().max() <= 1e-5 * eager[2].abs().max()
