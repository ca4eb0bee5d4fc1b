"""One packed pass per micro-batch (common.packed_completions, issue 58's second lever): each run of
rows sharing a prompt laid out as that prompt once, then each row's completion, with no padding, under
one mask. The layout and the mask by hand; then, swapped in for forward_completions, the log-probs,
entropies, values and the gradient of every loss equal the computation before (one pass over prompt +
completion a row), within fp32's reassociation error (tests/test_shared_prompt.py's bounds), on the
tiny model and every family (sliding windows, MoE, eager attention), with tool turns; and the
FlexAttention form of the mask (a GPU's) equals the additive one (a CPU's)."""

import functools
import types
import warnings

import pytest
import torch
from test_shared_prompt import FP32_EPS, GRPO_CASES, SEQUENCES, passes, scoring_batch

import common
import dapo
import grpo
import ppo
from common import enable_activation_checkpointing, load_model, load_policy
from conftest import assert_same_update, gradients_and_totals
from families import (
    FAMILIES,
    VOCAB,
    family_model,
    family_prompts,
    plain_forward_logprobs,
    sample_with_tools,
    unbuildable,
)

# By hand: rows 0 and 1 share the prompt [5, 6] (row 0's left-padded to 3 columns like row 1's), row 2
# has [7, 8, 9]; completions [10, 11], [12], [13, 14, 15], padded to 3 (pad id 0).
PROMPT_IDS = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]])
PROMPT_MASK = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
COMPLETION_IDS = torch.tensor([[10, 11, 0], [12, 0, 0], [13, 14, 15]])
COMPLETION_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])


@pytest.fixture(scope="module")
def tiny():
    return scoring_batch()  # tests/test_shared_prompt.py's: 3 prompts × 4 completions of 1 to 12 tokens


FORWARD = common.forward_completions  # the scripts' pass, before any test swaps it


def unshared(script, monkeypatch):
    """Within it, `script` runs the computation before: one pass over prompt + completion a row, padded."""
    monkeypatch.setattr(common, "forward_completions", functools.partial(FORWARD, share=False))


def packed(monkeypatch):
    """Within it every script scores and trains through the packed pass."""
    monkeypatch.setattr(common, "forward_completions", common.packed_completions)


def assert_packed_update(script, model, batch, args, vocab_size, monkeypatch):
    """One update of `script` through the packed pass equals the one through a padded pass a row."""
    packed(monkeypatch)
    one_pass = gradients_and_totals(script, model, batch, args, vocab_size)
    unshared(script, monkeypatch)
    assert_same_update(one_pass, gradients_and_totals(script, model, batch, args, vocab_size))


