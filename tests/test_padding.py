"""Steps 4 and 6 compute no padding that a longer row elsewhere in the rollout forced on them:
rows go through the model in order of length (length_order), each scoring chunk and micro-batch
cut to its own longest prompt and completion (trim_padding). The normalisers are the whole
mini-batch's, so the gradient is the one of today's computation, where every micro-batch was
padded to the rollout's longest; the rows come back in the order they came in."""

import copy
import functools

import pytest
import torch

import common
import dapo
import grpo
import ppo
from common import enable_activation_checkpointing, length_order, load_model, trim_padding
from conftest import assert_same_update, gradients_and_totals, sample_batch
from grpo import sequence_logprobs


def test_length_order_is_longest_first_and_stable():
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])  # lengths 1 3 2 1 3
    prompts = torch.arange(5)[:, None]  # every row its own prompt: by length alone, ties in row order
    assert length_order(prompts, torch.ones_like(prompts), mask).tolist() == [1, 4, 2, 0, 3]


def test_length_order_keeps_groups_together_longest_group_first():
    # Rows 0-2 share prompt [9], rows 3-5 prompt [4]; lengths 1 3 2 | 2 2 1. Group [9]'s longest
    # completion (3) beats group [4]'s (2), so its rows come first, each group's longest first
    # (ties in row order): 1 2 0, then 3 4 5; never a row of one group between two of the other.
    prompts = torch.tensor([[9], [9], [9], [4], [4], [4]])
    lengths = torch.tensor([1, 3, 2, 2, 2, 1])
    mask = (torch.arange(3)[None, :] < lengths[:, None]).long()
    assert length_order(prompts, torch.ones_like(prompts), mask).tolist() == [1, 2, 0, 3, 4, 5]


def test_trim_padding_keeps_the_columns_some_row_uses():
    prompt_ids = torch.tensor([[0, 0, 7, 8], [0, 5, 6, 7]])  # left padded: prompt lengths 2 and 3
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.tensor([[1, 2, 0, 0, 0], [3, 0, 0, 0, 0]])  # right padded: lengths 2 and 1
    completion_mask = (completion_ids != 0).long()
    [(rows, layout)] = common.chunks_of(torch.arange(2), prompt_ids, prompt_mask, completion_mask, 2)
    assert rows.tolist() == [0, 1]  # tokens: 2 + 2 and 3 + 1 (two prompts, each once)
    assert layout == common.Layout(prompt=3, completion=2, prompts=2, shortest=2, tokens=8)
    ids, mask, completion, completion_kept = trim_padding(
        prompt_ids, prompt_mask, completion_ids, completion_mask, layout
    )
    assert ids.tolist() == [[0, 7, 8], [5, 6, 7]] and mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert completion.tolist() == [[1, 2], [3, 0]] and completion_kept.tolist() == [[1, 1], [1, 0]]


@pytest.fixture(scope="module")
def models():
    """The tiny policy, a PPO critic with a random head, and a batch of 3 prompts × 4 completions
    of 1 to 12 tokens (conftest.sample_batch, cut to the lengths below) with PPO's fields added."""
    torch.manual_seed(0)
    model, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    batch = sample_batch(model, tokenizer, eos_ids)
    # Lengths as a rollout has them, most short, a few at the cap: each row cut as if it had ended there.
    lengths = torch.tensor([12, 3, 7, 1, 12, 5, 2, 9, 4, 6, 2, 3])
    keep = torch.arange(12)[None, :] < lengths[:, None]  # (12, T = 12)
    batch["completion_ids"] = batch["completion_ids"].masked_fill(~keep, tokenizer.pad_token_id)
    batch["completion_mask"] = keep.long()
    batch["truncated"] = lengths == 12
    batch["old_logp"], batch["ref_logp"] = batch["old_logp"] * keep, batch["ref_logp"] * keep
    critic = ppo.load_critic(ppo.Args(model="tiny"), torch.device("cpu"), torch.float32)
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)
    mask = batch["completion_mask"]
    sequences = batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask
    with torch.no_grad():
        values = ppo.critic_values(critic, *sequences, 12)
    batch |= {
        "sample_logp": batch["old_logp"] + 0.1 * torch.randn_like(batch["old_logp"]) * mask,
        "advantages_ppo": torch.randn(mask.shape) * mask,
        "old_values": (values + 0.3 * torch.randn_like(values)) * mask,
        "returns": torch.randn(mask.shape) * mask,
        "positive": (torch.arange(12) % 3 == 0).float(),
    }
    lengths = mask.sum(-1)
    assert lengths.max() == mask.shape[1] and lengths.min() < mask.shape[1] / 2, lengths.tolist()
    assert batch["prompt_mask"].sum(-1).unique().numel() > 1, "want prompts of unequal length"
    return model, critic, tokenizer, batch


