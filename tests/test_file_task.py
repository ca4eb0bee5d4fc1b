"""Your own task (--task file) and your own reward (--reward_fn): rows from every file format,
every grader by hand, chat rows, the held-out rows, worked examples, the errors that stop a run
before a model loads, the failures of a user's reward that must not, one step of each script,
evaluate.py, and Countdown through a file equal to --task countdown."""

import csv
import dataclasses
import hashlib
import json
import shutil
import time

import pytest

import dapo
import evaluate
import grpo
import ppo
from common import read_jsonl
from conftest import ROOT
from rewards import (
    FileTaskSpec,
    generate_countdown,
    load_file_task,
    read_rows,
    training_task,
    with_reward_fn,
)

TASKS = ROOT / "tests" / "fixtures" / "tasks"
ARITHMETIC = TASKS / "arithmetic.jsonl"  # 40 rows {"question": "What is 43 + 21?", "answer": "64", "id": 0}
REWARDS = TASKS / "rewards_of_my_own.py"
SPEC = FileTaskSpec(str(ARITHMETIC), prompt_key="question", grader="number")


def arithmetic_rows() -> list[dict]:
    return [json.loads(line) for line in ARITHMETIC.read_text().splitlines()]


# ----------------------------------------------------------------------------------------
# Reading rows


def test_every_file_format_reads_the_same_rows(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = arithmetic_rows()
    (tmp_path / "list.json").write_text(json.dumps(rows))
    (tmp_path / "splits.json").write_text(json.dumps({"train": rows, "test": rows[:3]}))
    with (tmp_path / "rows.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "rows.parquet")
    assert read_rows(str(ARITHMETIC), "train") == rows
    assert read_rows(str(tmp_path / "list.json"), "train") == rows
    assert read_rows(str(tmp_path / "splits.json"), "test") == rows[:3]  # a JSON object: the split's list
    assert read_rows(str(tmp_path / "rows.parquet"), "train") == rows
    as_text = [{key: str(value) for key, value in row.items()} for row in rows]  # CSV holds text
    assert read_rows(str(tmp_path / "rows.csv"), "train") == as_text
    for name in ("list.json", "rows.csv", "rows.parquet"):  # the same problems, whatever the format
        task = load_file_task(dataclasses.replace(SPEC, data_file=str(tmp_path / name)), "train")
        assert [p["gold"] for p in task.problems] == [p["gold"] for p in load_file_task(SPEC, "train").problems]


def test_a_hub_id_goes_to_the_hub_with_its_config(monkeypatch):
    import rewards

    asked = []
    monkeypatch.setattr(rewards, "load_hub_rows", lambda *a, **k: asked.append(a) or arithmetic_rows())
    assert read_rows("owner/name:main", "validation") == arithmetic_rows()
    assert asked[0][:3] == ("owner/name", "main", "validation")


# ----------------------------------------------------------------------------------------
# Graders: right 1.0, well-formed but wrong 0.1, else 0, truncated 0


def grade(grader: str, completion: str, gold: str, truncated: bool = False, **row):
    spec = FileTaskSpec("x.jsonl", grader=grader)
    task_score = load_file_task.__globals__["FILE_GRADERS"][grader]
    problem = load_file_task.__globals__["file_problem"]({"prompt": "?", "answer": gold, **row}, spec, "row 1")
    score = task_score(completion, problem, truncated)
    return score.reward, score.correct


def test_every_grader_by_hand():
    # math: math-verify equivalence of the boxed answer (1/2 = 0.5)
    assert grade("math", "so \\boxed{\\frac{1}{2}}", "0.5") == (1.0, True)
    assert grade("math", "so \\boxed{3}", "0.5") == (0.1, False)
    assert grade("math", "no box: 0.5", "0.5") == (0.0, True)  # flexible grade right, reward needs the box
    # number: the boxed number equals the gold (GSM8K's training reward)
    assert grade("number", "The answer is \\boxed{1,234}.", "1234") == (1.0, True)
    assert grade("number", "\\boxed{12}", "1234") == (0.1, False)
    assert grade("number", "\\boxed{1234}", "1234", truncated=True) == (0.0, False)  # cut at the cap: nothing
    # choice: "The answer is (X)." with X a letter A-J; the gold may be written (c)
    assert grade("choice", "... The answer is (C).", "(c)") == (1.0, True)
    assert grade("choice", "... The answer is (B).", "C") == (0.1, False)
    # exact: the boxed text, normalised (case, spaces, surrounding punctuation)
    assert grade("exact", "I think \\boxed{ New  York. }", "new york") == (1.0, True)
    assert grade("exact", "\\boxed{Boston}", "new york") == (0.1, False)
    assert grade("exact", "The answer is New York", "new york") == (0.0, True)  # right, but not in the box
    assert grade("exact", "The answer is Boston.\nNo, the answer is New York", "new york") == (0.0, True)  # the last
    assert grade("exact", "\\boxed{Boston}, no: \\boxed{New York}", "new york") == (1.0, True)  # the last box
    # countdown: an equation over the row's numbers that reaches its target
    row = dict(nums="[3, 5, 7]", target="22")
    assert grade("countdown", "<think>x</think> <answer>3 * 5 + 7</answer>", "", **row) == (1.0, True)
    assert grade("countdown", "<think>x</think> <answer>3 + 5 + 7</answer>", "", **row) == (0.1, False)


def test_answers_a_grader_cannot_read_stop_with_how_many_and_the_first(tmp_path):
    rows = arithmetic_rows()
    rows[4]["answer"], rows[9]["answer"] = "sixty", "n/a"
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = dataclasses.replace(SPEC, data_file=str(path))
    with pytest.raises(SystemExit, match=r"number grader cannot read 2 of 40 answers; the first, row 5: 'sixty'"):
        load_file_task(spec, "train")
    with pytest.raises(SystemExit, match=r"choice grader cannot read 40 of 40 answers; the first, row 1: '64'"):
        load_file_task(dataclasses.replace(SPEC, grader="choice"), "train")


# ----------------------------------------------------------------------------------------
# Prompts, held-out rows, worked examples


def test_prompts_take_the_instruction_the_system_prompt_and_chat_rows_as_they_are(tmp_path):
    task = load_file_task(dataclasses.replace(SPEC, system_prompt="Be brief."), "train")
    problem = task.problems[0]
    assert task.messages(problem) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": problem["question"] + "\n\nSolve the problem step by step. Then write the "
         "final answer, a number only, in \\boxed{}."},
    ]  # fmt: skip
    plain = load_file_task(dataclasses.replace(SPEC, instruction=""), "train")
    assert plain.messages(problem) == [{"role": "user", "content": problem["question"]}]
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 2 + 2?"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"messages": chat, "answer": "4"}) + "\n" + json.dumps({"messages": chat, "answer": "5"})
    )
    task = load_file_task(FileTaskSpec(str(path), prompt_key="messages", grader="number", eval_data_file=""), "train")
    assert all(task.messages(p) == chat for p in task.problems)  # no instruction, no system prompt added


