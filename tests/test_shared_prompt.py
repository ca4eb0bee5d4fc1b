"""Each prompt forwarded once per group (forward_completions): its G completions attend to its
keys and values, and backward sums their gradients into the one prompt pass. Exactness against
the computation before (share=False: one pass over prompt + completion per row): log-probs and
values to 8 ulps of their largest (FP32_EPS), and the gradient of every loss to N·eps of its largest
entry (N tokens), with left padding, uneven lengths, G = 1, gradient checkpointing, LoRA and the
sliding-window families."""

import functools

import pytest
import torch

import common
import dapo
import grpo
import ppo
from common import enable_activation_checkpointing, load_model, load_policy
from conftest import assert_same_update, gradients_and_totals, sample_batch
from families import VOCAB, family_model, family_prompts

SEQUENCES = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
# fp32's eps, 1.19e-7. The two paths differ in kernel shapes and summation order only: a log-prob,
# entropy or value is one fp32 result a token, within a few roundings of its size (measured: 1 to 3
# ulps; allowed: 8 ulps of the largest); a gradient entry sums N tokens' terms, within N·eps.
FP32_EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def tiny():
    return scoring_batch()


def scoring_batch():
    """The tiny policy, a PPO critic with a random head, and 3 prompts × 4 completions of 1 to 12
    tokens (conftest.sample_batch: left-padded prompts of unequal length) with PPO's fields."""
    torch.manual_seed(0)
    model, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    batch = sample_batch(model, tokenizer, eos_ids)
    lengths = torch.tensor([12, 3, 7, 1, 12, 5, 2, 9, 4, 6, 2, 3])  # each row cut as if it had ended there
    keep = torch.arange(12)[None, :] < lengths[:, None]  # (12, T = 12)
    batch["completion_ids"] = batch["completion_ids"].masked_fill(~keep, tokenizer.pad_token_id)
    batch["completion_mask"], batch["truncated"] = keep.long(), lengths == 12
    batch["old_logp"], batch["ref_logp"] = batch["old_logp"] * keep, batch["ref_logp"] * keep
    mask = batch["completion_mask"]
    assert mask.sum(-1).unique().numel() > 2 and batch["prompt_mask"].sum(-1).unique().numel() > 1
    critic = ppo.load_critic(ppo.Args(model="tiny"), torch.device("cpu"), torch.float32)
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)
    batch |= {
        "sample_logp": batch["old_logp"] + 0.1 * torch.randn_like(batch["old_logp"]) * mask,
        "advantages_ppo": torch.randn(mask.shape) * mask,
        "old_values": 0.3 * torch.randn(mask.shape) * mask,
        "returns": torch.randn(mask.shape) * mask,
        "positive": (torch.arange(12) % 3 == 0).float(),
    }
    return model, critic, len(tokenizer), batch


@pytest.fixture(params=[False, True], ids=["columns-as-is", "columns-rounded"])
def rounded(request, monkeypatch):
    """Both layouts of forward_completions' chunks: columns as the CPU keeps them, and rounded up to
    a multiple of 8 as on CUDA (shape_multiple: 64 there), so that every prompt pass of a group of
    252-token prompts has padding."""
    if request.param:
        monkeypatch.setattr(common, "shape_multiple", lambda device: 8)
    return request.param


def unshared(script, monkeypatch):
    """Within it, `script` runs the computation before: one pass over prompt + completion a row, each
    row as it is, left padding and mask."""
    monkeypatch.setattr(common, "forward_completions", functools.partial(common.forward_completions, share=False))


