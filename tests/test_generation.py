"""KV-cache generation and log-prob scoring: the sampler and the scorer must agree."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import load_model
from conftest import greedy_by_recomputation
from grpo import encode_prompts, generate, sequence_logprobs, top_p_filter

PROMPTS = [  # very different lengths, so the batch is heavily left padded
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Using the numbers [3, 5, 7, 11], create an equation that equals 42."}],
    [{"role": "system", "content": "Think first."}, {"role": "user", "content": "Reply with a digit."}],
]


# Two architectures with different templates: Qwen2 + ChatML, and Llama (untied embeddings, a
# BOS from its template, a default system prompt, a pad token that set_pad_token chooses).
@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def tiny(request):
    torch.manual_seed(0)
    model, tokenizer, eos_ids = load_model(request.param, torch.device("cpu"))
    return model.eval(), tokenizer, eos_ids


def encode(tokenizer, group_size=1):
    return encode_prompts(tokenizer, PROMPTS, group_size, torch.device("cpu"))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_equal_scoring_logprobs(tiny, temperature):
    # ratio = 1 at the first update: log-probs recorded while sampling (KV cache, one token at
    # a time) equal those of one fresh forward pass over prompt + completion, fp32, ≤ 1e-5.
    model, tokenizer, eos_ids = tiny
    prompt_ids, prompt_mask = encode(tokenizer, group_size=2)
    assert (prompt_mask == 0).any(), "the batch must contain left padding"
    torch.manual_seed(1)
    ids, mask, _, sample_logp, _ = generate(
        model, prompt_ids, prompt_mask, 24, eos_ids, tokenizer.pad_token_id, len(tokenizer), temperature
    )
    with torch.no_grad():
        score_logp, _ = sequence_logprobs(
            model, prompt_ids, prompt_mask, ids, mask, temperature, len(tokenizer), chunk_size=4
        )
    assert mask.sum() > 20
    assert (sample_logp - score_logp).abs().max().item() <= 1e-5


def test_scoring_does_not_depend_on_padding(tiny):
    # The same prompt + completion scored alone (no padding) and inside a padded batch gives the
    # same log-probs: position ids count real tokens only.
    model, tokenizer, eos_ids = tiny
    prompt_ids, prompt_mask = encode(tokenizer)
    torch.manual_seed(2)
    ids, mask, _, _, _ = generate(model, prompt_ids, prompt_mask, 16, eos_ids, tokenizer.pad_token_id, len(tokenizer))
    with torch.no_grad():
        batched, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, len(tokenizer), 8)
        row = 0  # the shortest prompt: the most padding in the batch
        keep = prompt_mask[row].bool()
        alone, _ = sequence_logprobs(
            model, prompt_ids[row : row + 1, keep], prompt_mask[row : row + 1, keep], ids[row : row + 1],
            mask[row : row + 1], 1.0, len(tokenizer), 8,
        )  # fmt: skip
    assert (batched[row] - alone[0]).abs().max().item() <= 1e-5


def test_kv_cache_greedy_equals_full_recomputation(tiny):
    # Greedy decoding with the cache must pick the same tokens as recomputing the whole sequence
    # (prompt + tokens so far) at every step without any cache.
    model, tokenizer, eos_ids = tiny
    prompt_ids, prompt_mask = encode(tokenizer)
    steps, vocab = 20, len(tokenizer)
    cached, mask, _, _, _ = generate(
        model, prompt_ids, prompt_mask, steps, eos_ids, tokenizer.pad_token_id, vocab, temperature=0.0
    )
    expected = greedy_by_recomputation(model, prompt_ids, prompt_mask, cached.shape[1], vocab)
    assert torch.equal(cached[mask.bool()], expected[mask.bool()])


class ScriptedModel(torch.nn.Module):
    """Stands in for a causal LM: at generation step k, row r puts all its mass on
    script[r][k], except that an id beyond the tokenizer (embedding row `rows - 1`) always
    has a far larger logit, which generate must never sample. generate calls it once for the
    prompts (each distinct prompt once: give every row its own prompt), then once per token."""

    def __init__(self, script, rows):
        super().__init__()
        self.script, self.rows, self.calls = torch.tensor(script), rows, 0

    def forward(self, input_ids, **kwargs):
        step, self.calls = self.calls, self.calls + 1
        logits = torch.full((input_ids.shape[0], 1, self.rows), -30.0)
        logits[torch.arange(input_ids.shape[0]), 0, self.script[:, step]] = 10.0
        logits[:, 0, self.rows - 1] = 50.0  # out of the tokenizer's vocabulary
        return SimpleNamespace(logits=logits)


EOS_A, EOS_B, PAD, VOCAB, ROWS = 2, 3, 0, 10, 12


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_handling_and_truncation_on_crafted_cases(temperature):
    script = [
        [5, 6, EOS_A, 7, 7, 7],  # ends with the first EOS id at step 2
        [5, EOS_B, 8, 8, 8, 8],  # ends with the second EOS id at step 1
        [4, 4, 4, 4, 4, 4],  # never ends: truncated
    ]
    prompt = torch.tensor([[1, 4], [1, 5], [1, 6]])  # a prompt of its own per row
    # compact_below=0: the scripted model knows a row by its place in the batch, which changes
    # when finished rows leave it (tests/test_compaction.py tests that with real models).
    ids, mask, truncated, logp, _ = generate(
        ScriptedModel(script, ROWS), prompt, torch.ones_like(prompt), 5, [EOS_A, EOS_B], PAD, VOCAB, temperature,
        compact_below=0.0,
    )  # fmt: skip
    assert ids.tolist() == [[5, 6, EOS_A, PAD, PAD], [5, EOS_B, PAD, PAD, PAD], [4, 4, 4, 4, 4]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]
    assert (logp[mask == 0] == 0).all()
    assert (ids < VOCAB).all()  # the id with logit 50 lies beyond the tokenizer: never sampled


def test_generation_stops_when_every_row_has_ended():
    script = [[5, EOS_A, 9, 9, 9, 9], [EOS_B, 9, 9, 9, 9, 9]]
    prompt = torch.tensor([[1], [4]])
    ids, mask, truncated, _, _ = generate(
        ScriptedModel(script, ROWS), prompt, torch.ones_like(prompt), 6, [EOS_A, EOS_B], PAD, VOCAB, 0.0
    )
    assert ids.shape == (2, 2)  # T is the longest completion, not max_new_tokens
    assert mask.tolist() == [[1, 1], [1, 0]]
    assert not truncated.any()


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05; top_p = 0.7: mass before each (sorted) = 0, 0.5, 0.8, 0.95,
    # so tokens with mass-before < 0.7 stay: the 0.5 and the 0.3 ones.
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    assert torch.equal(top_p_filter(probs, 0.7), torch.tensor([[0.0, 0.5, 0.0, 0.3]]))
    assert torch.equal(top_p_filter(probs, 0.1), torch.tensor([[0.0, 0.5, 0.0, 0.0]]))  # the top token always stays
    assert torch.equal(top_p_filter(probs, 1.0), probs)


# The sampler's log-probs must carry no fp32 bias when the model is confident over a large
# vocabulary (a real chat model's case; the tiny models' 384 tokens are too few to show it).
# F.log_softmax's CPU kernel sums exp(x − max) over the vocabulary in 16 (AVX-512) or 8 (AVX2) fp32
# accumulator lanes. The lane holding the max gets exp(0) = 1, after which every term below
# 2^-24 (half an ulp of 1) rounds away: the normaliser comes out too small and log π of every
# token too high. A real chat model puts almost all of a 128k–150k vocabulary 17–25 nats below
# a confident top token, which made policy/sample_logp_diff ~1.5e-5 (always sampler > scorer)
# while the scoring pass (logit − logsumexp) stayed within ~1e-6 of float64.
V = 65536  # vocabulary
GAP = 18.0  # nats between the top token (id 0) and every other token, at h_0 = √32


def confident_model():
    """A 1-layer Qwen2 whose logits are, at every position, ~GAP above a flat bulk for id 0:
    the final norm keeps only hidden dim 0, which the embeddings make dominant (h_0 ≈ 5.6, a
    little under √32 as the other dims add to the rms); lm_head column 0 then sets the logits:
    ≈ +2 for id 0 and ≈ −15.8 for every other id, a gap of ≈ 17.8 nats."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0  # other dims keep their N(0, 0.02) init
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        h0 = 32**0.5  # rms-normalised (1, ~0, …): dim 0 ≈ √hidden
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, 0] = (2.0 - GAP) / h0
        model.lm_head.weight[0, 0] = 2.0 / h0
    return model


