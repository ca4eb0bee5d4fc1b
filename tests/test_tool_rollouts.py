"""Multi-turn rollouts (docs/tools.md): a row whose model ends its turn with a tool call takes the
tool's answer as forced tokens, then samples again. Here the tool is scripted (a tool_turn that
answers each ended turn with known tokens), so that every check is by hand: where the answers go,
that the sampler's log-probs still equal the scorer's and the model's own forward pass on every
model token, that the answers are attended to and never scored, counted in no normaliser, length
or GAE step, and that the budgets hold."""

import json
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import common
import dapo
import grpo
import ppo
from common import TINY_SECRET_CALL, build_tiny_model, load_model, render_chat
from families import (
    ANSWER,
    NEW_TOKENS,
    STOP,
    VOCAB,
    family_model,
    family_prompts,
    plain_forward_logprobs,
    sample_with_tools,
    scripted_tools,
)
from grpo import generate, sequence_logprobs
from rewards import load_task

TOLERANCE = 1e-5  # fp32, as tests/test_families.py


def test_each_answer_follows_its_turn_and_the_budgets_hold():
    model = family_model("qwen2")
    _, _, out, calls = sample_with_tools(model)
    answers_follow_their_turns(*out, calls)


def answers_follow_their_turns(ids, mask, truncated, sample_logp, tool_mask, calls):
    """Each ended turn's scripted answer right after its EOS, no gap, every budget held."""
    assert ids.shape[1] <= NEW_TOKENS + 2 * ANSWER
    assert not (mask.bool() & tool_mask.bool()).any()  # a token is the model's or the tool's
    assert (mask.sum(-1) <= NEW_TOKENS).all()  # max_new_tokens bounds the model's own tokens only
    assert (sample_logp[tool_mask.bool()] == 0).all()
    answered = 0
    for row in range(len(ids)):
        columns = (mask[row] + tool_mask[row]).sum().item()  # no gap: model and tool tokens, then padding
        assert (mask[row] + tool_mask[row])[:columns].all() and not (mask[row] + tool_mask[row])[columns:].any()
        turn, t = 0, 0
        while t < columns:
            if mask[row, t] and ids[row, t].item() in STOP:  # a turn ends: its answer follows, if any
                if t + 1 < columns:
                    turn += 1
                    assert ids[row, t + 1 : t + 1 + ANSWER].tolist() == [300 + row, 301 + turn, 400]
                    assert tool_mask[row, t + 1 : t + 1 + ANSWER].all()
                    t += ANSWER
                    answered += 1
                else:  # the last turn: no call left (max_turns), or no budget left
                    assert not truncated[row]
            t += 1
        assert turn <= 2
        assert tool_mask[row].sum() == turn * ANSWER
        if truncated[row]:  # out of model tokens, not ended by an EOS
            assert mask[row].sum() == NEW_TOKENS and ids[row, columns - 1].item() not in STOP
    assert answered >= 3, "the sample must hold answered turns"
    # tool_turn saw each ended turn's own tokens, from the first after the last answer to its EOS
    for row, turn_ids in calls:
        assert turn_ids[-1] in STOP and all(token not in (300 + row, 400) for token in turn_ids)


# ----------------------------------------------------------------------------------------
# Answers that land late (a slow tool beside the decode): the row waits in place, the others decode on.


@pytest.mark.parametrize("cuda_decode", [False, True], ids=["masked", "varlen"])
def test_late_answers_change_no_greedy_token_while_the_other_rows_decode_on(cuda_decode, request):
    # Greedy, every answer landing 4 steps after its call (3 steps of waiting in place, LateAnswers): each
    # row's tokens, masks and log-probs are those of answers given at once, as its waits hold its position
    # and hide the columns it skipped. The waits overlap: the decode takes far fewer than 3 steps more a call.
    model = family_model("qwen2")
    varlen = decode_as_on_a_gpu(cuda_decode, request)
    _, _, now, (calls, at_once) = sample_with_tools(model, temperature=0.0, delay=lambda row, turn: 0)
    _, _, late_out, (late_calls, late) = sample_with_tools(model, temperature=0.0, delay=lambda row, turn: 4)
    assert bool(varlen) == cuda_decode
    for got, expected in zip(late_out, now):
        assert got.shape == expected.shape and torch.allclose(got.float(), expected.float(), atol=TOLERANCE)
    assert torch.equal(late_out[0], now[0]) and calls == late_calls
    waited = [late.landed[key] - late.handed[key] for key in late.handed]
    # each row waited 3 steps in place (fewer where no other row could decode: generate blocked for it)
    assert len(waited) >= 4 and max(waited) == 4 and min(waited) >= 1
    assert late.steps - at_once.steps < 3 * len(waited)  # fewer than one call after another: 3 steps a call