def test_held_out_rows_are_a_fixed_share_never_trained_on():
    train, heldout = load_file_task(SPEC, "train"), load_file_task(SPEC, "heldout")
    train_ids, heldout_ids = {p["id"] for p in train.problems}, {p["id"] for p in heldout.problems}
    assert train_ids.isdisjoint(heldout_ids) and train_ids | heldout_ids == set(range(40))
    assert 1 <= len(heldout_ids) <= 10  # 1 in 10 by a hash of the prompt: 4 expected of 40
    # The documented rule, from the rows themselves: the first 8 bytes of SHA-256 of the prompt as
    # JSON, big-endian, divisible by 10. Nothing else (no seed, no row order) decides it.
    by_rule = {
        row["id"]
        for row in arithmetic_rows()
        if int.from_bytes(hashlib.sha256(json.dumps(row["question"]).encode()).digest()[:8], "big") % 10 == 0
    }
    assert heldout_ids == by_rule


def test_an_eval_file_that_overlaps_the_training_rows_stops(tmp_path):
    rows = arithmetic_rows()
    overlapping, fresh = tmp_path / "overlap.jsonl", tmp_path / "fresh.jsonl"
    overlapping.write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    fresh.write_text(json.dumps({"question": "What is 1000 + 1?", "answer": "1001"}) + "\n")
    with pytest.raises(
        SystemExit, match=r"3 of its 3 problems are also in --data_file \(the first: \"What is 43 \+ 21\?\""
    ):
        load_file_task(dataclasses.replace(SPEC, eval_data_file=str(overlapping)), "heldout")
    spec = dataclasses.replace(SPEC, eval_data_file=str(fresh))
    assert [p["gold"] for p in load_file_task(spec, "heldout").problems] == ["1001"]
    assert len(load_file_task(spec, "train").problems) == 40  # with an eval file, every row trains