def test_sampler_logprobs_unbiased_when_confident():
    model = confident_model()
    prompt_ids = torch.randint(1, V, (4, 6))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1:, :2] = 0  # left padding in three rows
    ids, mask, _, sample_logp, _ = generate(model, prompt_ids, prompt_mask, 12, [V - 1], V - 1, V, temperature=1.0)
    with torch.no_grad():
        old_logp, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, V, 4)
        inputs = torch.cat([prompt_ids, ids], 1)
        attention = torch.cat([prompt_mask, mask], 1)
        reference = (
            model.double()(
                input_ids=inputs, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)
            )
            .logits[:, prompt_ids.shape[1] - 1 : -1]
            .log_softmax(-1)
            .gather(-1, ids[..., None])
            .squeeze(-1)
        )
    valid = mask.bool()
    assert (ids[valid] == 0).float().mean() > 0.9  # p(id 0) = 1 / (1 + (V−1)e^-17.8) ≈ 0.9988
    # With F.log_softmax the lane of id 0 loses the V/16 − 1 = 4095 bulk terms that follow it,
    # e^-17.8 = 1.9e-8 each (below 2^-24 = 6.0e-8, so each rounds away against 1): log π too high
    # by 4095 · 1.9e-8 ≈ 7.6e-5 on every token (measured 7.3e-5; twice that with 8 AVX2 lanes).
    # logit − logsumexp, the scorer's formula, is off only by the rounding of logsumexp ≈ 2
    # (ulp 2.4e-7) plus the cached/uncached logit noise times 1 − p ≈ 1e-3: ≲ 3e-7 (measured 0).
    # 1e-5 sits 7× below the biased figure and 30× above the unbiased one.
    diff = (sample_logp - old_logp)[valid]
    assert diff.abs().mean().item() <= 1e-5  # policy/sample_logp_diff
    assert diff.abs().max().item() <= 1e-5
    assert (sample_logp.double() - reference)[valid].abs().max().item() <= 1e-5


