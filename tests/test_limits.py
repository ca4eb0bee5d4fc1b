"""The limits a user relies on, each at its boundary (issue 57): --max_turns N answers N tool turns,
not N + 1; a tool answer of exactly --max_tool_tokens is kept whole, and so is a --max_tool_tokens
of exactly the template's own tokens; each turn's calls are read from that turn alone; dapo.py's
reward reads the tools' answers, its overlong penalty does not count them, tools/errors is a share
of calls; a JSONL line of spaces is no row; an infinite or NaN *_coef stops before a model loads;
the preflight settles on the most rows that fit; dynamic sampling keeps at most B groups; and
evaluate.py's --reward_fn is told about truncation and fails as a share of completions."""

import dataclasses
import json

import pytest
import torch
from test_cli import no_model_load, tiny_args
from transformers import AutoTokenizer

import common
import dapo
import evaluate
import grpo
import ppo
from common import TINY_SECRET_CALL, build_tiny_model, check_task_tools, preflight, read_jsonl
from families import ANSWER, NEW_TOKENS, STOP, VOCAB, family_model, family_prompts, scripted_tools
from rewards import (
    FileTaskSpec,
    Score,
    Task,
    ToolQueue,
    digit_messages,
    fitted_answer,
    load_file_task,
    load_task,
    read_rows,
    tool_turn_text,
    tool_turns,
    tool_turns_due,
)

# tiny-tools' template around one empty answer, as its tokenizer splits it (one token each):
# "\n" <|im_start|> "u" "s" "er" "\n" <tool_response> "\n" "\n" </tool_response> <|im_end|> "\n"
# <|im_start|> "a" "s" "s" "is" "t" "an" "t" "\n": 21 tokens.
AROUND = 21


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(build_tiny_model(name="tiny-tools"))


def counting_tool():
    """A secret_digit (the name tiny-tools' one-token call names) that records each call: '7'."""
    called = []

    def secret_digit() -> str:
        """The secret digit."""
        called.append(1)
        return "7"

    return secret_digit, called


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------
# 1. --max_turns N: N tool turns answered, the (N + 1)-th call ends the completion


@pytest.mark.parametrize("max_turns", [1, 2])
def test_max_turns_answers_at_most_n_turns(tokenizer, max_turns):
    tool, called = counting_tool()
    tool_turn, counts = tool_turns(tokenizer, [tool], 1, max_turns, 24, 5.0)
    call = ids_of(tokenizer, TINY_SECRET_CALL)  # one turn: the call and its <|im_end|>
    answers = [tool_turn(0, call) for _ in range(max_turns + 1)]  # Futures of the answers, None at the end
    answers = [a.result() if a is not None else None for a in answers]
    # turns 1 … N answered ("7" in the template: 21 + 1 = 22 tokens), turn N + 1: None, the end
    assert [a is not None for a in answers] == [True] * max_turns + [False]
    assert all(len(a) == AROUND + 1 for a in answers[:max_turns])
    assert len(called) == max_turns  # the call past the limit is not run
    assert counts[0].tolist() == [max_turns, 0, max_turns, 1]  # calls, failed, turns answered, calls past them


# ----------------------------------------------------------------------------------------
# 2. An answer of exactly --max_tool_tokens is kept whole; one token more and it is cut


def test_an_answer_of_exactly_max_tool_tokens_is_kept_whole(tokenizer):
    # "7777": 4 tokens (one a digit) in the template's 21: 25 tokens in all.
    whole = ids_of(tokenizer, tool_turn_text(tokenizer, [("secret_digit", "7777")]))
    assert len(whole) == AROUND + 4
    assert fitted_answer(tokenizer, [("secret_digit", "7777")], AROUND + 4) == whole
    assert "7777" in tokenizer.decode(whole) and "…" not in tokenizer.decode(whole)
    cut = fitted_answer(tokenizer, [("secret_digit", "7777")], AROUND + 3)  # one token short: cut
    assert len(cut) <= AROUND + 3 and "7777" not in tokenizer.decode(cut)


# ----------------------------------------------------------------------------------------
# 5. --max_tool_tokens equal to the template's own tokens around an answer is accepted