def test_countdown_worked_examples_are_the_strict_format_of_their_solution(tmp_path):
    path, unseen = tmp_path / "countdown.jsonl", tmp_path / "unseen.jsonl"
    rows = [
        {"nums": [3, 5, 7], "target": 22, "solution": "3 * 5 + 7"},
        {"nums": [2, 9], "target": 11, "solution": "2 + 9"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    unseen.write_text(json.dumps({"nums": [4, 4], "target": 16, "solution": "4 * 4"}) + "\n")
    task = load_file_task(FileTaskSpec(str(path), grader="countdown", eval_data_file=str(unseen)), "train", shots=1)
    turns = task.messages(task.problems[0])
    assert turns[2]["content"] == "<think> 3 * 5 + 7 = 22 </think> <answer> 3 * 5 + 7 </answer>"
    assert task.score(turns[2]["content"], {"nums": [3, 5, 7], "target": 22}).reward == 1.0  # it earns full reward
    path.write_text("".join(json.dumps({k: row[k] for k in ("nums", "target")}) + "\n" for row in rows))
    with pytest.raises(SystemExit, match="needs a 'solution' column"):
        load_file_task(FileTaskSpec(str(path), grader="countdown", eval_data_file=str(unseen)), "train", shots=1)


def test_worked_examples_come_from_the_training_rows_and_leave_them():
    plain, shot = load_file_task(SPEC, "train"), load_file_task(SPEC, "train", shots=2)
    assert shot.problems == plain.problems[2:]
    turns = shot.messages(shot.problems[0])
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant", "user"]
    assert turns[1]["content"] == f"The answer is \\boxed{{{plain.problems[0]['gold']}}}."


# ----------------------------------------------------------------------------------------
# Bad input stops before any model loads


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(data_file="nowhere.jsonl"), r"--data_file nowhere.jsonl: no such file"),
        (
            dict(prompt_key="prompt"),
            r"no column \['prompt'\] \(--prompt_key, --answer_key\); its columns are \['answer', 'id', 'question'\]",
        ),
        (dict(grader="fuzzy"), r"--grader 'fuzzy' is not one of: math, number, choice, exact, countdown"),
        (dict(data_file=""), r"--task file needs --data_file"),
    ],
    ids=["missing file", "unknown column", "unknown grader", "no file"],
)
def test_bad_input_stops_with_a_message(change, message):
    with pytest.raises(SystemExit, match=message):
        load_file_task(dataclasses.replace(SPEC, **change), "train")


GOOD = '{"question": "What is 1 + 1?", "answer": "2"}'


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "a.jsonl",
            f"{GOOD}\n{{'question': 'x'}}\n".encode(),
            r"a.jsonl, line 2: not valid JSON \(Expecting property name",
        ),
        ("a.json", f"[{GOOD},]".encode(), r"a.json: not valid JSON"),
        ("a.jsonl", f"{GOOD}\n".encode() + b'{"question": "\xff", "answer": "2"}', r"a.jsonl: not UTF-8 text"),
        ("a.csv", b"question,answer\n\xe9,2\n", r"a.csv: not UTF-8 text"),
        ("a.jsonl", f'{GOOD}\n{{"answer": "3"}}\n'.encode(), r"a.jsonl, row 2: no column \['question'\]"),
        (
            "a.jsonl",
            f'{GOOD}\n{{"question": null, "answer": "3"}}\n'.encode(),
            r"row 2: the prompt \('question'\) is None",
        ),
        ("a.jsonl", f'{GOOD}\n{{"question": ["hi"], "answer": "3"}}\n'.encode(), r"row 2: the prompt .* is \['hi'\]"),
    ],
    ids=["bad json line", "bad json", "not utf-8", "csv not utf-8", "later row's column", "null prompt", "bad chat"],
)
def test_a_data_file_s_bad_row_is_named_by_its_line(tmp_path, name, content, message):
    # Found while the task loads (before a model does), each named by its file and line or row.
    (tmp_path / name).write_bytes(content)
    with pytest.raises(SystemExit, match=message):
        load_file_task(dataclasses.replace(SPEC, data_file=str(tmp_path / name)), "train")


def test_a_byte_order_mark_is_read_past(tmp_path):
    # Windows editors start UTF-8 files with one: the first column's name would hold it.
    (tmp_path / "a.csv").write_bytes("\ufeffquestion,answer\nWhat is 1 + 1?,2\n".encode())
    (tmp_path / "a.jsonl").write_bytes(f"\ufeff{GOOD}\n".encode())
    for name in ("a.csv", "a.jsonl"):
        assert read_rows(str(tmp_path / name), "train") == [{"question": "What is 1 + 1?", "answer": "2"}]