def decode_as_on_a_gpu(cuda: bool, request) -> list:
    """cuda: the one-token step as on a GPU (varlen over each row's own columns: a held row's slot stays)."""
    return request.getfixturevalue("varlen") if cuda else []


@pytest.mark.parametrize("cuda_decode", [False, True], ids=["masked", "varlen"])
def test_late_answers_land_right_after_their_calls_and_sampling_stays_exact(cuda_decode, request):
    # Sampled, answers landing 1 to 12 steps late by row and turn: the cache (masked step) grows past
    # its P + 12 + 2·3 columns, the waits leave no gap in the completion, and the sampler's log-probs are
    # the scorer's and the model's own forward pass over the sequence as it came out.
    model = family_model("qwen2")
    decode_as_on_a_gpu(cuda_decode, request)
    delay = lambda row, turn: 1 + (5 * row + 7 * turn) % 12  # noqa: E731
    prompt_ids, prompt_mask, out, (calls, late) = sample_with_tools(model, delay=delay)
    ids, mask, _, sample_logp, tool_mask = out
    answers_follow_their_turns(*out, calls)
    assert max(late.landed[key] - late.handed[key] for key in late.handed) >= 10
    with torch.no_grad():
        scored, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, VOCAB, 4, tool_mask=tool_mask)
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask + tool_mask) * mask
    assert (sample_logp - scored).abs().max().item() <= TOLERANCE
    assert (sample_logp - plain).abs().max().item() <= TOLERANCE


def test_instant_answers_from_a_worker_thread_change_no_sampled_token():
    # Sampled, a seed: answers a ThreadPoolExecutor hands back as Futures (rewards.tool_turns' way)
    # give the tokens and log-probs of answers given at once: the step after a call waits
    # rewards.TOOL_GRACE_S for it, so a quick tool costs no step and moves no random draw.
    model = family_model("qwen2")
    with ThreadPoolExecutor(1) as pool:
        _, _, threaded, _ = sample_with_tools(model, answered=lambda answer: pool.submit(lambda: answer))
    _, _, at_once, _ = sample_with_tools(model)
    assert all(torch.equal(got, expected) for got, expected in zip(threaded, at_once))
    assert threaded[4].any()


def test_the_cache_holds_the_answers_that_came_not_every_turns_longest(monkeypatch):
    # --max_turns 2 × --max_tool_tokens 1000 would reserve 2000 columns a row; the 3-token answers that
    # come need 6. The cache starts at P + 12 (max_new_tokens) and grows by 64 once the answers push a
    # row past it: P + 76 columns at most, and the samples still equal the model's forward pass.
    model = family_model("qwen2")
    prompt_ids, prompt_mask = family_prompts()
    lengths, grow = [], common.DecodeStep.grow
    monkeypatch.setattr(
        common.DecodeStep, "grow", lambda step, columns: grow(step, columns) or lengths.append(step.cache.length)
    )
    tool_turn, _ = scripted_tools(2)
    torch.manual_seed(3)
    ids, mask, _, sample_logp, tool_mask = generate(
        model, prompt_ids, prompt_mask, NEW_TOKENS, STOP, 0, VOCAB, 1.0,
        tool_turn=tool_turn, max_turns=2, max_tool_tokens=1000,
    )  # fmt: skip
    assert tool_mask.sum(-1).max() == 2 * ANSWER and ids.shape[1] > NEW_TOKENS  # answers pushed a row past 12
    assert lengths == [prompt_ids.shape[1] + NEW_TOKENS + 64]  # one growth, not 2000 columns up front
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask + tool_mask) * mask
    assert (sample_logp - plain).abs().max().item() <= TOLERANCE


