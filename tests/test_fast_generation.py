"""The fast generate (static KV cache, one prefill per distinct prompt, EOS checked every
check_every tokens) against the plain loop it replaced, kept below verbatim as loop_generate:
the same tokens, masks and truncation flags, log-probs within 1e-5, and the random generator
left where the loop left it, so every later draw of a run stays the same."""

import pytest
import torch

import common
from common import cache_argument, load_model
from conftest import greedy_by_recomputation
from grpo import encode_prompts, generate, top_p_filter

PROMPTS = [  # very different lengths, so the batch is heavily left padded
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Using the numbers [3, 5, 7, 11], create an equation that equals 42."}],
    [{"role": "system", "content": "Think first."}, {"role": "user", "content": "Reply with a digit."}],
]
GROUP = 3  # G completions per prompt, from one shared prefill
MAX_NEW = 64


@torch.no_grad()
def loop_generate(
    model,
    prompt_ids: torch.Tensor,  # (N, P) left padded
    prompt_mask: torch.Tensor,  # (N, P) 1 for prompt tokens, 0 for padding
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    vocab_size: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
):
    """grpo.generate as it was before the static cache: transformers' DynamicCache grown by
    torch.cat, the attention mask concatenated every token, a host sync every token. Kept
    verbatim as the reference the fast generate must reproduce token for token.

    temperature 0 means greedy. Only ids below vocab_size are ever sampled (Qwen's embedding
    has ~270 more rows than its tokenizer has tokens). A completion ends with the first EOS
    id it samples; that EOS is part of the completion (it is what teaches the model to stop),
    and later positions hold pad_id with mask 0. Returns
      completion_ids  (N, T) T ≤ max_new_tokens: the longest completion, right padded
      completion_mask (N, T) 1 up to and including the EOS
      truncated       (N,)   True where no EOS came within max_new_tokens
      sample_logp     (N, T) log π(token) under the sampling distribution, before top-p
                             (the one sequence_logprobs scores), 0 where masked
    """
    was_training = model.training
    model.eval()  # no dropout, and gradient checkpointing (train-mode only) keeps the cache
    num_rows = prompt_ids.shape[0]
    eos = torch.tensor(eos_ids, device=prompt_ids.device)
    attention_mask = prompt_mask.clone()
    # Left padding shifts every prompt; positions count real tokens only, so a prompt
    # scores the same whatever batch it is in.
    position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (N, P)
    out = model(
        input_ids=prompt_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1
    )
    next_position = position_ids[:, -1:] + 1  # (N, 1)
    finished = torch.zeros(num_rows, dtype=torch.bool, device=prompt_ids.device)
    tokens, masks, logps = [], [], []
    for t in range(max_new_tokens):
        logits = out.logits[:, -1, :vocab_size].float()  # (N, V) ids ≥ vocab_size are cut off
        scaled = logits / (temperature if temperature > 0 else 1.0)  # (N, V)
        # logit − logsumexp, the formula sequence_logprobs scores with, not F.log_softmax: on the
        # CPU that kernel sums exp(x − max) in 16 (AVX-512) or 8 (AVX2) fp32 running sums, and in
        # the one holding the max (exp 0 = 1) every later term below 2^-24 rounds away. A confident
        # model over a 150k vocabulary then gets log π of every token ~1e-5 too high.
        logp = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)  # (N, V)
        if temperature > 0:
            token = torch.multinomial(top_p_filter(logp.exp(), top_p), 1).squeeze(-1)  # (N,)
        else:
            token = logits.argmax(dim=-1)  # (N,)
        token_logp = logp.gather(-1, token[:, None]).squeeze(-1)  # (N,)
        alive = ~finished
        token = torch.where(alive, token, pad_id)
        tokens.append(token)
        masks.append(alive)
        logps.append(torch.where(alive, token_logp, 0.0))
        finished = finished | (alive & torch.isin(token, eos))
        if finished.all() or t == max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, alive[:, None].to(attention_mask.dtype)], dim=-1)
        out = model(
            input_ids=token[:, None],
            attention_mask=attention_mask,
            position_ids=next_position,
            **{cache_argument(model): out[cache_argument(model)]},  # transformers 5.24: `cache`
            use_cache=True,
        )
        next_position = next_position + 1
    model.train(was_training)
    completion_ids = torch.stack(tokens, dim=1)  # (N, T)
    completion_mask = torch.stack(masks, dim=1).long()  # (N, T)
    sample_logp = torch.stack(logps, dim=1)  # (N, T)
    return completion_ids, completion_mask, ~finished, sample_logp


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def tiny(request):
    torch.manual_seed(0)
    model, tokenizer, _ = load_model(request.param, torch.device("cpu"))
    return model.eval(), tokenizer