def test_the_layout_by_hand():
    ids, facts, where = common.packed_layout(PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK)
    # places:     0  1 | 2   3  | 4  | 5  6  7 | 8   9   10
    # the prompt [5, 6] once, row 0's completion, row 1's; the prompt [7, 8, 9], row 2's completion
    assert ids.tolist() == [5, 6, 10, 11, 12, 7, 8, 9, 13, 14, 15]
    assert facts["run"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert facts["owner"].tolist() == [-1, -1, 0, 0, 1, -1, -1, -1, 2, 2, 2]
    # positions count a row's own tokens: row 1's completion starts at 2 like row 0's
    assert facts["position"].tolist() == [0, 1, 2, 3, 2, 0, 1, 2, 3, 4, 5]
    # token j is predicted at the place of the token before it, the prompt's last (1 or 7) for j = 0;
    # a padding column's is its row's last token's (any: it is masked in the loss)
    assert where.tolist() == [[1, 2, 3], [1, 4, 4], [7, 8, 9]]


def test_the_chunks_count_of_tokens_lays_out_the_same_without_a_host_sync():
    # chunks_of reads each chunk's real tokens with the batch's lengths (Layout.tokens: 2 + 2 + 1 + 3 + 3
    # here); the layout then takes that many kept columns (nonzero_static), not a count read back.
    [(rows, layout)] = common.chunks_of(torch.arange(3), PROMPT_IDS, PROMPT_MASK, COMPLETION_MASK, 3)
    assert layout.tokens == 11
    counted = common.packed_layout(PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK, layout)
    read = common.packed_layout(PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK)
    assert torch.equal(counted[0], read[0]) and torch.equal(counted[2], read[2])
    assert all(torch.equal(counted[1][name], read[1][name]) for name in read[1])


def test_bool_masks_lay_out_as_integer_masks():
    # The masks as bool tensors: the layout reads them without writing into them.
    masks = PROMPT_MASK.bool(), COMPLETION_MASK.bool()
    ids, facts, where = common.packed_layout(PROMPT_IDS, masks[0], COMPLETION_IDS, masks[1])
    assert torch.equal(masks[0], PROMPT_MASK.bool()) and torch.equal(masks[1], COMPLETION_MASK.bool())
    expected = common.packed_layout(PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK)
    assert torch.equal(ids, expected[0]) and torch.equal(where, expected[2])
    assert all(torch.equal(facts[name], expected[1][name]) for name in facts)


def test_a_masked_column_is_not_in_the_pass():
    # Row 0's completion [10, (masked 99), 11]: 11 is predicted at 10's place, position 3 after the
    # prompt's 0 and 1 and 10's 2, as if the masked column were not there at all.
    ids, facts, where = common.packed_layout(
        PROMPT_IDS[:1], PROMPT_MASK[:1], torch.tensor([[10, 99, 11]]), torch.tensor([[1, 0, 1]])
    )
    assert ids.tolist() == [5, 6, 10, 11] and facts["position"].tolist() == [0, 1, 2, 3]
    assert where.tolist() == [[1, 2, 2]]  # 10 at the prompt's last (1); 99's and 11's at 10's (2)


def visible_sets(window):
    _, facts, _ = common.packed_layout(PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK)
    places = torch.arange(11)
    visible = common.packed_visible(facts, places[:, None], places[None, :], window)  # (L, L)
    return [set(row.nonzero().flatten().tolist()) for row in visible]


def test_each_token_sees_its_prompt_and_its_own_completion_before_it():
    # Row 1's completion token (place 4) sees the shared prompt (0, 1) and itself, not row 0's (2, 3);
    # nothing sees across the two prompts' runs.
    assert visible_sets(None) == [
        {0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 4},
        {5}, {5, 6}, {5, 6, 7}, {5, 6, 7, 8}, {5, 6, 7, 8, 9}, {5, 6, 7, 8, 9, 10},
    ]  # fmt: skip


def test_a_window_counts_positions_not_places():
    # Window 2: a query at position p sees positions p-1 and p. Row 1's token (place 4, position 2) sees
    # the prompt's place 1 (position 1), as its own unpacked row would, not place 3 before it.
    assert visible_sets(2) == [{0}, {0, 1}, {1, 2}, {2, 3}, {1, 4}, {5}, {5, 6}, {6, 7}, {7, 8}, {8, 9}, {9, 10}]


def test_the_mask_is_additive_and_hides_what_is_not_visible():
    _, facts, _ = common.packed_layout(PROMPT_IDS, PROMPT_MASK, COMPLETION_IDS, COMPLETION_MASK)
    mask = common.packed_mask(facts, None, flex=False)
    assert mask.shape == (1, 1, 11, 11) and mask.dtype == torch.float32
    assert set(mask.unique().tolist()) == {0.0, torch.tensor(common.MASKED).item()}
    assert (mask[0, 0] == 0).tolist() == [[k in seen for k in range(11)] for seen in visible_sets(None)]


def test_log_probs_equal_in_one_pass_of_the_real_tokens(tiny, monkeypatch):
    # 12 rows, 3 prompts, chunks of 4 rows (a group each): one pass a chunk, of its prompt's real tokens
    # once and its completions' real tokens, no padding; before, 3 passes of 4 padded rows.
    model, _, vocab_size, batch = tiny
    sequences = [batch[k] for k in SEQUENCES]
    packed(monkeypatch)
    heads = []  # the head's chunks (HeadLogprobs): the pass's (n, t, V) logits are never whole
    head = common.HeadLogprobs.apply
    monkeypatch.setattr(common.HeadLogprobs, "apply", lambda *a: heads.append(a[0].shape) or head(*a))
    seen, handle, caches = *passes(model), []
    caching = model.register_forward_pre_hook(
        lambda _, args, kwargs: caches.append(kwargs["use_cache"]), with_kwargs=True
    )
    with torch.no_grad():
        logp, entropy = grpo.sequence_logprobs(model, *sequences, 0.7, vocab_size, 4, with_entropy=True)
    handle.remove(), caching.remove()
    assert caches == [False] * 3  # no KV cache kept: nothing reads it
    # a chunk's 4 rows × its longest completion (12, 12, then 6: lengths 4, 6, 2, 3), the tiny model's 96 wide
    assert heads == [(4 * 12, 96), (4 * 12, 96), (4 * 6, 96)]
    unshared(grpo, monkeypatch)
    with torch.no_grad():
        before, entropy_before = grpo.sequence_logprobs(model, *sequences, 0.7, vocab_size, 4, with_entropy=True)
    assert (logp - before).abs().max() <= 8 * FP32_EPS * before.abs().max()
    assert (entropy - entropy_before).abs().max() <= 8 * FP32_EPS * entropy_before.abs().max()
    real = batch["prompt_mask"][::4].sum() + batch["completion_mask"].sum()  # each prompt once, each completion
    assert (seen["passes"], seen["positions"], seen["unmasked"]) == (3, real.item(), 0)


@pytest.mark.parametrize("settings", GRPO_CASES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("micro_batch_size", [4, 5])  # whole groups; and groups split across micro-batches
def test_every_grpo_loss_has_the_gradient_of_before(tiny, settings, micro_batch_size, monkeypatch):
    model, _, vocab_size, batch = tiny
    args = grpo.Args(micro_batch_size=micro_batch_size, max_new_tokens=12, **{"beta": 0.04} | settings)
    batch = {k: v for k, v in batch.items() if k in (*SEQUENCES, "sample_logp", "old_logp", "ref_logp", "advantages")}
    if settings.get("beta") == 0.0:
        batch |= {"old_logp": None, "ref_logp": None}
    assert_packed_update(grpo, model, batch, args, vocab_size, monkeypatch)


def test_the_dapo_loss_has_the_gradient_of_before(tiny, monkeypatch):
    model, _, vocab_size, batch = tiny
    keys = (*SEQUENCES, "truncated", "sample_logp", "old_logp", "ref_logp", "advantages")
    batch = {k: v for k, v in batch.items() if k in keys}
    args = dapo.Args(micro_batch_size=4, beta=0.04, max_new_tokens=12, num_iterations=2, overlong_filter=True)
    assert_packed_update(dapo, model, batch, args, vocab_size, monkeypatch)


def test_ppo_actor_and_critic_have_the_gradients_of_before(tiny, monkeypatch):
    # The critic runs the backbone: the hidden states at the places predicting each token (n, t, H).
    model, critic, vocab_size, batch = tiny
    batch = dict(batch, advantages=batch["advantages_ppo"])
    args = ppo.Args(micro_batch_size=4, max_new_tokens=12, entropy_coef=0.01, pos_lm_coef=0.1)
    packed(monkeypatch)
    actor = gradients_and_totals(ppo, model, batch, args, vocab_size)
    value = gradients_and_totals(ppo, critic, batch, args, 0, "critic_backward")
    with torch.no_grad():
        values = ppo.critic_values(critic, *[batch[k] for k in SEQUENCES], 4)
    unshared(ppo, monkeypatch)
    with torch.no_grad():
        before = ppo.critic_values(critic, *[batch[k] for k in SEQUENCES], 4)
    assert (values - before).abs().max() <= 8 * FP32_EPS * before.abs().max()
    assert_same_update(actor, gradients_and_totals(ppo, model, batch, args, vocab_size))
    assert_same_update(value, gradients_and_totals(ppo, critic, batch, args, 0, "critic_backward"))


@pytest.mark.parametrize("adapters", ["checkpointing", "lora"])
def test_checkpointing_and_lora_have_the_gradient_of_before(tiny, adapters, monkeypatch):
    _, _, vocab_size, batch = tiny
    torch.manual_seed(1)
    if adapters == "lora":
        model, _, _ = load_policy(grpo.Args(model="tiny", lora_rank=4), torch.device("cpu"), torch.float32)
        for name, parameter in model.named_parameters():  # B = 0 at the start: move it, or A gets no gradient
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.05)
    else:
        model, _, _ = load_model("tiny", torch.device("cpu"))
        enable_activation_checkpointing(model)
    model.train()
    args = grpo.Args(micro_batch_size=4, beta=0.04, max_new_tokens=12, num_iterations=2)
    batch = {k: v for k, v in batch.items() if k in (*SEQUENCES, "sample_logp", "old_logp", "ref_logp", "advantages")}
    assert_packed_update(grpo, model, batch, args, vocab_size, monkeypatch)


def family_batch():
    """3 prompts of 30, 12 and 21 tokens (longer than the windows of 8) × 3 completions of 1 to 10."""
    prompt_ids, prompt_mask = (t.repeat_interleave(3, 0) for t in family_prompts())
    generator = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, VOCAB, (9, 10), generator=generator)
    completion_mask = (torch.arange(10)[None, :] < torch.tensor([10, 4, 7, 1, 10, 9, 2, 6, 10])[:, None]).long()
    return prompt_ids, prompt_mask, completion_ids * completion_mask, completion_mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_scores_and_trains_as_before(family, monkeypatch):
    if unbuildable(family):
        pytest.skip(unbuildable(family))
    # Windows reach back into the prompt (a window counts a row's own positions); MoE routing; the
    # eager families (gemma2's soft-capping, gpt-oss's sinks) take the additive mask through their own.
    model = family_model(family).train()
    sequences = family_batch()
    results = []
    for path in (packed, lambda patch: unshared(grpo, patch)):
        path(monkeypatch)
        model.zero_grad(set_to_none=True)
        logp, _ = grpo.sequence_logprobs(model, *sequences, 1.0, VOCAB, 6)
        (logp * torch.linspace(-1, 1, 10)).sum().backward()
        results.append((logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (logp, gradient), (logp_before, gradient_before) = results
    tokens = sequences[3].sum().item()  # 59
    assert (logp - logp_before).abs().max() <= 8 * FP32_EPS * logp_before.abs().max(), family
    assert (gradient - gradient_before).abs().max() <= tokens * FP32_EPS * gradient_before.abs().max(), family


@pytest.mark.parametrize("family", ["qwen2", "qwen2-window", "gemma3", "cohere2"])
def test_flex_attentions_block_mask_scores_as_the_additive_mask(family, monkeypatch):
    if unbuildable(family):
        pytest.skip(unbuildable(family))
    # A GPU runs FlexAttention over a BlockMask built from the same packed_visible; on the CPU it runs
    # forward only (no backward there), unfused: the log-probs of the additive mask's pass.
    model = family_model(family)
    sequences = family_batch()
    packed(monkeypatch)
    with torch.no_grad():
        additive, _ = grpo.sequence_logprobs(model, *sequences, 1.0, VOCAB, 9)
        monkeypatch.setattr(common, "flex_serves", lambda model, device: True)
        attention, flexed = common.packed_attention, []  # each layer's call: FlexAttention ran
        monkeypatch.setattr(common, "packed_attention", lambda *a, **k: flexed.append(1) or attention(*a, **k))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": the CPU's
            flex, _ = grpo.sequence_logprobs(model, *sequences, 1.0, VOCAB, 9)
    assert len(flexed) == 4, family  # 4 layers, one chunk of 9 rows
    assert (flex - additive).abs().max() <= 8 * FP32_EPS * additive.abs().max(), family


@pytest.mark.parametrize("setting", [dict(softcap=30.0), dict(s_aux=torch.zeros(4)), dict(dropout=0.1)])
def test_flex_attention_refuses_what_it_does_not_compute(setting):
    # sdpa models pass no soft-capping, no sinks and (in eval, or without attention dropout) no
    # dropout; one that did would get attention it did not ask for, silently.
    query, key = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=next(iter(setting))):
        common.packed_attention(None, query, key, key, None, **setting)


def test_flex_serves_only_a_gpus_sdpa_models():
    model = family_model("qwen2")
    assert not common.flex_serves(model, torch.device("cpu"))  # no backward on a CPU
    assert common.flex_serves(model, torch.device("cuda"))
    eager = family_model("qwen2")
    eager.config._attn_implementation = "eager"  # as Gemma 2's and gpt-oss's load: their own attention
    assert not common.flex_serves(eager, torch.device("cuda"))
    assert not common.flex_serves(torch.nn.Linear(2, 2), torch.device("cuda"))  # no config: not a transformers model
    assert not common.flex_serves(types.SimpleNamespace(config=types.SimpleNamespace()), torch.device("cuda"))


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2"])
def test_tool_turns_score_as_the_plain_forward(family, monkeypatch):
    # The tools' answers are in the sequence (attended), not scored: the packed pass attends to them.
    model = family_model(family)
    prompt_ids, prompt_mask, (ids, mask, _, sample_logp, tool_mask), _ = sample_with_tools(model)
    assert tool_mask.any()
    packed(monkeypatch)
    with torch.no_grad():
        scored, _ = grpo.sequence_logprobs(
            model, prompt_ids, prompt_mask, ids, mask, 1.0, VOCAB, 6, tool_mask=tool_mask
        )
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask + tool_mask) * mask
    assert (scored - plain).abs().max() <= 8 * FP32_EPS * plain.abs().max(), family
    assert (scored - sample_logp).abs().max() <= 1e-5, family  # the sampler's (test_families' TOLERANCE)
