"""The Countdown verifier on correct, wrong, malformed and hostile answers; the generator;
the digit toy task; the GSM8K training reward (strict \\boxed{}, nothing when truncated); how
each training reward treats a completion cut at max_new_tokens."""

import signal
from contextlib import contextmanager

import pytest

from conftest import ROOT
from rewards import (
    COUNTDOWN_SHOTS_SEED,
    MAX_EXPRESSION_CHARS,
    REWARD_CORRECT,
    REWARD_FORMAT,
    REWARD_NONE,
    Score,
    countdown_messages,
    countdown_score,
    countdown_sizes,
    digit_score,
    extract_answer,
    generate_countdown,
    gsm8k_reward,
    gsm8k_score,
    is_heldout_countdown,
    load_benchmark,
    load_task,
)

GSM8K_DATA = ROOT / "tests" / "fixtures" / "data"  # the --data_dir layout, a few rows per file
PROBLEM = {"nums": [3, 5, 7, 11], "target": 51}  # 5 · 11 − 7 + 3 = 55 − 7 + 3 = 51


def wrap(answer: str) -> str:
    return f"<think> some reasoning </think> <answer> {answer} </answer>"


@contextmanager
def must_finish_within(seconds: int):
    """Fails the test instead of hanging it (the point of the hostile cases)."""

    def fail(*_):
        raise TimeoutError(f"the verifier took more than {seconds}s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    "answer, problem",
    [
        ("5 * 11 - 7 + 3", PROBLEM),
        ("(5 * 11) - (7 - 3)", PROBLEM),  # 55 − 4 = 51
        ("3+5*11-7", PROBLEM),  # no spaces, any order of the numbers
        ("9 * 6 / 2", {"nums": [2, 6, 9], "target": 27}),
        # 6 / (1 − 3/4) = 6 / (1/4) = 24 exactly; in floats 1 − 0.75 is exact too, but the
        # classic needs fractions in general, and Fraction makes it exact by construction.
        ("6 / (1 - 3 / 4)", {"nums": [1, 3, 4, 6], "target": 24}),
        ("7 * 7 - 1", {"nums": [7, 7, 1], "target": 48}),  # repeated numbers, each used once
    ],
)
def test_correct_answers(answer, problem):
    score = countdown_score(wrap(answer), problem)
    assert (score.reward, score.correct, score.formatted) == (REWARD_CORRECT, True, True)


@pytest.mark.parametrize(
    "answer",
    [
        "5 * 11 - 7 - 3",  # uses the right numbers, equals 45
        "5 * 11 - 7",  # 48, and 3 is unused
        "5 * 11 - 7 + 3 + 3",  # 3 used twice
        "5 * 11 - 8 + 4",  # = 51 but with numbers not given
        "(3 + 5) / (11 - 11) + 7",  # division by zero is simply wrong (and 11 twice)
        "3 / (11 - 11) * 5 * 7",  # division by zero
        "51",  # the target itself
    ],
)
def test_well_formed_but_wrong_answers(answer):
    score = countdown_score(wrap(answer), PROBLEM)
    assert (score.reward, score.correct, score.formatted) == (REWARD_FORMAT, False, True)


@pytest.mark.parametrize(
    "answer, problem",
    [
        # Each reaches the target, so only the count of each number can make it wrong: a verifier
        # comparing sets instead of multisets would pay all three in full (issue 42), and a policy
        # would learn to pad its answers or skip a repeated number.
        ("5 * 11 - 7 + 3 + 3 - 3", PROBLEM),  # 55 − 7 + 3 + 3 − 3 = 51, but 3 used three times
        ("7 + 1", {"nums": [7, 7, 1], "target": 8}),  # = 8, but one of the two 7s dropped
        ("7 * 7 - 1 + 1 - 1", {"nums": [7, 7, 1], "target": 48}),  # 49 − 1 + 1 − 1 = 48, 1 three times
    ],
)
def test_an_answer_that_reaches_the_target_with_a_number_reused_or_dropped_is_wrong(answer, problem):
    score = countdown_score(wrap(answer), problem)
    assert (score.reward, score.correct, score.formatted) == (REWARD_FORMAT, False, True)


def test_division_by_zero_with_the_right_numbers_is_wrong():
    score = countdown_score(wrap("3 / (5 - 5) + 7"), {"nums": [3, 5, 5, 7], "target": 10})
    assert (score.reward, score.correct) == (REWARD_FORMAT, False)