def test_the_exponential_race_draws_what_torch_multinomial_draws():
    # generate's sample() takes argmax(x − log E), E ~ Exp(1) for every id (Gumbel-max: distributed
    # as softmax(x)). torch.multinomial draws its one sample per row the same way, argmax(p / E) with
    # E from one exponential_ over the (n, V) tensor; so from the same random state sample() takes
    # the same numbers, gives the same tokens and leaves the generator where multinomial leaves it,
    # and its log-prob is the one generate recorded before (logit − logsumexp, before top-p), bit
    # for bit: at Qwen's 151,665 ids, τ 1 and 0.7, top-p 1 and 0.9 (the tail masked, never drawn).
    import grpo

    draws = torch.Generator().manual_seed(0)
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.9)):
        for seed in range(8):
            scaled = torch.randn(8, 151665, generator=draws) * 4 / temperature  # (n, V)
            logp = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
            torch.manual_seed(seed)
            expected = torch.multinomial(top_p_filter(logp.exp(), top_p), 1).squeeze(-1)  # the sampler before
            after = torch.get_rng_state()
            torch.manual_seed(seed)
            token, token_logp = grpo.sample(scaled, top_p)
            assert torch.equal(token, expected) and torch.equal(torch.get_rng_state(), after)
            assert torch.equal(token_logp, logp.gather(-1, expected[:, None]).squeeze(-1))


def test_the_exponential_race_draws_from_the_softmax_and_its_nucleus():
    # sample(): argmax(x − log E), E ~ Exp(1), draws id i with probability softmax(x)_i (Gumbel-max:
    # −log E is a standard Gumbel). x = (1, 2, 3, 0): softmax (0.0871, 0.2369, 0.6439, 0.0321).
    # Over 40,000 draws each count's standard deviation is at most √(40000 · 0.25) = 100, so 600
    # (6 σ) bounds its distance from its mean. Top-p 0.7 keeps the ids whose mass before them
    # (sorted) is under 0.7: 0.6439 (before it 0) and 0.2369 (before it 0.6439), renormalised to
    # 0.7310 and 0.2690; the other two are never drawn.
    import grpo

    torch.manual_seed(0)
    x = torch.tensor([1.0, 2.0, 3.0, 0.0]).expand(40000, 4)
    for top_p, expected in ((1.0, [0.0871, 0.2369, 0.6439, 0.0321]), (0.7, [0.0, 0.2690, 0.7310, 0.0])):
        token, token_logp = grpo.sample(x, top_p)
        counts = torch.bincount(token, minlength=4).float()
        assert (counts - 40000 * torch.tensor(expected)).abs().max() < 600
        assert counts[0] + counts[3] == 0 or top_p == 1.0
        torch.testing.assert_close(token_logp, x[0].log_softmax(-1)[token])  # before top-p


@pytest.mark.parametrize("bad", ["nan", "inf", "all -inf"])
def test_logits_that_are_not_numbers_stop_the_sampler(bad):
    # A row of NaN or +inf logits (diverged weights), or of −inf only, has no distribution to draw
    # from: sample() stops the run there, as torch.multinomial did ("probability tensor contains
    # either inf, nan or element < 0"), instead of drawing id 0 with a NaN log-prob.
    import grpo

    scaled = torch.randn(3, 50)
    if bad == "all -inf":
        scaled[1] = float("-inf")
    else:
        scaled[1, 7] = float(bad)
    with pytest.raises(RuntimeError, match="logits are NaN or infinite"):
        grpo.sample(scaled, 1.0)