def forward_widths(module):
    """Records the sequence length of every forward pass of module: a list the caller reads."""
    widths = []
    handle = module.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append((kwargs.get("input_ids", args[0] if args else None)).shape[1]),
        with_kwargs=True,
    )
    return widths, handle


def test_scoring_chunks_are_cut_to_their_own_longest_row(models):
    # Chunks of 4 rows in order of length: each forward pass is as wide as its own longest
    # prompt plus its own longest completion, and every row's log-probs are those of the row
    # scored alone, unpadded, back in its own place.
    model, _, tokenizer, batch = models
    sequences = batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]
    widths, handle = forward_widths(model)
    with torch.no_grad():
        logp, entropy = sequence_logprobs(model, *sequences, 1.0, len(tokenizer), 4, with_entropy=True)
    handle.remove()
    order = length_order(*sequences[:2], batch["completion_mask"])
    expected = []
    for rows in order.split(4):  # 3 prompts × 4 completions: each chunk is one group, its prompt run once
        prompt, completion = (
            batch["prompt_mask"][rows].sum(-1).max().item(),
            batch["completion_mask"][rows].sum(-1).max().item(),
        )
        assert len(batch["prompt_ids"][rows].unique(dim=0)) == 1
        expected += [
            prompt - 1,
            completion,
        ]  # forward_completions: the prompt but its last token, then that and the rest
    assert widths == expected and sum(expected) < 3 * (sequences[0].shape[1] + sequences[2].shape[1])
    for i in range(12):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()][None]
        length = batch["completion_mask"][i].sum().item()
        ids, ones = batch["completion_ids"][i : i + 1, :length], torch.ones(1, length, dtype=torch.long)
        with torch.no_grad():
            alone, alone_entropy = sequence_logprobs(
                model, prompt, torch.ones_like(prompt), ids, ones, 1.0, len(tokenizer), 1, with_entropy=True
            )
        assert (alone[0] - logp[i, :length]).abs().max() < 1e-5
        assert (alone_entropy[0] - entropy[i, :length]).abs().max() < 1e-5
        assert logp[i, length:].abs().sum() == entropy[i, length:].abs().sum() == 0


GRPO_CASES = [
    dict(loss_type="grpo", num_iterations=2),
    dict(loss_type="dr_grpo", num_iterations=2),
    dict(loss_type="gspo", num_iterations=2),
    dict(loss_type="gpg", beta=0.0),  # on-policy only; step 4 skipped: old_logp recorded here
    dict(loss_type="grpo", num_iterations=2, entropy_coef=0.01, tis_cap=2.0, dual_clip=3.0),
]