def test_max_tool_tokens_equal_to_the_templates_tokens_is_accepted(tokenizer):
    task = load_task("secret")
    check_task_tools(tokenizer, task, AROUND)  # 21: exactly what the template writes, accepted
    assert len(fitted_answer(tokenizer, [("", "")], AROUND)) == AROUND
    tool, _ = counting_tool()
    tool_turns(tokenizer, [tool], 1, 1, AROUND, 5.0)  # the rollout's own check passes too
    # one fewer is refused, by both, with the count
    message = f"--max_tool_tokens {AROUND - 1} is fewer than the {AROUND} tokens"
    with pytest.raises(SystemExit, match=message):
        check_task_tools(tokenizer, task, AROUND - 1)
    with pytest.raises(SystemExit, match=message):
        fitted_answer(tokenizer, [("", "")], AROUND - 1)


# ----------------------------------------------------------------------------------------
# 4. Each turn's calls are read from that turn only (max_turns >= 2)


def test_a_call_of_an_earlier_turn_is_not_run_again(tokenizer):
    # Row: [the call] [its answer: 22 tokens] "ab" <|im_end|>. The second turn ("ab" and its end)
    # calls nothing: the row ends, and the tool ran once (the first turn's call, not again).
    tool, called = counting_tool()
    tool_turn, counts = tool_turns(tokenizer, [tool], 1, 2, 24, 5.0)
    call = ids_of(tokenizer, TINY_SECRET_CALL)
    answer = tool_turn(0, call).result()  # turn 1, as tool_turns_due hands it
    second = ids_of(tokenizer, "ab") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    row = call + answer + second
    env = ToolQueue.empty(1, 24, tokenizer.pad_token_id, torch.device("cpu"))
    env.start[0], env.spent[0] = len(call) + len(answer), len(call) + len(second)  # turn 2 begins after the answer
    ended = tool_turns_due(
        env, torch.tensor([True]), torch.tensor([row]), torch.tensor([0]), torch.tensor([len(row)]), 5, tool_turn, 8
    )
    assert ended.tolist() == [True]  # no call in turn 2: the completion ends
    assert len(called) == 1 and counts[0].tolist() == [1, 0, 1, 0]


def test_ppo_generate_hands_each_turn_its_own_tokens():
    # ppo.py's decode loop with --max_turns 2 and a scripted tool answering [300 + row, 301 + turn,
    # 400]: every turn handed to the tool is the model's tokens since the last answer, up to its
    # EOS, none of an answer's tokens nor an earlier turn's.
    model = family_model("qwen2")
    prompt_ids, prompt_mask = (tensor.repeat_interleave(2, 0) for tensor in family_prompts())
    tool_turn, calls = scripted_tools(2)
    torch.manual_seed(3)
    ids, mask, _, _, tool_mask = ppo.generate(
        model, prompt_ids, prompt_mask, NEW_TOKENS, STOP, 0, VOCAB, 1.0,
        tool_turn=tool_turn, max_turns=2, max_tool_tokens=ANSWER,
    )  # fmt: skip
    assert tool_mask.sum(-1).max() == 2 * ANSWER, "some row must have two answered turns"
    for row in range(len(ids)):
        turns, turn = [], []  # the model's tokens of each ended turn, split at the answers
        for t in range(ids.shape[1]):
            if mask[row, t]:
                turn.append(ids[row, t].item())
                if turn[-1] in STOP:
                    turns.append(turn)
                    turn = []
        handed = [turn_ids for r, turn_ids in calls if r == row]
        assert handed == turns[: len(handed)] and len(handed) >= len(turns) - 1


# ----------------------------------------------------------------------------------------
# 3. dapo.py with tools: the reward's text, tools/errors, the overlong penalty's lengths