def test_the_varlen_cache_never_grows_past_what_a_row_can_fill(varlen, monkeypatch):
    # The varlen step: a row's own columns, none spent waiting. Answers 30 steps late push the step index
    # far past P + 12 + 2·3, but no row can fill more: the cache stops at P + 18 + 1 columns.
    model = family_model("qwen2")
    lengths, grow = [], common.DecodeStep.grow
    monkeypatch.setattr(
        common.DecodeStep, "grow", lambda step, columns: grow(step, columns) or lengths.append(step.cache.length)
    )
    prompt_ids, prompt_mask, out, (_, late) = sample_with_tools(model, delay=lambda row, turn: 30)
    assert varlen and late.steps > NEW_TOKENS + 2 * ANSWER + 30  # the waits ran the step index past it
    assert lengths == [prompt_ids.shape[1] + NEW_TOKENS + 2 * ANSWER + 1]
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, out[0], out[1] + out[4]) * out[1]
    assert (out[3] - plain).abs().max().item() <= TOLERANCE


def test_a_row_without_calls_samples_as_without_tools():
    # Greedy: row 0 never calls a tool, the others do; row 0's tokens are those of a run with no
    # tools at all, whatever the others' answers do: no row waits for another's tool.
    model = family_model("qwen2")
    prompt_ids, prompt_mask = family_prompts()

    def tool_turn(row, ids):
        return None if row == 0 else [300, 301, 400]

    plain, _, _, _, _ = generate(model, prompt_ids, prompt_mask, NEW_TOKENS, [], 0, VOCAB, 0.0)
    stop = list({plain[1, 2].item(), plain[2, 3].item()} - set(plain[0].tolist()))  # ends turns of rows 1, 2
    alone, _, _, _, _ = generate(model, prompt_ids, prompt_mask, NEW_TOKENS, stop, 0, VOCAB, 0.0)
    ids, mask, _, _, tool_mask = generate(
        model, prompt_ids, prompt_mask, NEW_TOKENS, stop, 0, VOCAB, 0.0,
        tool_turn=tool_turn, max_turns=2, max_tool_tokens=ANSWER,
    )  # fmt: skip
    assert tool_mask[1:].any() and not tool_mask[0].any()
    length = mask[0].sum()
    assert torch.equal(ids[0, :length], alone[0, :length])


def test_sampled_logprobs_equal_scoring_and_the_plain_forward_with_answers_in():
    # The contract: the answers are conditioned on, as the sampler conditioned on them, and not
    # scored. tests/test_families.py runs the same check on every family, windows included.
    model = family_model("qwen2")
    prompt_ids, prompt_mask, (ids, mask, _, sample_logp, tool_mask), _ = sample_with_tools(model)
    assert tool_mask.any()
    with torch.no_grad():
        scored, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, VOCAB, 4, tool_mask=tool_mask)
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask + tool_mask) * mask
    assert (sample_logp - scored).abs().max().item() <= TOLERANCE
    assert (sample_logp - plain).abs().max().item() <= TOLERANCE
    # Planted: the scorer not attending to the answers gets other log-probs.
    with torch.no_grad():
        blind, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, VOCAB, 4)
    assert (sample_logp - blind).abs().max().item() > 100 * TOLERANCE


def test_greedy_tokens_after_an_answer_are_the_plain_forward_argmax():
    # Positions and masks after forced tokens: every greedy model token is the argmax of the model's
    # own forward over prompt + everything before it, the answers included.
    model = family_model("llama3")
    prompt_ids, prompt_mask, (ids, mask, _, _, tool_mask), _ = sample_with_tools(model, temperature=0.0)
    assert tool_mask.any()
    sequence = torch.cat([prompt_ids, ids], 1)
    attention = torch.cat([prompt_mask, mask + tool_mask], 1)
    with torch.no_grad():
        logits = model(
            input_ids=sequence, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)
        ).logits[:, prompt_ids.shape[1] - 1 : -1, :VOCAB]
    model_tokens = mask.bool()
    assert torch.equal(logits.argmax(-1)[model_tokens], ids[model_tokens])