def frequent_tokens(model, tokenizer, prompt_ids, prompt_mask, temperature, top_p) -> list[int]:
    """The 40 tokens the model emits most often (of ~380 it samples near-uniformly): as EOS ids
    they end rows at different steps in the middle of the completion, where the tiny random
    models' real EOS almost never comes."""
    torch.manual_seed(7)
    ids, _, _, _ = loop_generate(
        model, prompt_ids, prompt_mask, 12, [], tokenizer.pad_token_id, len(tokenizer), temperature, top_p
    )
    return ids[:, 2:].flatten().bincount().topk(40).indices.tolist()


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_fast_generate_reproduces_the_loop(tiny, temperature, top_p):
    model, tokenizer = tiny
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, GROUP, torch.device("cpu"))
    assert (prompt_mask == 0).any(), "the batch must contain left padding"
    eos = frequent_tokens(model, tokenizer, prompt_ids, prompt_mask, temperature, top_p)
    settings = (MAX_NEW, eos, tokenizer.pad_token_id, len(tokenizer), temperature, top_p)
    torch.manual_seed(3)
    expected = loop_generate(model, prompt_ids, prompt_mask, *settings)
    after_loop = torch.rand(4)  # the next draws of the run
    torch.manual_seed(3)
    # compact_below=0: rows that have ended stay in the batch, as in the loop. Once they leave
    # (the default), the random numbers go to other rows and the sampled tokens of a seed differ
    # from the loop's; their distribution does not (tests/test_compaction.py).
    ids, mask, truncated, logp, _ = generate(model, prompt_ids, prompt_mask, *settings, compact_below=0.0)
    after_fast = torch.rand(4)
    lengths = mask.sum(-1)
    # The case is the intended one: some rows end early, at different steps, and all before the cap,
    # so the fast loop ran past the last EOS (up to the next multiple of 16) and had to rewind.
    assert lengths.min() < lengths.max() < MAX_NEW and (lengths < MAX_NEW).all()
    assert ids.shape[1] == lengths.max() and ids.shape[1] % 16 != 0
    assert torch.equal(ids, expected[0])
    assert torch.equal(mask, expected[1])
    assert torch.equal(truncated, expected[2])
    assert (logp - expected[3]).abs().max().item() <= 1e-5
    assert torch.equal(after_fast, after_loop)
    assert (ids < len(tokenizer)).all()


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_truncated_rows_and_the_rng_match_the_loop(tiny, temperature):
    # No row ends (an EOS id the model never samples): every row is truncated at max_new_tokens,
    # T = max_new_tokens, and the generator advanced by exactly max_new_tokens draws (none greedy).
    model, tokenizer = tiny
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 2, torch.device("cpu"))
    settings = (20, [len(tokenizer) + 5], tokenizer.pad_token_id, len(tokenizer), temperature, 1.0)
    torch.manual_seed(4)
    expected = loop_generate(model, prompt_ids, prompt_mask, *settings)
    after_loop = torch.rand(4)
    torch.manual_seed(4)
    ids, mask, truncated, logp, _ = generate(model, prompt_ids, prompt_mask, *settings)
    assert ids.shape == (6, 20) and truncated.all()
    assert torch.equal(ids, expected[0]) and torch.equal(mask, expected[1])
    assert (logp - expected[3]).abs().max().item() <= 1e-5
    assert torch.equal(torch.rand(4), after_loop)


@pytest.mark.parametrize("check_every", [1, 5, 64])
def test_check_interval_changes_nothing(tiny, check_every):
    model, tokenizer = tiny
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, GROUP, torch.device("cpu"))
    eos = frequent_tokens(model, tokenizer, prompt_ids, prompt_mask, 1.0, 1.0)
    settings = (MAX_NEW, eos, tokenizer.pad_token_id, len(tokenizer), 1.0)
    torch.manual_seed(5)
    # compact_below=0: finished rows leave the batch only at the checks, so with compaction the
    # interval decides which rows draw which random numbers (tests/test_compaction.py).
    expected = generate(model, prompt_ids, prompt_mask, *settings, compact_below=0.0)  # check_every = 16
    after_default = torch.rand(4)
    torch.manual_seed(5)
    ids, mask, truncated, logp, _ = generate(
        model, prompt_ids, prompt_mask, *settings, check_every=check_every, compact_below=0.0
    )
    assert torch.equal(ids, expected[0]) and torch.equal(mask, expected[1]) and torch.equal(logp, expected[3])
    assert torch.equal(torch.rand(4), after_default)