def test_dapo_rollout_scores_the_text_with_the_tools_answers(tokenizer, monkeypatch):
    # generate's output by hand: the model's "ab", the tool's "\n7\n" (3 tokens), the model's "cd";
    # the scorer gets all of it, "ab\n7\ncd" (the answer inside), with its truncation.
    model_a, tool_ids, model_b = ids_of(tokenizer, "ab"), ids_of(tokenizer, "\n7\n"), ids_of(tokenizer, "cd")
    completion = torch.tensor([model_a + tool_ids + model_b + [tokenizer.pad_token_id]])
    completion_mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0]])
    tool_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0]])
    truncated = torch.tensor([True])

    def fake_generate(*args, **kwargs):
        return completion, completion_mask, truncated, torch.zeros(1, 8), tool_mask

    seen = []

    def score(text, problem, truncated=False):
        seen.append((text, truncated))
        return Score(1.0, True, True)

    tool, _ = counting_tool()
    task = Task("mine", [{"prompt": "hi"}], digit_messages, score, tools=[tool])
    monkeypatch.setattr(dapo, "generate", fake_generate)
    batch = dapo.rollout(
        torch.nn.Linear(1, 1), tokenizer, [0], task, task.problems, group_size=1, max_new_tokens=4,
        temperature=1.0, top_p=1.0, max_turns=1, max_tool_tokens=24,
    )  # fmt: skip
    assert seen == [("ab\n7\ncd", True)]
    assert batch.texts == ["ab\n7\ncd"] and torch.equal(batch.tool_mask, tool_mask)


def test_dapo_tool_errors_are_a_share_of_calls():
    # Two completions: 3 calls (1 failed) in 2 turns, and 1 call (failed) in 1 turn. Tokens: 5 + 2 of
    # the model's, 3 of the tools'. calls 4/2 = 2 a completion, errors 2/4 = 0.5 (of calls, not 2/2
    # of completions), turns 3/2 = 1.5, env share 3/10.
    completion_mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1], [1, 0, 1, 0, 0, 0, 0]])  # m m e e m m m; m e m
    tool_mask = torch.tensor([[0, 0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0]])
    batch = dapo.Rollout(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        completion_ids=torch.zeros(2, 7, dtype=torch.long), completion_mask=completion_mask,
        truncated=torch.tensor([False, False]), sample_logp=torch.zeros(2, 7), rewards=torch.zeros(2),
        texts=["", ""], scores=[], tool_mask=tool_mask, tool_counts=torch.tensor([[3, 1, 2, 0], [1, 1, 1, 2]]),
    )  # fmt: skip
    assert common.tool_metrics(batch) == pytest.approx(
        {
            "tools/calls": 2.0,
            "tools/errors": 0.5,
            "tools/turns": 1.5,
            "tools/over_budget": 1.0,
            "tools/env_share": 3 / 10,
        }
    )


def with_answers(model_tokens: list[int], answer: int):
    """A dapo.rollout that rewrites each real rollout's completions by hand: row i holds
    model_tokens[i] of the model's tokens, with `answer` tokens of a tool's answer after its first."""
    real = dapo.rollout

    def rollout(*args, **kwargs):
        batch = real(*args, **kwargs)
        n, width = len(batch.texts), max(model_tokens) + answer
        completion_mask, tool_mask = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width, dtype=torch.long)
        for row, m in enumerate(model_tokens):
            completion_mask[row, 0] = 1
            tool_mask[row, 1 : 1 + answer] = 1
            completion_mask[row, 1 + answer : answer + m] = 1
        return dataclasses.replace(
            batch, completion_ids=torch.full((n, width), 67) * (completion_mask + tool_mask),
            completion_mask=completion_mask, tool_mask=tool_mask, sample_logp=torch.zeros(n, width),
            truncated=torch.tensor([m == 4 for m in model_tokens]),
        )  # fmt: skip

    return rollout