@pytest.mark.parametrize(
    "completion",
    [
        "5 * 11 - 7 + 3",  # no tags at all
        "<answer> 5 * 11 - 7 + 3 </answer>",  # no <think> block
        "<think> hmm </think>",  # no answer
        "<think> a </think> <answer> 1 </answer> <answer> 5 * 11 - 7 + 3 </answer>",  # two answers
        "<think> a </think> <answer> 5 * 11 - 7 + 3 </answer> and some chatter",  # text after
        "Sure! <think> a </think> <answer> 5 * 11 - 7 + 3 </answer>",  # text before
        "<think> a </think> so <answer> 5 * 11 - 7 + 3 </answer>",  # text between
        "<answer> 5 * 11 - 7 + 3 </answer> <think> a </think>",  # wrong order
        "<think> <answer> 5 * 11 - 7 + 3 </answer> </think>",  # nested
        "<think> a </think> <answer> 5 * 11 - 7 + 3 = 51 </answer>",  # '=' is not allowed
        "<think> a </think> <answer> </answer>",  # empty answer
        "<think> a </think> <answer> five times eleven </answer>",
    ],
)
def test_malformed_completions_get_nothing(completion):
    score = countdown_score(completion, PROBLEM)
    assert (score.reward, score.correct, score.formatted) == (REWARD_NONE, False, False)


HOSTILE = [
    "99**98**97**96",  # would hang a verifier that evaluates powers
    "3 ** 5",
    "3.5*2",  # '.' would glue 3 and 5 into 3.5
    "1e3",
    "0x33",
    "07 + 1",  # leading zero
    "1_0 + 41",
    "-3 + 54",  # unary minus is not in the game
    "+51",
    "abs(-51)",
    "__import__('os').system('echo pwned')",
    "[51][0]",
    "lambda: 51",
    "True + 50",
    "5 // 1 + 46",
    "55 % 4 + 48",
    "9" * 90,  # a huge literal (within the length bound)
    "٣ + ٤٨",  # Arabic-Indic digits: Python's int() would accept them
    "５１",  # fullwidth digits
    "(" * 1000 + "51" + ")" * 1000,  # deep nesting, far beyond the length bound
    "(" * 45 + "5 * 11 - 7 + 3" + ")" * 45,  # deep but within the length bound
    "1+" * 5000 + "1",  # 10k characters
    "3 5 7 11",
    "5 * 11\n- 7 + 3",  # a newline inside the expression
]


@pytest.mark.parametrize("answer", HOSTILE)
def test_hostile_answers_are_rejected_quickly(answer):
    with must_finish_within(2):
        score = countdown_score(wrap(answer), PROBLEM)
    assert not score.correct
    assert score.reward in (REWARD_NONE, REWARD_FORMAT)


def test_hostile_whole_completions():
    cases = [
        "<think>" + "x" * 10_000 + "</think> <answer> 5 * 11 - 7 + 3 </answer>",  # long but valid
        "<think>" * 5000 + "</think>" * 5000,  # 75k characters of tags
        "<answer>" * 10_000,
        "\x00" * 10_000,
    ]
    with must_finish_within(2):
        scores = [countdown_score(c, PROBLEM) for c in cases]
    assert [s.reward for s in scores] == [REWARD_CORRECT, REWARD_NONE, REWARD_NONE, REWARD_NONE]


def test_answer_length_bound_is_what_the_docstring_says():
    within = "(" * 20 + "5 * 11 - 7 + 3" + ")" * 20
    assert len(within) <= MAX_EXPRESSION_CHARS
    assert countdown_score(wrap(within), PROBLEM).correct
    beyond = "5 * 11 - 7 + 3" + " " * MAX_EXPRESSION_CHARS
    assert extract_answer(wrap(beyond)) is not None  # the tags are fine, the answer is too long
    assert countdown_score("<think> a </think><answer>" + beyond + "1</answer>", PROBLEM).reward == REWARD_NONE


def test_generator_problems_all_verify_with_their_witness():
    problems = generate_countdown(2000, seed=123)
    assert len(problems) == 2000
    for problem in problems:
        assert 3 <= len(problem["nums"]) <= 4
        assert all(1 <= n <= 99 for n in problem["nums"])
        assert 1 <= problem["target"] <= 100
        assert countdown_score(wrap(problem["solution"]), problem).correct, problem
    assert {len(p["nums"]) for p in problems} == {3, 4}


def test_generator_is_reproducible_and_seed_dependent():
    assert generate_countdown(50, seed=7) == generate_countdown(50, seed=7)
    assert generate_countdown(50, seed=7) != generate_countdown(50, seed=8)


def test_load_task_countdown_offline_and_unknown_task():
    task = load_task("countdown", seed=1, num_problems=10)
    assert len(task.problems) == 10
    messages = task.messages(task.problems[0])
    assert messages[-1]["role"] == "user"
    assert str(task.problems[0]["target"]) in messages[-1]["content"]
    assert "<answer>" in messages[-1]["content"] and "<think>" in messages[-1]["content"]
    with pytest.raises(SystemExit, match="not one of"):
        load_task("chess")