# ----------------------------------------------------------------------------------------
# The losses: each script's gradient with two answers in a completion equals the one by hand, over
# the model's tokens alone, from the model's forward over the whole sequence.


def batch_with_two_answers(model):
    """Two rows (one group of G = 2): row 0 holds two tool answers between its model tokens, row 1
    none. completion (model m, tool e): row 0 m m e e m e m, row 1 m m m (then padding)."""
    prompt_ids, prompt_mask = family_prompts(lengths=(12, 12))
    prompt_ids[1] = prompt_ids[0]  # one prompt, its group of 2
    completion_ids = torch.tensor([[5, 6, 300, 301, 7, 302, 8], [9, 10, 11, 0, 0, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 0, 0, 0, 0]])
    tool_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0]])
    return prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask


def hand_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask):
    """log π of every completion token from one plain forward pass over the whole sequence, with grad."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask + tool_mask], 1)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0))
    logits = logits.logits[:, prompt_ids.shape[1] - 1 : -1, :VOCAB].float()
    return logits.log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)


def gradient(model, loss_fn):
    model.zero_grad()
    loss_fn()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("script", [grpo, dapo], ids=["grpo", "dapo"])
def test_the_policy_gradient_counts_the_model_tokens_only(script):
    # On-policy, β = 0: GRPO's loss is −(1/N) Σ_i (Â_i/|o_i|) Σ_{t ∈ o_i} r_t with r_t = π/sg(π) = 1,
    # whose gradient is −(1/N) Σ_i (Â_i/|o_i|) Σ_t ∇log π_t; DAPO's token-level mean divides by
    # Σ_i |o_i| instead. |o_0| = 4 model tokens (not 7), |o_1| = 3. Â = (1, −1).
    model = family_model("qwen2")
    prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask = batch_with_two_answers(model)
    advantages = torch.tensor([1.0, -1.0])
    extra = dict(overlong_buffer=0) if script is dapo else dict(loss_type="grpo")
    args = script.Args(beta=0.0, max_new_tokens=8, micro_batch_size=1, **extra)
    batch = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "tool_mask": tool_mask, "truncated": torch.tensor([False, False]),
        "sample_logp": torch.zeros(2, 7), "old_logp": None, "ref_logp": None, "advantages": advantages,
        "entropy": None,
    }  # fmt: skip
    got = gradient(model, lambda: script.policy_backward(model, batch, args, VOCAB))

    def by_hand():
        logp = hand_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask)
        per_token = advantages[:, None] * logp * completion_mask
        if script is grpo:
            loss = -(per_token.sum(-1) / completion_mask.sum(-1)).mean()
        else:
            loss = -per_token.sum() / completion_mask.sum()
        loss.backward()

    expected = gradient(model, by_hand)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4)

    def answers_counted():  # planted: the answers trained as if the model had written them
        logp = hand_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask)
        every = completion_mask + tool_mask
        loss = -((advantages[:, None] * logp * every).sum(-1) / every.sum(-1)).mean()
        loss.backward()

    assert not torch.allclose(got, gradient(model, answers_counted), atol=1e-6, rtol=1e-4)


def test_ppo_gae_steps_across_an_answer_in_one_step():
    # Row 0: model tokens at columns 0, 1, 4 (answer at 2-3), padding at 5. The reward R = 1 at the
    # last model token (column 4). Over the model's tokens alone, s_0 → s_1 → s_4 → end:
    #   δ_4 = R − V_4 = 1 − 0.5 = 0.5
    #   δ_1 = γV_4 − V_1 = 0.9·0.5 − 0.2 = 0.25
    #   δ_0 = γV_1 − V_0 = 0.9·0.2 − 0.1 = 0.08
    #   Â_4 = 0.5;  Â_1 = 0.25 + γλ·0.5 = 0.25 + 0.45·0.5 = 0.475;  Â_0 = 0.08 + 0.45·0.475 = 0.29375
    # returns R_t = Â_t + V_t: 1.0, 0.675, 0.39375. At the answer's columns and the padding: 0.
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.5, 9.0]])  # 9: what the critic reads at an answer, unused
    args = ppo.Args(beta=0.0, gamma=0.9, lam_actor=0.5, lam_critic=0.5, whiten_advantages=False)
    raw, advantages, returns = ppo.advantages_and_returns(torch.tensor([1.0]), None, None, values, mask, args)
    expected = torch.tensor([[0.29375, 0.475, 0.0, 0.0, 0.5, 0.0]])
    assert torch.allclose(raw, expected) and torch.equal(advantages, raw)
    assert torch.allclose(returns, torch.tensor([[0.39375, 0.675, 0.0, 0.0, 1.0, 0.0]]))
    # Planted: GAE over the columns as they stand (answer steps of V = 0) gives other advantages.
    gapped, _ = ppo.gae(ppo.token_rewards(torch.tensor([1.0]), None, None, mask + 0, 0.0), values, mask, 0.9, 0.5)
    assert not torch.allclose(gapped, expected)


def test_ppo_without_answers_is_unchanged_by_the_gather():
    # The model's tokens a prefix (no tools): model_tokens_first is the identity, the numbers exact.
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    values, old_logp, ref_logp = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    args = ppo.Args(beta=0.05, gamma=1.0, lam_actor=0.95, lam_critic=1.0)
    got = ppo.advantages_and_returns(torch.tensor([1.0, 0.0]), old_logp, ref_logp, values, mask, args)
    assert torch.equal(ppo.model_tokens_first(mask), torch.arange(4).expand(2, 4))
    per_token = ppo.token_rewards(torch.tensor([1.0, 0.0]), old_logp, ref_logp, mask, beta=0.05)
    raw, _ = ppo.gae(per_token, values, mask, gamma=1.0, lam=0.95)
    assert torch.equal(got[0], raw)


def test_ppo_critic_reads_values_at_model_tokens_with_the_answers_attended():
    model = family_model("qwen2")
    prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask = batch_with_two_answers(model)
    critic = ppo.Critic(model.model)
    torch.nn.init.normal_(critic.value_head.weight)  # not the zeros it starts with: values to compare
    with torch.no_grad():
        values = ppo.critic_values(
            critic, prompt_ids, prompt_mask, completion_ids, completion_mask, 1, tool_mask=tool_mask
        )
        ids = torch.cat([prompt_ids, completion_ids], 1)
        attention = torch.cat([prompt_mask, completion_mask + tool_mask], 1)
        hidden = critic.backbone(
            input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)
        ).last_hidden_state[:, prompt_ids.shape[1] - 1 : -1]
        expected = critic.value_head(hidden).squeeze(-1) * completion_mask
    assert torch.allclose(values, expected, atol=1e-5)
    assert (values[tool_mask.bool()] == 0).all()


def test_tool_metrics_by_hand():
    # Two completions: 3 calls (1 failed) in 2 turns, and none. Tokens: 7 + 4 of the model's, 4 of
    # the tools': calls 3/2 = 1.5 a completion, errors 1/3, turns 2/2 = 1, env share 4/15.
    completion_mask = torch.tensor([[1, 1, 1, 0, 0, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    tool_mask = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0], [0] * 11])
    rollout = dict(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        completion_ids=torch.zeros(2, 11, dtype=torch.long), completion_mask=completion_mask,
        truncated=torch.tensor([False, False]), sample_logp=torch.zeros(2, 11), rewards=torch.zeros(2),
        texts=["", ""], scores=[],
    )  # fmt: skip
    metrics = common.tool_metrics(
        grpo.Rollout(**rollout, tool_mask=tool_mask, tool_counts=torch.tensor([[3, 1, 2, 0], [0, 0, 0, 0]]))
    )
    assert metrics == pytest.approx(
        {
            "tools/calls": 1.5,
            "tools/errors": 1 / 3,
            "tools/turns": 1.0,
            "tools/over_budget": 0.0,
            "tools/env_share": 4 / 15,
        }
    )
    assert common.tool_metrics(grpo.Rollout(**rollout)) == {}  # a task without tools: no tools/ metrics


# ----------------------------------------------------------------------------------------
# Each script, end to end: a model that calls its tool, one step, the tools' metrics and turns.


@pytest.fixture(scope="module")
def calling_model(tmp_path_factory):
    """tiny-tools taught, in a few supervised steps, to start each secret prompt's answer with its
    call token (p ≈ 0.9): a model whose rollouts have tool turns, saved as --model takes it."""
    path = tmp_path_factory.mktemp("calling")
    shutil.copytree(build_tiny_model(name="tiny-tools"), path, dirs_exist_ok=True)
    model, tokenizer, _ = load_model(str(path), torch.device("cpu"))
    task = load_task("secret")
    call = tokenizer.convert_tokens_to_ids(TINY_SECRET_CALL)
    prompts = [render_chat(tokenizer, task.messages(problem), tools=task.tools) for problem in task.problems]
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(40):
        for prompt in prompts:
            ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
            loss = -model(input_ids=ids).logits[0, -1].log_softmax(-1)[call]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if loss.exp() < 0.1:  # p(call) > 0.9
            break
    model.save_pretrained(path)
    return path


@pytest.mark.xdist_group("calling_model")  # one worker teaches the model once (-n 2 --dist loadgroup)
@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=["grpo", "dapo", "ppo"])
def test_each_script_trains_a_step_with_tool_turns(script, calling_model, tmp_path):
    extra = dict(overlong_buffer=2, dynamic_sampling=False) if script is dapo else {}
    args = script.Args(
        model=str(calling_model), task="secret", batch_size=2, group_size=4, max_new_tokens=6, max_turns=1,
        max_tool_tokens=24, max_steps=1, save_every=0, sample_every=1, num_samples=2, lr=1e-3, beta=0.01,
        entropy_coef=0.01, output_dir=str(tmp_path), **extra,
    )  # fmt: skip
    run_dir = script.train(args)
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["tools/calls"] > 0.5 and metrics["tools/turns"] == metrics["tools/calls"]  # one call a turn
    assert 0 < metrics["tools/env_share"] < 1 and metrics["tools/errors"] == 0
    assert metrics["policy/sample_logp_diff_max"] < 1e-5  # sampler and scorer agree, the answers in
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    turns = [turn for sample in samples for turn in sample["turns"]]
    assert any("tool" in turn and "<tool_response>" in turn["tool"] for turn in turns)
    assert any("model" in turn and TINY_SECRET_CALL in turn["model"] for turn in turns)


def test_grpo_learns_to_call_the_tool(tmp_path):
    # The secret task pays nothing without a call (docs/tools.md, whose run this is, cut to 20 steps):
    # a random tiny-tools model calls in 2.7% of its completions at step 1 and in ~63% at step 20
    # (measured, 2 CPU cores). Sampling is chaotic across CPUs' vector kernels: the margins are wide.
    args = grpo.Args(
        model="tiny-tools", task="secret", lr=3e-3, max_new_tokens=8, max_tool_tokens=24, max_turns=1,
        max_steps=20, save_every=0, sample_every=0, output_dir=str(tmp_path),
    )  # fmt: skip
    rows = [json.loads(line) for line in (grpo.train(args) / "metrics.jsonl").read_text().splitlines()]
    calls = [row["tools/calls"] for row in rows]
    assert calls[0] < 0.1 and sum(calls[-3:]) / 3 > 0.3
    assert rows[-1]["reward/mean"] > rows[0]["reward/mean"]


@pytest.mark.xdist_group("calling_model")  # one worker teaches the model once (-n 2 --dist loadgroup)
def test_held_out_evaluation_undoes_what_the_tools_draw(calling_model):
    # A tool may draw from Python's random module (the secret task's does): --eval_every must not
    # shift the draws training makes next. Planted (no setstate): random.random() differs after.
    model, tokenizer, eos_ids = load_model(str(calling_model), torch.device("cpu"))
    draws = []

    def secret_digit() -> str:
        """Tells the secret digit, as the task's own does, counting its draws."""
        draws.append(random.random())
        return "7"

    task = load_task("secret")
    task.tools = [secret_digit]
    random.seed(5)
    expected = random.Random(5).random()
    metrics = common.evaluate_heldout(
        grpo.rollout, model, tokenizer, eos_ids, task, max_new_tokens=6, batch_size=4, max_turns=1, max_tool_tokens=24,
        tool_timeout=10.0,
    )  # fmt: skip
    assert draws  # greedy, the taught model calls
    assert random.random() == expected
    # issue 59: held-out evaluation logs its tool metrics, one call a problem here
    assert metrics["eval/tools/calls"] == len(draws) / len(task.problems) and metrics["eval/tools/errors"] == 0