@pytest.mark.filterwarnings("ignore:policy/sample_logp_diff")  # the hand-made rows' sample_logp: zeros
def test_dapo_overlong_penalty_counts_the_models_tokens_only(monkeypatch, tmp_path):
    # 4 completions of 4, 3, 2, 1 model tokens, each with a 2-token tool answer. L_max 4, L_cache 2:
    # penalties (4 − 2 − |o|)/2 clamped to [−1, 0]: −1, −0.5, 0, 0, mean −0.375. Counting the
    # answers (6, 5, 4, 3 tokens) would give −1, −1, −1, −0.5.
    lengths = []
    shaped = dapo.shaped_advantages
    monkeypatch.setattr(dapo, "rollout", with_answers([4, 3, 2, 1], 2))
    monkeypatch.setattr(dapo, "shaped_advantages", lambda r, l, **kw: lengths.append(l.tolist()) or shaped(r, l, **kw))
    run_dir = dapo.train(
        dapo.Args(model="tiny", task="digit", max_steps=1, batch_size=2, group_size=2, max_new_tokens=4,
                  overlong_buffer=2, dynamic_sampling=False, save_every=0, output_dir=str(tmp_path))
    )  # fmt: skip
    assert lengths == [[4, 3, 2, 1]]
    assert read_jsonl(run_dir / "metrics.jsonl")[0]["reward/overlong_penalty"] == pytest.approx(-0.375)


# ----------------------------------------------------------------------------------------
# 9. DAPO's dynamic sampling keeps at most B groups over its rounds


def test_first_groups_keeps_the_first_in_order():
    # limit 3 of [[0, 2], [1, 3, 4]]: round 0's two, then round 1's first
    assert dapo.first_groups([[0, 2], [1, 3, 4]], 3) == [[0, 2], [1]]
    assert dapo.first_groups([[0, 2], [1]], 5) == [[0, 2], [1]]


def test_dynamic_sampling_never_keeps_more_than_b_groups(monkeypatch, tmp_path):
    # B = 2, rounds of 3 prompts × G = 2. Round 1: group 0 informative (rewards 1, 0), groups 1, 2
    # not (0, 0). Round 2: all 3 informative. 1 + 3 = 4 offered; kept: round 1's group 0, then
    # round 2's group 0 only: 2 groups, 4 rows, after 2 rounds.
    real, rounds, kept_seen = dapo.rollout, [], []
    rewards = [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]]

    def rollout(*args, **kwargs):
        batch = real(*args, **kwargs)
        rounds.append(1)
        return dataclasses.replace(batch, rewards=torch.tensor(rewards[len(rounds) - 1]))

    keep = dapo.keep_groups
    monkeypatch.setattr(dapo, "rollout", rollout)
    monkeypatch.setattr(dapo, "keep_groups", lambda r, k, *a: kept_seen.append(k) or keep(r, k, *a))
    run_dir = dapo.train(
        dapo.Args(model="tiny", task="digit", max_steps=1, batch_size=2, group_size=2, gen_batch_size=3,
                  max_gen_rounds=3, max_new_tokens=4, overlong_buffer=0, save_every=0, output_dir=str(tmp_path))
    )  # fmt: skip
    assert kept_seen == [[[0], [0]]]
    metrics = read_jsonl(run_dir / "metrics.jsonl")[0]
    assert (metrics["sampling/rounds"], metrics["sampling/groups_generated"], metrics["sampling/groups_kept"]) == (
        2,
        6,
        2,
    )


# ----------------------------------------------------------------------------------------
# 6. --task file: a JSONL line of spaces is skipped like an empty line


def test_a_jsonl_line_of_spaces_is_no_row(tmp_path):
    rows = [{"question": "What is 1 + 2?", "answer": "3"}, {"question": "What is 2 + 2?", "answer": "4"}]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n   \n\n" + json.dumps(rows[1]) + "\n  \t \n")
    assert read_rows(str(path), "train") == rows  # 2 rows: the blank and spaces-only lines skipped
    heldout = tmp_path / "heldout.jsonl"  # its own held-out file: every row of rows.jsonl trains
    heldout.write_text(json.dumps({"question": "What is 3 + 3?", "answer": "6"}) + "\n")
    spec = FileTaskSpec(str(path), prompt_key="question", grader="number", eval_data_file=str(heldout))
    task = load_file_task(spec, "train")
    assert [p["gold"] for p in task.problems] == ["3", "4"]


# ----------------------------------------------------------------------------------------
# 7. Every *_coef flag infinite or NaN stops before a model loads