@pytest.mark.parametrize("settings", GRPO_CASES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_grpo_bucketed_micro_batches_give_todays_gradient(models, settings):
    # Reference: one micro-batch of all 12 rows, padded to the rollout's longest prompt and
    # completion, which is what every micro-batch was before (gradient accumulation is exact:
    # tests/test_train.py). Micro-batches of 3 and 5 rows now each have their own width.
    model, _, tokenizer, batch = models
    batch = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")} | {
        "sample_logp": batch["sample_logp"],
        "old_logp": None if settings.get("beta") == 0.0 else batch["old_logp"],
        "ref_logp": None if settings.get("beta") == 0.0 else batch["ref_logp"],
        "advantages": batch["advantages"],
    }
    settings = {"beta": 0.04, "max_new_tokens": 12} | settings
    reference = gradients_and_totals(grpo, model, batch, grpo.Args(micro_batch_size=12, **settings), len(tokenizer))
    for micro_batch_size in (3, 5):
        widths, handle = forward_widths(model)
        args = grpo.Args(micro_batch_size=micro_batch_size, **settings)
        result = gradients_and_totals(grpo, model, batch, args, len(tokenizer))
        handle.remove()
        # micro-batches of one group: its prompt's pass, then its completions' (forward_completions)
        assert max(widths) == batch["prompt_ids"].shape[1] - 1 and min(widths) < max(widths)
        assert_same_update(result, reference)
        if batch["old_logp"] is None:  # the recorded log-probs are each row's own, in the rows given
            sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
            with torch.no_grad():
                scored, _ = sequence_logprobs(model, *sequences, 1.0, len(tokenizer), 1)
            assert (result[1]["old_logp"] - scored).abs().max() < 1e-5


@pytest.mark.parametrize("overlong_filter", [False, True])
def test_dapo_bucketed_micro_batches_give_todays_gradient(models, overlong_filter):
    model, _, tokenizer, batch = models
    batch = {k: v for k, v in batch.items() if k not in ("advantages_ppo", "old_values", "returns", "positive")}
    settings = dict(beta=0.04, max_new_tokens=12, num_iterations=2, overlong_filter=overlong_filter)
    reference = gradients_and_totals(dapo, model, batch, dapo.Args(micro_batch_size=12, **settings), len(tokenizer))
    for micro_batch_size in (3, 5):
        result = gradients_and_totals(dapo, model, batch, dapo.Args(micro_batch_size=micro_batch_size, **settings), 384)
        assert_same_update(result, reference)