SECRET_TOOL = '''
def secret_digit() -> str:
    """Tells the secret digit.

    Returns:
        The secret digit.
    """
    return "7"
'''


@pytest.mark.xdist_group("calling_model")  # one worker teaches the model once (-n 2 --dist loadgroup)
def test_evaluate_py_benchmarks_with_the_tools(calling_model, tmp_path):
    # evaluate.py --tool: the secret prompts as a file benchmark, the taught model greedy. It calls
    # (p ≈ 0.9 at its first token), the answer comes in, and the entry counts the calls; a
    # completion's length is the model's own tokens, at most --max_new_tokens, the answers on top.
    import evaluate

    data = tmp_path / "secret.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p["prompt"], "answer": "7"}) + "\n" for p in load_task("secret").problems)
    )
    (tmp_path / "secret_tool.py").write_text(SECRET_TOOL)
    args = evaluate.Args(
        model=str(calling_model), benchmarks="file", eval_data_file=str(data), grader="number", instruction="",
        tool=f"{tmp_path / 'secret_tool.py'}:secret_digit", max_turns=1, max_tool_tokens=24, max_new_tokens=6,
        batch_size=4, output_dir=str(tmp_path / "out"),
    )  # fmt: skip
    run_dir = evaluate.main(args)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["tool"] and results["max_turns"] == 1  # the settings say it had tools
    entry = results["results"]["file"]
    assert entry["tool_calls"] > 0.5 and entry["tool_errors"] == 0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["length"] <= 6 and s["tool_failed"] == 0 for s in samples)
    called = [s for s in samples if s["tool_calls"]]
    assert called and all(s["turns"][0]["model"] == TINY_SECRET_CALL for s in called)
    assert all("<tool_response>" in s["turns"][1]["tool"] and "7" in s["turns"][1]["tool"] for s in called)
    without = evaluate.main(evaluate.Args(**{**vars(args), "tool": "", "output_dir": str(tmp_path / "plain")}))
    plain = json.loads((without / "results.json").read_text())
    assert "tool_calls" not in plain["results"]["file"] and "tool" not in plain  # no tools: as before