# By hand from the scripts' Args: grpo and dapo have kl_cov_coef and entropy_coef, ppo entropy_coef
# and pos_lm_coef.
COEFS = {
    grpo: {"kl_cov_coef", "entropy_coef"},
    dapo: {"kl_cov_coef", "entropy_coef"},
    ppo: {"entropy_coef", "pos_lm_coef"},
}


def coefs(script) -> set[str]:
    return {field.name for field in dataclasses.fields(script.Args) if field.name.endswith("_coef")}


def test_the_coef_flags_are_the_ones_listed():
    for script, names in COEFS.items():
        assert names <= coefs(script), script.__name__


@pytest.mark.parametrize(
    "script, name",
    [(script, name) for script in COEFS for name in sorted(coefs(script) | COEFS[script])],
    ids=lambda v: getattr(v, "__name__", v),
)
@pytest.mark.parametrize(
    "value, message", [(float("inf"), "is inf: give it a finite number"), (float("nan"), "is NaN: give it a number")]
)
def test_an_infinite_or_nan_coef_stops_before_any_model_loads(script, name, value, message, monkeypatch, tmp_path):
    monkeypatch.setattr(common, "load_policy", no_model_load)
    monkeypatch.setattr(common, "load_reference", no_model_load, raising=False)
    with pytest.raises(SystemExit) as stop:
        script.train(tiny_args(script, **{name: value}, output_dir=str(tmp_path)))
    assert f"--{name} {message}" in str(stop.value)
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------
# 8. The preflight settles on the most rows that fit


def affine(base: float, per_row: float, measured: list):
    def measure(run, rows):
        measured.append(rows)
        return base + per_row * rows

    return measure


@pytest.mark.parametrize("base, per_row", [(10.0, 10.0), (100.0, 3.0), (1.0, 50.0)])
@pytest.mark.parametrize("most_rows", [9, 64])
def test_preflight_settles_on_the_most_rows_that_fit(base, per_row, most_rows):
    # peak(rows) = base + per_row · rows; for every budget from peak(1) (1 row fits) to just under
    # peak(9) (9 rows do not), the most rows that fit are floor((budget − base) / per_row), and no
    # pass over the budget but the last, confirming one, is ever run past what fits.
    for budget in [base + per_row * (r + f) for r in range(1, 9) for f in (0.0, 0.5, 0.99)]:
        measured = []
        expected = int((budget - base) // per_row)  # 1 … 8
        assert preflight(None, most_rows, "--flags", budget, affine(base, per_row, measured), "pass") == expected
        assert all(rows <= 2 * expected for rows in measured), (budget, measured)


# ----------------------------------------------------------------------------------------
# 10. evaluate.py --reward_fn: told about truncation; its failures a share of completions

REWARD = '''
calls = []


def reward(completion, problem, truncated):
    """Fails on every second call; else 1 for a truncated completion, 0.5 for one that ended."""
    calls.append(truncated)
    if len(calls) % 2 == 0:
        raise RuntimeError("every second call")
    return 1.0 if truncated else 0.5
'''


def test_evaluate_reward_fn_is_told_truncation_and_fails_as_a_share(tmp_path):
    # digit, 2 problems × 2 samples = 4 completions of at most 1 token (truncated unless that token
    # is an EOS); calls 2 and 4 fail: reward_fn_failed 2/4 = 0.5; the others score 1 if truncated.
    (tmp_path / "my_reward.py").write_text(REWARD)
    args = evaluate.Args(
        model="tiny", benchmarks="digit", limit=2, num_samples=2, temperature=1.0, max_new_tokens=1,
        reward_fn=f"{tmp_path / 'my_reward.py'}:reward", output_dir=str(tmp_path / "out"),
    )  # fmt: skip
    run_dir = evaluate.main(args)
    result = json.loads((run_dir / "results.json").read_text())["results"]["digit"]
    assert result["reward_fn_failed"] == 0.5
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert len(samples) == 4 and sum(s["fn_failed"] for s in samples) == 2
    scored = [s for s in samples if not s["fn_failed"]]
    assert any(s["truncated"] for s in scored)
    assert all(s["reward"] == (1.0 if s["truncated"] else 0.5) for s in scored)