def passes(module):
    """Counts the forward passes of module and the token positions they run: a dict to read. The
    one-token pass that looks at the model's head once (plain_head) is made first, uncounted."""
    common.plain_head(module)
    seen = {"passes": 0, "positions": 0, "unmasked": 0, "largest position": 0}

    def count(_, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen["passes"] += 1
        seen["positions"] += ids.numel()
        seen["unmasked"] += kwargs.get("attention_mask") is None
        seen["largest position"] = max(seen["largest position"], kwargs["position_ids"].max().item())

    return seen, module.register_forward_pre_hook(count, with_kwargs=True)


def test_log_probs_equal_and_each_prompt_runs_once(tiny, rounded, monkeypatch):
    # 12 rows, 3 prompts: chunks of 4 rows are one group each, so 3 prompt passes of 1 row and 3
    # completion passes of 4; before, 3 passes of 4 rows over prompt + completion. Every pass masked.
    model, _, vocab_size, batch = tiny
    sequences = [batch[k] for k in SEQUENCES]
    seen, handle = passes(model)
    with torch.no_grad():
        shared, entropy = grpo.sequence_logprobs(model, *sequences, 0.7, vocab_size, 4, with_entropy=True)
    handle.remove()
    unshared(grpo, monkeypatch)
    seen_before, handle = passes(model)
    with torch.no_grad():
        before, entropy_before = grpo.sequence_logprobs(model, *sequences, 0.7, vocab_size, 4, with_entropy=True)
    handle.remove()
    assert (shared - before).abs().max() <= 8 * FP32_EPS * before.abs().max()  # measured 4.8e-7 at 6.4: 1 ulp
    assert (entropy - entropy_before).abs().max() <= 8 * FP32_EPS * entropy_before.abs().max()
    assert (seen["passes"], seen_before["passes"]) == (6, 3)
    assert (seen["unmasked"], seen_before["unmasked"]) == (0, 0)
    assert seen["positions"] < 0.75 * seen_before["positions"]  # P + G·t instead of G·(P + t) for each group


GRPO_CASES = [
    dict(loss_type="grpo", num_iterations=2),
    dict(loss_type="dr_grpo", num_iterations=2),
    dict(loss_type="gspo", num_iterations=2),
    dict(loss_type="gpg", beta=0.0),
    dict(loss_type="cispo", num_iterations=2),
    dict(loss_type="grpo", num_iterations=2, entropy_coef=0.01, tis_cap=2.0, dual_clip=3.0),
    dict(loss_type="grpo", num_iterations=2, is_mask="0.8,1.25"),
]


@pytest.mark.parametrize("settings", GRPO_CASES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("micro_batch_size", [4, 5])  # whole groups; and groups split across micro-batches
def test_every_grpo_loss_has_the_gradient_of_before(tiny, settings, micro_batch_size, rounded, monkeypatch):
    model, _, vocab_size, batch = tiny
    args = grpo.Args(micro_batch_size=micro_batch_size, max_new_tokens=12, **{"beta": 0.04} | settings)
    batch = {k: v for k, v in batch.items() if k in (*SEQUENCES, "sample_logp", "old_logp", "ref_logp", "advantages")}
    if settings.get("beta") == 0.0:
        batch |= {"old_logp": None, "ref_logp": None}
    shared = gradients_and_totals(grpo, model, batch, args, vocab_size)
    unshared(grpo, monkeypatch)
    assert_same_update(shared, gradients_and_totals(grpo, model, batch, args, vocab_size))


@pytest.mark.parametrize("overlong_filter", [False, True])
def test_the_dapo_loss_has_the_gradient_of_before(tiny, overlong_filter, rounded, monkeypatch):
    model, _, vocab_size, batch = tiny
    batch = {
        k: v
        for k, v in batch.items()
        if k in (*SEQUENCES, "truncated", "sample_logp", "old_logp", "ref_logp", "advantages")
    }
    args = dapo.Args(
        micro_batch_size=4, beta=0.04, max_new_tokens=12, num_iterations=2, overlong_filter=overlong_filter
    )
    shared = gradients_and_totals(dapo, model, batch, args, vocab_size)
    unshared(dapo, monkeypatch)
    assert_same_update(shared, gradients_and_totals(dapo, model, batch, args, vocab_size))


def test_ppo_actor_and_critic_have_the_gradients_of_before(tiny, rounded, monkeypatch):
    model, critic, vocab_size, batch = tiny
    batch = dict(batch, advantages=batch["advantages_ppo"])
    args = ppo.Args(micro_batch_size=4, max_new_tokens=12, entropy_coef=0.01, pos_lm_coef=0.1)
    actor, value = (
        gradients_and_totals(ppo, model, batch, args, vocab_size),
        gradients_and_totals(ppo, critic, batch, args, 0, "critic_backward"),
    )
    with torch.no_grad():
        values = ppo.critic_values(critic, *[batch[k] for k in SEQUENCES], 4)
    unshared(ppo, monkeypatch)
    with torch.no_grad():
        before = ppo.critic_values(critic, *[batch[k] for k in SEQUENCES], 4)
        assert (values - before).abs().max() <= 8 * FP32_EPS * before.abs().max()  # measured 3.6e-7 at 2.0
    assert_same_update(actor, gradients_and_totals(ppo, model, batch, args, vocab_size))
    assert_same_update(value, gradients_and_totals(ppo, critic, batch, args, 0, "critic_backward"))


def test_one_completion_per_prompt_runs_one_pass_as_before(tiny, rounded, monkeypatch):
    # G = 1 (PPO's default is 8, but a user may sample one): no row shares a prompt, nothing to save.
    model, _, vocab_size, batch = tiny
    rows = torch.arange(0, 12, 4)  # one row of each prompt
    sequences = [batch[k][rows] for k in SEQUENCES]
    seen, handle = passes(model)
    with torch.no_grad():
        one_pass, entropy = grpo.sequence_logprobs(model, *sequences, 1.0, vocab_size, 3, with_entropy=True)
    handle.remove()
    assert (seen["passes"], seen["unmasked"]) == (1, 0)
    unshared(grpo, monkeypatch)
    seen_before, handle = passes(model)
    with torch.no_grad():
        before, entropy_before = grpo.sequence_logprobs(model, *sequences, 1.0, vocab_size, 3, with_entropy=True)
    handle.remove()
    # The padding columns repeat their row's last position: RoPE scaled by the longest position
    # (dynamic, longrope) sees the masked pass's.
    assert seen["largest position"] == seen_before["largest position"]
    assert (one_pass - before).abs().max() <= 8 * FP32_EPS * before.abs().max()
    assert (entropy - entropy_before).abs().max() <= 8 * FP32_EPS * entropy_before.abs().max()


def test_gradient_checkpointing_runs_one_pass_and_the_gradient_of_before(tiny, rounded, monkeypatch):
    # transformers drops the cache of a checkpointed layer in a backward pass: the shared pass would
    # lose the prompt, so forward_completions runs one pass over prompt + completion, as before.
    _, _, vocab_size, batch = tiny
    model, _, _ = load_model("tiny", torch.device("cpu"))
    enable_activation_checkpointing(model)
    model.train()
    args = grpo.Args(micro_batch_size=4, beta=0.04, max_new_tokens=12, num_iterations=2)
    batch = {k: v for k, v in batch.items() if k in (*SEQUENCES, "sample_logp", "old_logp", "ref_logp", "advantages")}
    seen, handle = passes(model)
    checkpointed = gradients_and_totals(grpo, model, batch, args, vocab_size)
    handle.remove()
    assert (seen["passes"], seen["unmasked"]) == (3, 0)  # 12 rows in micro-batches of 4
    unshared(grpo, monkeypatch)
    assert_same_update(checkpointed, gradients_and_totals(grpo, model, batch, args, vocab_size))


def test_lora_has_the_gradient_of_before(tiny, rounded, monkeypatch):
    _, _, vocab_size, batch = tiny
    torch.manual_seed(1)
    policy, _, _ = load_policy(grpo.Args(model="tiny", lora_rank=4), torch.device("cpu"), torch.float32)
    for name, parameter in policy.named_parameters():  # B = 0 at the start: move it, or A gets no gradient
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.05)
    args = grpo.Args(micro_batch_size=4, beta=0.04, max_new_tokens=12, num_iterations=2, lora_rank=4)
    batch = {k: v for k, v in batch.items() if k in (*SEQUENCES, "sample_logp", "old_logp", "ref_logp", "advantages")}
    shared = gradients_and_totals(grpo, policy.train(), batch, args, vocab_size)
    unshared(grpo, monkeypatch)
    assert_same_update(shared, gradients_and_totals(grpo, policy, batch, args, vocab_size))


@pytest.mark.parametrize("family", ["gemma3", "mistral", "gpt-oss", "qwen3-moe"])
def test_sliding_windows_reach_back_into_the_prompt_exactly(family, rounded, monkeypatch):
    # Windows of 8 under prompts of 12-30 tokens and completions of 10: a completion token's window
    # covers the end of the prompt, now in the cache; log-probs and the gradient as before. A window
    # counts columns: the prompt pass keeps its mask.
    model = family_model(family).train()
    prompt_ids, prompt_mask = (t.repeat_interleave(3, 0) for t in family_prompts())  # 3 prompts × 3
    generator = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, VOCAB, (9, 10), generator=generator)
    completion_mask = (torch.arange(10)[None, :] < torch.tensor([10, 4, 7, 1, 10, 9, 2, 6, 10])[:, None]).long()
    sequences = prompt_ids, prompt_mask, completion_ids * completion_mask, completion_mask
    results = []
    for share in (True, False):
        if not share:
            unshared(grpo, monkeypatch)
        model.zero_grad(set_to_none=True)
        logp, _ = grpo.sequence_logprobs(model, *sequences, 1.0, VOCAB, 6)
        (logp * torch.linspace(-1, 1, 10)).sum().backward()
        results.append((logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (logp, gradient), (logp_before, gradient_before) = results
    # measured: log-probs 2 ulps (9.5e-7 at 6.5, the old bound 1e-6), the gradient 4.7 eps of its largest
    tokens = completion_mask.sum().item()  # 59
    assert (logp - logp_before).abs().max() <= 8 * FP32_EPS * logp_before.abs().max()
    assert (gradient - gradient_before).abs().max() <= tokens * FP32_EPS * gradient_before.abs().max()


def test_whole_groups_is_a_uniform_shuffle_of_groups_from_the_same_random_numbers():
    # By hand: the permutation 5 2 0 3 1 4 of 6 rows in groups of 2 ({0,1}, {2,3}, {4,5}) meets group
    # 2 first (row 5), then group 1 (row 2), then group 0 (row 0): rows 4 5 2 3 0 1.
    assert common.whole_groups(torch.tensor([5, 2, 0, 3, 1, 4]), 2).tolist() == [4, 5, 2, 3, 0, 1]
    # Every order of 3 groups equally often over 6000 permutations of their rows (1000 each expected,
    # a standard deviation of ~29: every count within 5 of them).
    generator = torch.Generator().manual_seed(0)
    counts = {}
    for _ in range(6000):
        order = common.whole_groups(torch.randperm(6, generator=generator), 2)
        key = tuple((order[::2] // 2).tolist())
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 6 and all(abs(count - 1000) < 150 for count in counts.values()), counts


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=["grpo", "dapo", "ppo-checkpointed"])
def test_a_run_with_the_cuda_passes_trains_as_the_cpu_run(script, tmp_path, monkeypatch):
    # The passes CUDA runs (columns rounded to 64, shape_multiple), forced here on the CPU through two whole steps of each script (rollout, scoring, the update,
    # DAPO's rounds, PPO's critic, held-out evaluation): every metric of both steps as the CPU's
    # passes give it, to float reassociation, the tokens sampled the same. lr 1e-30, a step below
    # every weight's rounding: the tiny model's first rewards are all 0, so its update is AdamW's
    # step on rounding noise (a gradient of ~1e-7 divided by its own root mean square), which the
    # two passes' noise would send in two directions.
    from common import read_jsonl

    more = {"overlong_buffer": 4} if script is dapo else {"gradient_checkpointing": True} if script is ppo else {}
    settings = dict(model="tiny", task="digit", lr=1e-30, max_new_tokens=8, batch_size=4, group_size=4, max_steps=2)
    settings |= dict(save_every=0, eval_every=2, eval_problems=8, **more)
    runs = {}
    for rounded in (False, True):
        monkeypatch.setattr(common, "shape_multiple", lambda device, on=rounded: 64 if on else 1)
        run_dir = script.train(script.Args(output_dir=str(tmp_path / str(rounded)), **settings))
        runs[rounded] = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in runs[True]] == [row["step"] for row in runs[False]] == [1, 2]
    for before, after in zip(runs[False], runs[True], strict=True):
        for key, value in before.items():
            if isinstance(value, float) and not key.startswith(("seconds/", "throughput/", "time", "eval/seconds")):
                assert after[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