def test_ppo_actor_and_critic_bucketed_micro_batches_give_todays_gradient(models):
    model, critic, tokenizer, batch = models
    batch = {
        **{k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sample_logp")},
        **{k: batch[k] for k in ("old_logp", "old_values", "returns", "positive")},
        "advantages": batch["advantages_ppo"],
    }
    settings = dict(ppo_epochs=2, entropy_coef=0.01, pos_lm_coef=0.1, tis_cap=2.0)
    vocab = len(tokenizer)
    actor = gradients_and_totals(ppo, model, batch, ppo.Args(micro_batch_size=12, **settings), vocab)
    value = gradients_and_totals(ppo, critic, batch, ppo.Args(micro_batch_size=12, **settings), 0, "critic_backward")
    for micro_batch_size in (3, 5):
        args = ppo.Args(micro_batch_size=micro_batch_size, **settings)
        assert_same_update(gradients_and_totals(ppo, model, batch, args, vocab), actor)
        widths, handle = forward_widths(critic.backbone)
        result = gradients_and_totals(ppo, critic, batch, args, 0, "critic_backward")
        handle.remove()
        assert min(widths) < max(widths) == batch["prompt_ids"].shape[1] - 1  # as the policy's, above
        assert_same_update(result, value)


def test_shape_multiple_is_64_on_cuda_and_1_elsewhere():
    assert common.shape_multiple(torch.device("cuda", 0)) == 64 and common.shape_multiple(torch.device("cpu")) == 1


def test_trim_padding_rounds_up_to_the_shape_multiple(monkeypatch):
    # The chunk of test_trim_padding_keeps_the_columns_some_row_uses: longest prompt 3 of P = 4,
    # longest completion 2 of T = 5. A multiple of 2 keeps ⌈3/2⌉·2 = 4 prompt columns (the one
    # column of padding in every row too) and 2 completion columns; a multiple of 4 keeps 4 and 4;
    # of 8, all there is: 4 and 5 (a multiple is never wider than the chunk).
    prompt_ids = torch.tensor([[0, 0, 7, 8], [0, 5, 6, 7]])
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.tensor([[1, 2, 0, 0, 0], [3, 0, 0, 0, 0]])
    completion_mask = (completion_ids != 0).long()
    for multiple, prompt_kept, completion_kept in ((1, 3, 2), (2, 4, 2), (4, 4, 4), (8, 4, 5)):
        monkeypatch.setattr(common, "shape_multiple", lambda device, m=multiple: m)
        [(_, layout)] = common.chunks_of(torch.arange(2), prompt_ids, prompt_mask, completion_mask, 2)
        ids, mask, completion, kept_mask = trim_padding(
            prompt_ids, prompt_mask, completion_ids, completion_mask, layout
        )
        assert ids.tolist() == [row[4 - prompt_kept :] for row in prompt_ids.tolist()]
        assert mask.tolist() == [row[4 - prompt_kept :] for row in prompt_mask.tolist()]
        assert completion.tolist() == [row[:completion_kept] for row in completion_ids.tolist()]
        assert kept_mask.tolist() == [row[:completion_kept] for row in completion_mask.tolist()]


def test_rounded_chunks_give_the_same_log_probs_and_update(models, monkeypatch):
    # CUDA's rounding, run on the CPU: chunks of 8 columns (prompt and completion each) compute
    # the padding columns too, which no row attends to, so the log-probs and the update are
    # today's, up to the float reassociation of other kernel shapes (assert_same_update).
    model, _, tokenizer, batch = models
    sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    update = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")} | {
        k: batch[k] for k in ("sample_logp", "old_logp", "ref_logp", "advantages")
    }
    args = grpo.Args(micro_batch_size=5, beta=0.04, max_new_tokens=12, num_iterations=2)
    with torch.no_grad():
        exact, _ = sequence_logprobs(model, *sequences, 1.0, len(tokenizer), 4)
    reference = gradients_and_totals(grpo, model, update, args, len(tokenizer))
    monkeypatch.setattr(common, "shape_multiple", lambda device: 8)
    widths, handle = forward_widths(model)
    with torch.no_grad():
        rounded, _ = sequence_logprobs(model, *sequences, 1.0, len(tokenizer), 4)
    result = gradients_and_totals(grpo, model, update, args, len(tokenizer))
    handle.remove()
    prompt_width = sequences[0].shape[1]
    assert all(width % 8 == 0 or width in (prompt_width - 1, 12) for width in widths), widths
    assert widths.count(8) > 0  # a chunk of short completions: 8 columns where 7 or fewer would do
    eps = torch.finfo(torch.float32).eps
    assert (rounded - exact).abs().max() <= 8 * eps * exact.abs().max()  # a few roundings of a log-softmax
    assert_same_update(result, reference)