def test_greedy_equals_the_loop_and_full_recomputation_with_groups_and_eos():
    # Greedy with the static cache and a shared prefill picks the tokens of the loop and of
    # recomputing the whole sequence (prompt + tokens so far, no cache) at every step, up to each
    # row's EOS. tiny-llama: the tiny Qwen2 model's greedy completion is one token repeated.
    torch.manual_seed(0)
    model, tokenizer, _ = load_model("tiny-llama", torch.device("cpu"))
    model.eval()
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 2, torch.device("cpu"))
    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    plain, _, _, _ = loop_generate(model, prompt_ids, prompt_mask, 12, [], pad, vocab, 0.0)
    eos = [plain[2, 4].item()]  # the second prompt's 5th token: its rows end there, the others later or never
    expected = loop_generate(model, prompt_ids, prompt_mask, 40, eos, pad, vocab, 0.0)
    cached, mask, truncated, logp, _ = generate(model, prompt_ids, prompt_mask, 40, eos, pad, vocab, 0.0)
    assert mask.sum(-1).min() < mask.shape[1], "some row must end before the longest"
    assert torch.equal(cached, expected[0]) and torch.equal(mask, expected[1]) and torch.equal(truncated, expected[2])
    assert (logp - expected[3]).abs().max().item() <= 1e-5
    recomputed = greedy_by_recomputation(model, prompt_ids, prompt_mask, cached.shape[1], vocab)
    assert torch.equal(cached[mask.bool()], recomputed[mask.bool()])


def test_each_distinct_prompt_is_prefilled_once(tiny):
    # 3 prompts × G = 4: the first forward pass sees 3 rows, every later one all 12.
    model, tokenizer = tiny
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 4, torch.device("cpu"))
    rows = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        torch.manual_seed(6)
        ids, _, _, _, _ = generate(model, prompt_ids, prompt_mask, 6, [], tokenizer.pad_token_id, len(tokenizer))
    finally:
        hook.remove()
    assert rows[0] == (3, prompt_ids.shape[1])
    assert rows[1:] == [(12, 1)] * 5
    assert len({tuple(row) for row in ids[:4].tolist()}) > 1  # the group shares a prefill, not its samples


def test_never_an_id_beyond_the_vocabulary(tiny):
    # Cut the vocabulary to half the model's rows: no sampled or greedy id reaches the cut.
    model, tokenizer = tiny
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 2, torch.device("cpu"))
    vocab = len(tokenizer) // 2
    for temperature in (1.0, 0.0):
        torch.manual_seed(8)
        ids, mask, _, _, _ = generate(model, prompt_ids, prompt_mask, 30, [], 0, vocab, temperature)
        assert ids.shape == (6, 30) and (ids < vocab).all()


def test_the_left_aligned_cache_keeps_prompts_with_gaps(tiny, varlen):
    # generate's one-token step as on a GPU in bf16 (conftest's varlen: KVCache.align_left, each row
    # writing at its own column, flash attention's varlen entry by its contract) samples what the
    # masked step samples: greedy tokens equal, log-probs to 1e-5, with prompts whose mask has a gap
    # as well as left padding (align_left keeps a prompt's tokens in order, the gap left out, as the
    # masked step's positions and mask do; taking each row's last len columns, planted, fails).
    model, tokenizer = tiny
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 2, torch.device("cpu"))
    prompt_mask[:2, -4] = 0  # the first prompt's rows: one token left out, inside the prompt
    settings = (prompt_ids, prompt_mask, 12, [], tokenizer.pad_token_id, len(tokenizer), 0.0)
    aligned = generate(model, *settings)
    assert varlen, "the varlen step must have run"
    varlen.clear()

    original = common.varlen_decode
    common.varlen_decode = lambda model, cache: False
    try:
        masked = generate(model, *settings)
    finally:
        common.varlen_decode = original
    assert not varlen
    assert torch.equal(aligned[0], masked[0]) and torch.equal(aligned[1], masked[1])
    assert (aligned[3] - masked[3]).abs().max().item() <= 1e-5