def test_an_empty_file_and_a_data_file_without_task_file_stop(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match="holds no rows"):
        load_file_task(dataclasses.replace(SPEC, data_file=str(tmp_path / "empty.jsonl")), "train")
    with pytest.raises(SystemExit, match=r"--data_file: for --task file \(your own data\)"):
        training_task(grpo.Args(task="countdown", data_file=str(ARITHMETIC)))


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_module_here:f", r"does not import: ModuleNotFoundError"),
        (f"{REWARDS}:no_such_function", r"has no function 'no_such_function'"),
        ("just_a_name", r"write module:function or path/to/file.py:function"),
        (f"{REWARDS}:two_parameters", r"two_parameters\(completion, problem\) cannot be called as .*truncated"),
    ],
)
def test_a_reward_path_that_does_not_import_stops(path, message):
    with pytest.raises(SystemExit, match=message):
        with_reward_fn(load_file_task(SPEC, "train"), path, 1.0)


# ----------------------------------------------------------------------------------------
# The user's reward function: called with (completion, row, truncated); its failures score 0


def test_a_reward_function_gets_the_completion_the_row_and_truncation():
    task = with_reward_fn(load_file_task(SPEC, "train"), f"{REWARDS}:starts_with_answer", 1.0)
    problem = task.problems[0]
    gold = problem["gold"]
    assert (task.score(f"{gold} it is", problem, False).reward, task.score(f"{gold}", problem, False).correct) == (
        1.0,
        True,
    )
    assert task.score(f"it is {gold}", problem, False).reward == 0.1
    assert task.score(f"{gold}", problem, True).reward == 0.0  # truncated: the user's rule says 0
    flagged = with_reward_fn(load_file_task(SPEC, "train"), f"{REWARDS}:with_format_flag", 1.0)
    score = flagged.score("no digits", problem, False)
    assert (score.reward, score.formatted, score.correct, score.failed) == (0.5, False, False, False)


@pytest.mark.parametrize("name", ["raises", "not_a_number", "returns_text", "slow", "slow_and_catches_everything"])
def test_a_failing_reward_scores_zero_and_is_counted(name, capsys):
    # ... and the first failure is shown, once, with what went wrong: a run whose every reward is 0
    # for a bug in the function must not pass in silence.
    task = with_reward_fn(load_file_task(SPEC, "train"), f"{REWARDS}:{name}", 0.2)
    start = time.perf_counter()
    score = task.score("64", task.problems[0], False)
    assert (score.reward, score.correct, score.failed) == (0.0, False, True)
    assert time.perf_counter() - start < 2  # the slow ones sleep 5 s: stopped at 0.2, even inside `except Exception`
    task.score("64", task.problems[1], False)
    shown = capsys.readouterr().err
    assert shown.count(f"--reward_fn {REWARDS}:{name}: a call failed (") == 1, shown


def test_a_failing_reward_never_ends_the_run_and_is_in_the_metrics(tmp_path):
    args = grpo.Args(
        model="tiny", task="file", data_file=str(ARITHMETIC), prompt_key="question", grader="number",
        reward_fn=f"{REWARDS}:raises", batch_size=2, group_size=2, max_new_tokens=4, max_steps=2,
        save_every=0, sample_every=0, beta=0.0, output_dir=str(tmp_path),
    )  # fmt: skip
    rows = read_jsonl(grpo.train(args) / "metrics.jsonl")
    assert [row["reward/fn_failed"] for row in rows] == [1.0, 1.0] and [row["reward/mean"] for row in rows] == [0, 0]


# ----------------------------------------------------------------------------------------
# The scripts and evaluate.py on a file task


FILE_RUN = dict(
    model="tiny", task="file", data_file=str(ARITHMETIC), prompt_key="question", grader="number",
    batch_size=2, group_size=2, max_new_tokens=6, max_steps=1, save_every=0, sample_every=0, eval_every=1,
    eval_problems=2,
)  # fmt: skip


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=["grpo", "dapo", "ppo"])
def test_one_step_of_each_script_on_a_file_task(script, tmp_path):
    extra = dict(overlong_buffer=2) if script is dapo else {}
    run_dir = script.train(script.Args(output_dir=str(tmp_path), **FILE_RUN, **extra))
    [row] = read_jsonl(run_dir / "metrics.jsonl")
    assert (
        row["reward/fn_failed"] == 0 and "eval/accuracy" in row and run_dir.name.startswith(f"{script.__name__}-file-")
    )