def test_hub_dataset_unreachable_gives_a_clear_error():
    # Tests run with HF_DATASETS_OFFLINE=1 (conftest), as a machine without internet would.
    # the message of rewards.load_hub_rows, which every Hub loader shares, with Countdown's hint
    with pytest.raises(
        SystemExit,
        match=r"(?s)Could not load 'Jiayi-Pan/Countdown-Tasks-3to4' \(config None, split 'train'\).*drop --dataset",
    ):
        load_task("countdown", dataset="Jiayi-Pan/Countdown-Tasks-3to4")


def test_digit_task():
    assert digit_score("7 is my answer", {}).reward == REWARD_CORRECT
    assert digit_score(" 7", {}).reward == REWARD_NONE  # the first character must be the digit
    assert digit_score("", {}).reward == REWARD_NONE
    assert digit_score("٣", {}).reward == REWARD_NONE  # ASCII digits only


def test_dataset_loader_reads_the_public_layout(tmp_path):
    # Jiayi-Pan/Countdown-Tasks-3to4 has columns `target` and `nums`; datasets.load_dataset
    # reads a local directory of JSON lines through the same call as a Hub id.
    rows = ['{"target": 51, "nums": [3, 5, 7, 11]}', '{"target": 24, "nums": [1, 3, 4, 6]}']
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    task = load_task("countdown", dataset=str(tmp_path))
    assert task.problems == [{"nums": [3, 5, 7, 11], "target": 51}, {"nums": [1, 3, 4, 6], "target": 24}]
    assert countdown_score(wrap("5 * 11 - 7 + 3"), task.problems[0]).correct


def test_dataset_loader_names_missing_columns(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"goal": 51, "nums": [3, 5, 7, 11]}\n')
    with pytest.raises(SystemExit, match=r"lacks the column\(s\) \['target'\]"):
        load_task("countdown", dataset=str(tmp_path))


# ----------------------------------------------------------------------------------------
# Truncation: `truncated` (the completion hit max_new_tokens without an EOS) and the rewards


@pytest.mark.parametrize(
    "completion",
    [
        wrap("5 * 11 - 7 + 3"),  # correct: a completion cut right after </answer> keeps its 1.0
        wrap("5 * 11 - 7 - 3"),  # well-formed, wrong
        "<think> a </think> <answer> 5 * 11 - 7",  # cut inside the answer
        "<think> reasoning that goes on and on",  # cut inside the reasoning
    ],
)
def test_countdown_reward_ignores_truncation(completion):
    assert countdown_score(completion, PROBLEM, truncated=True) == countdown_score(completion, PROBLEM)


def test_countdown_format_already_gives_nothing_to_a_completion_cut_before_its_end():
    # Why countdown_score may ignore `truncated`: every proper prefix of a correct completion
    # (wherever max_new_tokens could cut it) fails the strict format and gets nothing.
    full = wrap("5 * 11 - 7 + 3")
    assert countdown_score(full, PROBLEM).reward == REWARD_CORRECT
    rewards = {countdown_score(full[:cut], PROBLEM, truncated=True).reward for cut in range(len(full))}
    assert rewards == {REWARD_NONE}


def test_digit_reward_ignores_truncation():
    for text in ("7", "7 7 7 7", "x"):
        assert digit_score(text, {}, truncated=True) == digit_score(text, {})


def test_score_strict_defaults_to_correct():
    # a task with one answer format leaves `strict` out: it is the same grade as `correct`
    assert Score(REWARD_CORRECT, correct=True, formatted=True).strict is True
    assert Score(REWARD_NONE, correct=False, formatted=False).strict is False
    assert countdown_score(wrap("5 * 11 - 7 + 3"), PROBLEM).strict is True
    assert digit_score("x", {}).strict is False


# The junk of the issue: a repetition loop cut at max_new_tokens, whose last number (20) is the
# gold. The only 1.0 in a 10-step real-model run on GSM8K went to a completion like this.
LOOP = (
    "Let's count the chickens.\n"
    + "".join(f"{i}. 20 chickens = 20 * 1\n" for i in range(1, 13))
    + "13. 20 chickens = 20 *"
)


def test_gsm8k_reward_gives_nothing_to_a_truncated_repetition_loop():
    problem = {"gold": "20"}
    flexible = gsm8k_score(LOOP, problem, truncated=True)  # the evaluation's flexible grade reads it as right
    assert (flexible.correct, flexible.strict, flexible.extracted) == (True, False, "20")
    for truncated in (True, False):  # no \\boxed{}: nothing, cut or not
        reward = gsm8k_reward(LOOP, problem, truncated=truncated)
        assert (reward.reward, reward.correct, reward.strict, reward.formatted) == (REWARD_NONE, False, False, False)
    assert flexible.reward == REWARD_NONE  # the benchmark grader's reward is the training reward


