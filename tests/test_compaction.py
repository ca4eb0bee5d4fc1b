"""generate's decode touches what it must: once at most half the rows decoded are unfinished,
the finished ones leave the batch (KVCache.keep_rows); the one-token step attends over the
filled columns only (decode_widths); keys are cached in the compute dtype. Greedy tokens stay
those of the loop generate replaced; sampled ones for a seed change (other rows draw the random
numbers), their distribution must not: each token's log-prob is the one a fresh scoring pass
gives, and compacted and uncompacted runs give the same length distribution."""

import pytest
import torch

from common import decode_widths, load_model
from grpo import KVCache, encode_prompts, generate, sequence_logprobs
from tests.test_fast_generation import PROMPTS, frequent_tokens, loop_generate


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    return model.eval(), tokenizer


def decoded_rows(model):
    """The batch size of every forward pass of model: a list the caller reads, and the hook."""
    rows = []
    hook = model.register_forward_pre_hook(lambda _, a, k: rows.append(k["input_ids"].shape[0]), with_kwargs=True)
    return rows, hook


def test_decode_widths_double_from_64():
    assert decode_widths(100, 1024) == [164, 228, 356, 612, 1124]
    assert decode_widths(7, 64) == [71] and decode_widths(7, 20) == [27] and decode_widths(7, 65) == [71, 72]


def test_greedy_with_finished_rows_leaving_equals_the_loop():
    # Prompts 0 and 1 end at their first token (their greedy first token, 248, is the EOS id);
    # prompt 2's rows go on. At the first check 3 of 9 rows are live: the batch shrinks to 3,
    # and the tokens, masks, truncation flags and log-probs are still the loop's. tiny-llama:
    # the tiny Qwen2 model's greedy completion is one token repeated, the same for every prompt.
    torch.manual_seed(0)
    model, tokenizer, _ = load_model("tiny-llama", torch.device("cpu"))
    model.eval()
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 3, torch.device("cpu"))
    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    plain, _, _, _ = loop_generate(model, prompt_ids, prompt_mask, 40, [], pad, vocab, 0.0)
    eos = [plain[0, 0].item()]
    assert plain[3, 0] == eos[0]
    assert not set(eos) & set(plain[6].tolist()), "prompt 2 must not end"
    expected = loop_generate(model, prompt_ids, prompt_mask, 40, eos, pad, vocab, 0.0)
    for check_every in (1, 16):
        rows, hook = decoded_rows(model)
        ids, mask, truncated, logp, _ = generate(
            model, prompt_ids, prompt_mask, 40, eos, pad, vocab, 0.0, 1.0, check_every
        )
        hook.remove()
        # prefill (3 distinct prompts), then 39 one-token steps: 9 rows until the first check, 3 after it
        assert rows == [3] + [9] * (check_every - 1) + [3] * (40 - check_every)
        assert mask.sum(-1).tolist() == [1] * 6 + [40] * 3 and truncated.tolist() == [False] * 6 + [True] * 3
        assert torch.equal(ids, expected[0]) and torch.equal(mask, expected[1]) and torch.equal(truncated, expected[2])
        assert (logp - expected[3]).abs().max().item() <= 1e-5


def test_sampled_logprobs_after_compaction_equal_a_fresh_scoring_pass(tiny):
    # Rows leave the batch at several checks (every 4 tokens); every kept token's sampler
    # log-prob is the one sequence_logprobs gives the finished completion, fp32, ≤ 1e-5: each
    # row went on with its own cache, position and mask.
    model, tokenizer = tiny
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 8, torch.device("cpu"))
    eos = frequent_tokens(model, tokenizer, prompt_ids, prompt_mask, 1.0, 1.0)
    torch.manual_seed(11)
    rows, hook = decoded_rows(model)
    ids, mask, truncated, sample_logp, _ = generate(
        model, prompt_ids, prompt_mask, 48, eos, tokenizer.pad_token_id, len(tokenizer), 1.0, 1.0, 4
    )
    hook.remove()
    assert len(set(rows[1:])) >= 3 and rows[1] == 24 and min(rows[1:]) < 12, rows  # shrank at least twice
    assert torch.equal(truncated, mask.sum(-1) == 48)
    scored, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, len(tokenizer), 8)
    assert mask.sum() > 100
    assert (sample_logp - scored).abs().max().item() <= 1e-5
    assert (ids[mask == 0] == tokenizer.pad_token_id).all()


def test_compaction_keeps_the_distribution_of_lengths(tiny):
    # 512 completions with and without compaction (4 seeds × 128 rows, 40 EOS ids ≈ 10% of the
    # mass at every token): the mean lengths agree within 4 standard errors of their difference,
    # and the two empirical length distributions within a Kolmogorov-Smirnov distance of 0.1
    # (the 1% critical value for two samples of 512 is 1.63·√(2/512) = 0.10).
    model, tokenizer = tiny
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS[:2], 64, torch.device("cpu"))
    eos = frequent_tokens(model, tokenizer, prompt_ids[::64], prompt_mask[::64], 1.0, 1.0)
    lengths = {}
    for compact_below in (0.0, 0.5):
        runs = []
        for seed in range(4):
            torch.manual_seed(100 + seed)
            _, mask, _, _, _ = generate(
                model, prompt_ids, prompt_mask, 24, eos, tokenizer.pad_token_id, len(tokenizer), 1.0, 1.0, 2,
                compact_below=compact_below,
            )  # fmt: skip
            runs.append(mask.sum(-1).float())
        lengths[compact_below] = torch.cat(runs)
    plain, compacted = lengths[0.0], lengths[0.5]
    assert 3 < plain.mean() < 20  # most rows end early, some run to the cap
    standard_error = (plain.var() / 512 + compacted.var() / 512).sqrt()
    assert (plain.mean() - compacted.mean()).abs() < 4 * standard_error
    grid = torch.arange(1, 25)
    cdf = lambda x: (x[:, None] <= grid).float().mean(0)  # noqa: E731
    assert (cdf(plain) - cdf(compacted)).abs().max() < 0.1


def test_keys_are_cached_in_the_compute_dtype():
    # Under bf16 autocast with fp32 weights the rotary embedding hands the cache fp32 keys
    # beside bf16 values; both are stored in bf16, the dtype attention computes in.
    cache = KVCache(2, 6)
    cache.slots, cache.width = torch.arange(3), 3
    keys, values = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4).bfloat16()
    got_keys, got_values = cache.update(keys, values, 0)
    assert cache.keys[0].dtype == cache.values[0].dtype == torch.bfloat16
    assert got_keys.shape == (2, 1, 3, 4) and torch.equal(got_keys, keys.bfloat16())
    model, tokenizer, eos = load_model("tiny", torch.device("cpu"))
    prompt_ids = torch.randint(0, 300, (2, 5))
    with torch.autocast("cpu", torch.bfloat16):
        ids, mask, _, _, _ = generate(model, prompt_ids, torch.ones_like(prompt_ids), 3, [], 0, len(tokenizer), 0.0)
    assert ids.shape == (2, 3)