@pytest.mark.parametrize("passes", ["prompt-pass", "one-pass", "checkpointed"])
@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=lambda s: s.__name__)
def test_no_host_sync_in_the_loop_over_micro_batches(models, script, passes, monkeypatch):
    # A host sync stops the CPU until the GPU has caught up, so the GPU idles while the host launches
    # the next micro-batch, where without one the host launches it while the GPU runs the last one's
    # backward. Counted from the profiler's events (bench.profiled): 12 rows in micro-batches of 3 (4
    # of them) against 12 (1). What a micro-batch needs on the host (its columns, its prompts) is read
    # for all of them before the first (chunks_of: one .tolist(), which the profiler's count sees on
    # CUDA only). What remains is transformers' check of a mask's padding (masking_utils'
    # _ignore_causal_mask_sdpa: up to two reads), at most 2 a micro-batch, with the prompt shared and
    # in the one pass over prompt + completion a row (G = 1: share=False; gradient checkpointing).
    # (An unmasked "aligned" pass that read none was measured no faster on an H200 and removed:
    # docs/speed.md, tried and removed.)
    # Before issue 40: a .item() for each statistic and the loss, trim_padding's two, length_order's
    # unique, 10 or more a micro-batch; then 4 (forward_completions' unique and its check of the
    # shortest prompt, trim_padding's, transformers').
    from bench import profiled

    model, critic, tokenizer, batch = models
    batch = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")} | {
        k: batch[k] for k in ("sample_logp", "old_logp", "ref_logp", "advantages", "positive")
    }
    if script is ppo:
        batch = {k: v for k, v in batch.items() if k != "ref_logp"} | {"advantages": batch["advantages"][:, None]}
    else:
        batch.pop("positive")
    if passes == "checkpointed":  # a copy: the fixture's model stays as it is
        model = copy.deepcopy(model).train()
        enable_activation_checkpointing(model)
    if passes == "one-pass":
        monkeypatch.setattr(common, "forward_completions", functools.partial(common.forward_completions, share=False))
    copies, tolist = [], torch.Tensor.tolist  # .tolist(), a copy to the host the profiler does not see
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: copies.append(1) or tolist(tensor))
    updates = {"policy": lambda args: script.policy_backward(model, batch, args, len(tokenizer))}
    if script is ppo:  # and the critic's update, in the same micro-batches
        critic_batch = batch | {k: models[3][k] for k in ("old_values", "returns")}
        updates["critic"] = lambda args: ppo.critic_backward(critic, critic_batch, args)
    for name, update in updates.items():
        syncs = {}
        for micro_batch_size in (12, 3):
            args = script.Args(micro_batch_size=micro_batch_size, max_new_tokens=12, beta=0.04)
            copies.clear()
            _, measured = profiled(functools.partial(update, args), torch.device("cpu"))
            model.zero_grad(set_to_none=True)
            critic.zero_grad(set_to_none=True)
            syncs[micro_batch_size] = measured["host syncs"], len(copies)
        assert syncs[3][0] - syncs[12][0] <= 2 * (4 - 1), (name, syncs)
        assert syncs[3][1] == syncs[12][1], (name, syncs)  # chunks_of's one .tolist(), whatever the micro-batches


def test_chunks_of_by_rows_and_by_tokens():
    # Six rows in order, (prompt, completion) lengths (2, 5) (3, 4) (2, 3) (1, 3) (3, 1) (1, 1); a
    # chunk costs its rows × (longest prompt + longest completion). A budget of 14 tokens: rows 0-1
    # cost 2 × (3 + 5) = 16 > 14, so row 0 alone (7); rows 1-3 cost 3 × (3 + 4) = 21 > 14, rows 1-2
    # 2 × 7 = 14: in; rows 3-5 cost 3 × (3 + 3) = 18 > 14, rows 3-4 2 × (3 + 3) = 12, then row 5:
    # 3 × 6 = 18 > 14, alone. By rows: 4 at a time; neither set: 4 rows.
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 1]])
    prompt_ids = prompt_mask * torch.tensor([[7], [9], [8], [5], [9], [6]])  # rows 1 and 4: one prompt
    lengths = torch.tensor([5, 4, 3, 3, 1, 1])
    completion_mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    order = torch.arange(6)

    def rows_of(*chunking, order=order):
        return [
            rows.tolist() for rows, _ in common.chunks_of(order, prompt_ids, prompt_mask, completion_mask, *chunking)
        ]

    assert rows_of(0, 14) == [[0], [1, 2], [3, 4], [5]]
    assert rows_of(4) == [[0, 1, 2, 3], [4, 5]] and rows_of(0, 0) == [[0, 1, 2, 3], [4, 5]]
    # A budget smaller than one row still takes that row. The rows in the order given, here 5 to 0:
    # 5-4 cost 2 × (3 + 1) = 8, with 3 3 × (3 + 3) = 18 > 14; 3-2 2 × (2 + 3) = 10, with 1
    # 3 × (3 + 4) = 21; 1 then 0 2 × (3 + 5) = 16 > 14: [5, 4], [3, 2], [1], [0].
    assert rows_of(0, 1) == [[i] for i in range(6)]
    assert rows_of(0, 14, order=order.flip(0)) == [[5, 4], [3, 2], [1], [0]]
    # Each chunk's Layout, by hand from the lengths above: its longest prompt and completion, the runs
    # of rows sharing a prompt (rows 1 and 4 share one, when they come one after the other), the
    # shortest prompt.
    layouts = [layout for _, layout in common.chunks_of(order, prompt_ids, prompt_mask, completion_mask, 0, 14)]
    # shortest prompt, and its real tokens with each run's prompt once (the packed pass's): [0] 2 + 5,
    # [1, 2] 3 + 4 + 2 + 3, [3, 4] 1 + 3 + 3 + 1, [5] 1 + 1.
    assert [(x.prompt, x.completion, x.prompts, x.shortest, x.tokens) for x in layouts] == [
        (2, 5, 1, 2, 7), (3, 4, 2, 2, 12), (3, 3, 2, 1, 8), (1, 1, 1, 1, 2)
    ]  # fmt: skip
    [(_, shared)] = common.chunks_of(torch.tensor([1, 4]), prompt_ids, prompt_mask, completion_mask, 2)
    assert shared == common.Layout(prompt=3, completion=4, prompts=1, shortest=3, tokens=3 + 4 + 1)
    [(_, apart)] = common.chunks_of(torch.tensor([1, 0, 4]), prompt_ids, prompt_mask, completion_mask, 3)
    assert apart.prompts == 3  # rows 1 and 4 share a prompt, but not a run: two passes of it
    assert apart.tokens == 3 + 4 + 2 + 5 + 3 + 1