def test_evaluate_on_a_file_task(tmp_path):
    args = evaluate.Args(
        model="tiny", benchmarks="file", data_file=str(ARITHMETIC), prompt_key="question", grader="number",
        max_new_tokens=6, output_dir=str(tmp_path),
    )  # fmt: skip
    results = json.loads((evaluate.main(args) / "results.json").read_text())["results"]["file"]
    assert results["n"] == len(load_file_task(SPEC, "heldout").problems)  # the held-out share, graded


@pytest.mark.parametrize("benchmarks", ["file", "digit"])
def test_evaluate_grades_with_the_reward_of_your_own(benchmarks, tmp_path, capfd):
    # --reward_fn as in training: a completion is correct when the function gives at least 1. The
    # tiny model answers none of these, so the task's grader would give 0; the reward gives 1 when
    # called in this process, as training calls it (the task's graders run in a worker process,
    # where a reward holding a model or using the GPU would fail every call), and 0 elsewhere.
    flags = dict(model="tiny", benchmarks=benchmarks, max_new_tokens=4, limit=4, output_dir=str(tmp_path))
    if benchmarks == "file":
        flags |= dict(data_file=str(ARITHMETIC), prompt_key="question", grader="number")
    right = evaluate.main(evaluate.Args(**flags, reward_fn=f"{REWARDS}:right_in_the_main_process"))
    saved = json.loads((right / "results.json").read_text())
    assert saved["reward_fn"] == f"{REWARDS}:right_in_the_main_process"
    assert (saved["results"][benchmarks]["accuracy"], saved["results"][benchmarks]["reward_fn_failed"]) == (1.0, 0.0)
    assert {(s["reward"], s["correct"]) for s in read_jsonl(right / "samples.jsonl")} == {(1.0, True)}
    plain = evaluate.main(evaluate.Args(**flags))  # the task's grader: nothing right, no reward_fn recorded
    saved = json.loads((plain / "results.json").read_text())
    assert saved["results"][benchmarks]["accuracy"] == 0.0 and "reward_fn" not in saved
    capfd.readouterr()
    two = "file,digit" if benchmarks == "file" else "digit"  # one import for every benchmark, one message
    failing = evaluate.main(evaluate.Args(**(flags | {"benchmarks": two}), reward_fn=f"{REWARDS}:raises"))
    result = json.loads((failing / "results.json").read_text())["results"][benchmarks]
    assert (result["accuracy"], result["reward_fn_failed"]) == (0.0, 1.0)
    shown = capfd.readouterr().err  # once, however many calls failed
    assert shown.count(f"--reward_fn {REWARDS}:raises: a call failed (RuntimeError: a bug in the user's reward)") == 1


def test_evaluate_stops_on_a_reward_that_cannot_be_called_before_the_model_loads(tmp_path):
    args = evaluate.Args(model="no/such-model", benchmarks="digit", reward_fn=f"{REWARDS}:two_parameters")
    with pytest.raises(SystemExit, match=r"two_parameters\(completion, problem\) cannot be called"):
        evaluate.main(args)


def test_countdown_from_a_file_trains_as_task_countdown(tmp_path):
    # The offline generator's first 24 problems written to a file and read back with the countdown
    # grader: the same problems in the same order, the same prompts and rewards, so a seed gives the
    # same metrics, step for step.
    path = tmp_path / "countdown.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in generate_countdown(24, 0, 3, 4)))
    common = dict(model="tiny", num_problems=24, batch_size=2, group_size=2, max_new_tokens=8, max_steps=2,
                  save_every=0, sample_every=0, beta=0.01, seed=0)  # fmt: skip
    builtin = grpo.train(grpo.Args(task="countdown", output_dir=str(tmp_path / "a"), **common))
    from_file = grpo.train(grpo.Args(task="file", data_file=str(path), grader="countdown",
                                     output_dir=str(tmp_path / "b"), **common))  # fmt: skip
    strip = lambda rows: [{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))} for row in rows]  # noqa: E731
    assert strip(read_jsonl(builtin / "metrics.jsonl")) == strip(read_jsonl(from_file / "metrics.jsonl"))
    shutil.rmtree(tmp_path / "a"), shutil.rmtree(tmp_path / "b")