@pytest.mark.parametrize(
    "completion, truncated, expected",
    [
        # (reward, correct, formatted, extracted); strict is always correct here
        ("2 * 9 = 18, so \\boxed{18}", False, (REWARD_CORRECT, True, True, "18")),
        ("\\boxed{18.00}", False, (REWARD_CORRECT, True, True, "18.00")),  # exact numeric equality
        ("\\boxed{17}, no: \\boxed{18}", False, (REWARD_CORRECT, True, True, "18")),  # the last box
        ("\\boxed{19}", False, (REWARD_FORMAT, False, True, "19")),  # boxed, wrong
        ("\\boxed{18} is wrong, it is \\boxed{19}", False, (REWARD_FORMAT, False, True, "19")),
        ("\\boxed{x}", False, (REWARD_NONE, False, False, None)),  # a box without a number
        ("2 * 9 = 18", False, (REWARD_NONE, False, False, None)),  # right number, not boxed
        ("The answer is 18.", False, (REWARD_NONE, False, False, None)),  # the evaluation's fallback
        # cut at max_new_tokens: nothing, even with the right answer boxed before the cut
        ("2 * 9 = 18, so \\boxed{18} and then 18 18 18 18", True, (REWARD_NONE, False, False, "18")),
        ("\\boxed{19} 19 19", True, (REWARD_NONE, False, False, "19")),
    ],
)
def test_gsm8k_reward_reads_the_box_only_and_nothing_when_truncated(completion, truncated, expected):
    score = gsm8k_reward(completion, {"gold": "18"}, truncated=truncated)
    assert (score.reward, score.correct, score.formatted, score.extracted) == expected
    assert score.strict == score.correct


def test_gsm8k_training_task_uses_the_strict_reward():
    task = load_task("gsm8k", data_dir=str(GSM8K_DATA))
    problem = task.problems[0]  # gold 72
    assert task.score is gsm8k_reward
    assert task.score("48 + 24 = \\boxed{72}", problem).reward == REWARD_CORRECT
    assert task.score("48 + 24 = \\boxed{72}", problem, truncated=True).reward == REWARD_NONE
    assert task.score("48 + 24 = 72", problem, False).reward == REWARD_NONE  # positional truncated works too


def test_countdown_problem_sizes():
    assert countdown_sizes("2") == (2, 2) and countdown_sizes("3-4") == (3, 4)
    for bad in ("1", "7", "4-3", "two", "2-"):
        with pytest.raises(SystemExit, match="--countdown_numbers"):
            countdown_sizes(bad)
    task = load_task("countdown", seed=0, num_problems=50, countdown_numbers="2")
    assert {len(p["nums"]) for p in task.problems} == {2}
    assert all(countdown_score(f"<think></think><answer>{p['solution']}</answer>", p).correct for p in task.problems)
    heldout = load_benchmark("countdown", countdown_problems=20, countdown_numbers="2-3")
    assert {len(p["nums"]) for p in heldout.problems} == {2, 3}
    assert all(is_heldout_countdown(p["nums"], p["target"]) for p in heldout.problems)
    # the default is the seed study's problems, as before the option existed
    assert load_task("countdown", seed=0, num_problems=20).problems == generate_countdown(20, 0)


def test_worked_examples_are_earlier_turns_in_the_asked_format():
    task = load_task("countdown", seed=0, num_problems=3, shots=2, countdown_numbers="2")
    messages = task.messages(task.problems[0])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[-1] == countdown_messages(task.problems[0])[-1]
    examples = [m["content"] for m in messages if m["role"] == "assistant"]
    for example, answer in zip(generate_countdown(2, COUNTDOWN_SHOTS_SEED, 2, 2), examples):
        assert countdown_score(answer, example).reward == 1.0  # each example earns the full reward
    assert not any(is_heldout_countdown(m["nums"], m["target"]) for m in generate_countdown(2, COUNTDOWN_SHOTS_SEED))
    gsm8k = load_task("gsm8k", data_dir=str(ROOT / "tests/fixtures/data"), shots=1)
    turns = gsm8k.messages(gsm8k.problems[1])
    assert [m["role"] for m in turns] == ["user", "assistant", "user"]
    assert "<<" not in turns[1]["content"] and turns[1]["content"].endswith("The answer is \\boxed{72}.")
    assert gsm8k_reward(turns[1]["content"], gsm8k.problems[0]).reward == 1.0