def test_micro_batches_by_tokens_give_todays_update(models):
    # Micro-batches of at most 800 tokens (rows × their longest prompt + completion; prompts of
    # 252-255 tokens and completions of 1-12: three short rows, or two long ones) against one
    # micro-batch of all 12 rows: the same gradient and
    # statistics, the normalisers being the mini-batch's (grpo, dapo; ppo's actor and critic), and
    # the scoring pass by tokens gives the log-probs and values that rows give.
    model, critic, tokenizer, batch = models
    sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    tokens = 800
    order = length_order(*sequences[:2], sequences[3])
    chunks = [rows for rows, _ in common.chunks_of(order, *sequences[:2], sequences[3], 0, tokens)]
    cost = lambda rows: len(rows) * (sequences[1][rows].sum(-1).max() + sequences[3][rows].sum(-1).max())  # noqa: E731
    assert len({len(chunk) for chunk in chunks}) > 1  # more rows to a chunk where they are short
    for chunk, after in zip(chunks, chunks[1:]):  # each within the budget, and full: the next row would not fit
        assert cost(chunk) <= tokens < cost(torch.cat([chunk, after[:1]]))
    shared = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sample_logp")}
    grpo_batch = shared | {k: batch[k] for k in ("old_logp", "ref_logp", "advantages")}
    for script, update in ((grpo, grpo_batch), (dapo, grpo_batch)):
        settings = dict(beta=0.04, max_new_tokens=12, num_iterations=2)
        reference = gradients_and_totals(script, model, update, script.Args(micro_batch_size=12, **settings), 384)
        by_tokens = script.Args(micro_batch_tokens=tokens, **settings)
        assert_same_update(gradients_and_totals(script, model, update, by_tokens, 384), reference)
    ppo_batch = shared | {k: batch[k] for k in ("old_logp", "old_values", "returns", "positive")}
    ppo_batch |= {"advantages": batch["advantages_ppo"]}
    for backward, trained in (("policy_backward", model), ("critic_backward", critic)):
        reference = gradients_and_totals(ppo, trained, ppo_batch, ppo.Args(micro_batch_size=12), 384, backward)
        by_tokens = ppo.Args(micro_batch_tokens=tokens)
        assert_same_update(gradients_and_totals(ppo, trained, ppo_batch, by_tokens, 384, backward), reference)
    with torch.no_grad():
        rows, _ = sequence_logprobs(model, *sequences, 1.0, len(tokenizer), 4)
        chunked, _ = sequence_logprobs(model, *sequences, 1.0, len(tokenizer), 0, chunk_tokens=tokens)
        values = ppo.critic_values(critic, *sequences, 4)
        chunked_values = ppo.critic_values(critic, *sequences, 0, chunk_tokens=tokens)
    eps = torch.finfo(torch.float32).eps
    assert (chunked - rows).abs().max() <= 8 * eps * rows.abs().max()
    assert (chunked_values - values).abs().max() <= 8 * eps * values.abs().max()