@pytest.mark.parametrize(
    "model, limits, message",
    [
        ("tiny", {}, "does not show the tools ['calculator']"),  # its template has no `tools`
        ("tiny-tools", {"max_tool_tokens": 4}, "--max_tool_tokens 4 is fewer than the"),
    ],
)
def test_evaluate_py_stops_on_tools_it_cannot_give_before_writing_anything(model, limits, message, tmp_path):
    import evaluate

    args = evaluate.Args(
        model=model, benchmarks="countdown", tools="calculator", limit=2, max_new_tokens=4,
        output_dir=str(tmp_path / "out"), **limits,
    )  # fmt: skip
    with pytest.raises(SystemExit, match=re.escape(message)):
        evaluate.main(args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=["grpo", "dapo", "ppo"])
@pytest.mark.parametrize(
    "model, limits, message",
    [
        ("tiny", {}, "does not show the tools ['secret_digit']"),  # the task's own tool; tiny's template shows none
        ("tiny-tools", {"max_tool_tokens": 4}, "--max_tool_tokens 4 is fewer than the"),
    ],
)
def test_a_training_script_stops_on_tools_it_cannot_give_before_a_run_starts(script, model, limits, message, tmp_path):
    # The checks the first rollout would make (tool_turns), made where the tokenizer loads: no run
    # directory is left holding an args.json of a run that never started.
    extra = {"overlong_buffer": 2} if script is dapo else {}
    args = script.Args(
        model=model, task="secret", max_new_tokens=4, batch_size=2, group_size=2, output_dir=str(tmp_path / "runs"),
        **extra, **limits,
    )  # fmt: skip
    with pytest.raises(SystemExit, match=re.escape(message)):
        script.train(args)
    assert not (tmp_path / "runs").exists()
