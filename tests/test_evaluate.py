"""evaluate.py: its statistics by hand, the grading worker's deadline, an offline end-to-end
run of the tiny model over fixture rows of every benchmark, the strict and flexible accuracies
of scripted answers, --compare and --plot."""

import functools
import json
import time
from types import SimpleNamespace

import pytest
import torch

import evaluate
import grpo
from common import load_model, parse_args, read_jsonl
from conftest import ROOT
from evaluate import (
    PLOT_PANELS,
    Args,
    Grader,
    check_args,
    compare_table,
    limit_problems,
    main,
    pass_at_k,
    plot_curves,
    plot_panels,
    results_table,
    summarize,
    wilson_interval,
)
from rewards import BENCHMARKS, REWARD_NONE, Score, gsm8k_score, load_gsm8k, math500_score

DATA = ROOT / "tests" / "fixtures" / "data"


def test_wilson_interval_by_hand():
    # z = 1.96, p = 0.5, n = 100: z²/n = 0.038415, center = (0.5 + 0.019207) / 1.038415 = 0.5,
    # half = 1.96 · sqrt(0.0025 + 3.8415/40000) / 1.038415 = 1.96 · 0.050951 / 1.038415 = 0.096170.
    low, high = wilson_interval(0.5, 100)
    assert low == pytest.approx(0.403830, abs=1e-5) and high == pytest.approx(0.596170, abs=1e-5)
    # p = 0, n = 10: center = 0.19207 / 1.38415 = 0.138764 = half, so the interval is [0, 0.277529].
    low, high = wilson_interval(0.0, 10)
    assert low == 0.0 and high == pytest.approx(0.277529, abs=1e-5)


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 − C(3,2)/C(4,2) = 1 − 3/6
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # k = 1 is c/n: 1 − 3/5
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # only one wrong sample: any 2 include a correct one


def test_summarize_by_hand():
    correct = [[True, False, False, False], [True, True, True, True], [False, False, False, False]]
    strict = [[False, False, False, False], [True, True, False, False], [False, False, False, False]]
    result = summarize(correct, strict, ["a", "a", "b"])
    # per problem 1/4, 1, 0 -> accuracy 5/12; pass@2 = (1 − C(3,2)/C(4,2) + 1 + 0) / 3 = 0.5;
    # pass@4 = (1 + 1 + 0) / 3; subset a = (0.25 + 1) / 2, b = 0, their mean 0.3125.
    assert result["accuracy"] == pytest.approx(5 / 12) and result["n"] == 3 and result["num_samples"] == 4
    assert result["pass@1"] == pytest.approx(5 / 12)
    assert result["pass@2"] == pytest.approx(0.5)
    assert result["pass@4"] == pytest.approx(2 / 3)
    # strict per problem 0, 1/2, 0 -> 1/6, its Wilson interval over the 3 problems;
    # subset a = (0 + 0.5) / 2, b = 0, their mean 0.125
    assert result["strict_accuracy"] == pytest.approx(1 / 6)
    assert result["strict_ci95"] == pytest.approx(wilson_interval(1 / 6, 3))
    assert result["ci95"] == pytest.approx(wilson_interval(5 / 12, 3))
    assert result["subsets"] == {
        "a": {"accuracy": 0.625, "strict_accuracy": 0.25, "n": 2},
        "b": {"accuracy": 0.0, "strict_accuracy": 0.0, "n": 1},
    }
    assert result["subset_mean"] == pytest.approx(0.3125)
    assert result["strict_subset_mean"] == pytest.approx(0.125)
    assert "subsets" not in summarize([[True], [False]], [[True], [False]], ["", ""])


def test_limit_spreads_over_subsets():
    problems = [{"id": i, "subset": s} for i, s in enumerate("aaabcc")]
    assert [p["id"] for p in limit_problems(problems, 4)] == [0, 3, 4, 1]  # a, b, c, then a again
    assert limit_problems(problems, 0) == problems and limit_problems(problems, 10) == problems
    plain = [{"id": i, "subset": ""} for i in range(5)]
    assert [p["id"] for p in limit_problems(plain, 2)] == [0, 1]


def test_bad_arguments_stop_with_a_message():
    with pytest.raises(SystemExit) as error:
        check_args(Args(benchmarks="gsm8k,mmlu,gsm8k", num_samples=4, temperature=0.0, batch_size=0))
    message = str(error.value)
    assert "'mmlu' is not one of" in message and "names a benchmark twice" in message
    assert "--num_samples > 1 needs --temperature > 0" in message and "--batch_size must be at least 1" in message
    # Settings a benchmark list would leave unused: said, not recorded in args.json as if they ran.
    with pytest.raises(SystemExit, match="--data_file and --eval_data_file are for --benchmarks file"):
        check_args(Args(benchmarks="countdown", data_file="rows.jsonl"))
    with pytest.raises(SystemExit, match="takes its examples from --data_file's rows"):
        check_args(Args(benchmarks="file", eval_data_file="rows.jsonl", shots=1))
    # SIGALRM's seconds: an infinite one cannot be set, and every reward call would fail (wrong)
    for name, value in (
        ("reward_fn_timeout", float("inf")),
        ("tool_timeout", float("inf")),
        ("reward_fn_timeout", 0.0),
    ):
        with pytest.raises(SystemExit, match=f"--{name} must be a finite number of seconds > 0 \\(got {value}\\)"):
            check_args(Args(benchmarks="digit", **{name: value}))
    # --tool_workers at its boundary: 1 runs, 0 stops before a model loads (not in ThreadPoolExecutor after)
    check_args(Args(benchmarks="digit", tool_workers=1))
    with pytest.raises(SystemExit, match="--tool_workers must be at least 1 \\(got 0\\)"):
        check_args(Args(benchmarks="digit", tool_workers=0))


def test_grader_kills_a_hung_grading_and_keeps_going():
    # 10^(10^(10^10)) is computed inside C: math-verify's alarm cannot interrupt it. The
    # worker is killed after the 2 s deadline, the answer counts as wrong, and the next
    # completion is graded by a fresh worker.
    grader = Grader(timeout_s=2)
    try:
        start = time.perf_counter()
        hung = grader.score(math500_score, "\\boxed{10^{10^{10^{10}}}-1}", {"gold": "3"})
        assert time.perf_counter() - start < 15
        assert (hung.correct, hung.strict, grader.timeouts) == (False, False, 1)
        grader.timeout_s = 60  # the rest is about grades, not the deadline: a loaded machine took over 2 s
        assert grader.score(gsm8k_score, "\\boxed{18}", {"gold": "18"}).correct
        assert grader.score(math500_score, "\\boxed{0.5}", {"gold": "\\frac12"}).correct
        # the truncation flag reaches the grader: the grades stand, the training reward goes
        cut = grader.score(gsm8k_score, "\\boxed{18} 18 18", {"gold": "18"}, truncated=True)
        assert (cut.correct, cut.strict, cut.reward) == (True, True, REWARD_NONE)
    finally:
        grader.close()


def test_offline_end_to_end_on_every_benchmark(tmp_path, capsys):
    argv = ["--model", "tiny", "--data_dir", str(DATA), "--limit", "2", "--max_new_tokens", "4"]
    run_dir = main(parse_args(Args, argv + ["--batch_size", "3", "--output_dir", str(tmp_path)]))
    assert run_dir.name.startswith("eval-gsm8k+math500+bbh+mmlu_pro+countdown-tiny-")
    content = json.loads((run_dir / "results.json").read_text())
    assert content["model"] == "tiny" and content["max_new_tokens"] == 4 and content["temperature"] == 0.0
    results = content["results"]
    assert list(results) == ["gsm8k", "math500", "bbh", "mmlu_pro", "countdown"]
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert len(samples) == 2 * len(BENCHMARKS)
    for name, result in results.items():
        rows = [s for s in samples if s["benchmark"] == name]
        assert result["n"] == 2 and len(rows) == 2
        # the summary is computed from the same completions that samples.jsonl records
        assert result["accuracy"] == sum(r["correct"] for r in rows) / 2
        assert result["strict_accuracy"] == sum(r["strict"] for r in rows) / 2 <= result["accuracy"]
        assert all(r["correct"] or not r["strict"] for r in rows)  # strict implies correct
        assert result["mean_length"] == sum(r["length"] for r in rows) / 2 <= 4
        assert result["truncated"] == sum(r["truncated"] for r in rows) / 2
        low, high = result["ci95"]
        assert 0 <= low <= result["accuracy"] <= high <= 1
        low, high = result["strict_ci95"]
        assert 0 <= low <= result["strict_accuracy"] <= high <= 1
        assert result["seconds"] > 0 and result["grade_timeouts"] == 0
        for row in rows:
            assert set(row) >= {"prompt", "output", "extracted", "gold", "correct", "strict"}
            assert row["prompt"].startswith("<|im_start|>") and row["prompt"].endswith("<|im_start|>assistant\n")
    # --limit 2 takes one problem from each of the first two BBH tasks / MMLU-Pro categories
    assert set(results["bbh"]["subsets"]) == {"boolean_expressions", "causal_judgement"}
    assert set(results["mmlu_pro"]["subsets"]) == {"biology", "business"}
    assert [s["gold"] for s in samples if s["benchmark"] == "gsm8k"] in (["18", "3"], ["3", "18"])
    assert "\\boxed{}" in next(s["prompt"] for s in samples if s["benchmark"] == "math500")
    table = (run_dir / "table.md").read_text()
    printed = capsys.readouterr().out
    assert table.strip() in printed
    assert table.startswith(
        "| benchmark | accuracy % | 95% CI | strict % | strict 95% CI | n | mean length | truncated % | seconds |"
    )
    for name in BENCHMARKS:
        assert f"\n| {name} | " in table
    assert "| bbh subset | accuracy % | strict % | n |" in table and "| boolean_expressions | " in table
    assert set(results["bbh"]["subsets"]["boolean_expressions"]) == {"accuracy", "strict_accuracy", "n"}
    assert "strict_subset_mean" in results["bbh"] and "strict_subset_mean" in results["mmlu_pro"]


class AnsweringModel(torch.nn.Module):
    """Stands in for a causal LM that knows the questions and writes answers[question][sample]
    token by token, then EOS. generate prefills each distinct prompt once (one row per
    question) and samples every completion's first token from that one row's logits, so the
    samples of a question must share their first token; the model then sees all N rows, the
    samples of a question in consecutive rows, and writes each row its own answer."""

    def __init__(self, tokenizer, eos_id, answers):
        super().__init__()
        self.tokenizer, self.eos_id, self.answers = tokenizer, eos_id, answers
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the model a device

    def encode(self, question: str, sample: int) -> list[int]:
        return self.tokenizer.encode(self.answers[question][sample], add_special_tokens=False) + [self.eos_id]

    def forward(self, input_ids, attention_mask, **kwargs):
        rows = input_ids.shape[0]
        if input_ids.shape[1] > 1:  # the prefill: one row per distinct prompt
            prompts = [
                self.tokenizer.decode(ids[mask[0, -1, : len(ids)] == 0]) for ids, mask in zip(input_ids, attention_mask)
            ]
            self.questions = [next(q for q in self.answers if q in prompt) for prompt in prompts]
            self.script, self.step = [self.encode(q, 0)[:1] for q in self.questions], 0
        elif self.step == 0:  # the first token step: N rows, G samples of each question in a row
            samples = rows // len(self.questions)
            scripts = [self.encode(self.questions[r // samples], r % samples) for r in range(rows)]
            width = max(len(script) for script in scripts)
            self.script, self.step = [s + [self.eos_id] * (width - len(s)) for s in scripts], 1
        logits = torch.full((rows, 1, len(self.tokenizer)), -30.0)
        logits[torch.arange(rows), 0, torch.tensor(self.script)[:, min(self.step, len(self.script[0]) - 1)]] = (
            10.0  # sampling at t = 1 picks it
        )
        self.step += input_ids.shape[1] == 1  # generate checks for EOS every few tokens: EOS until then
        return SimpleNamespace(logits=logits)


def test_end_to_end_grades_each_completion_against_its_own_problem(tmp_path, monkeypatch):
    # GSM8K's 3 fixture problems (golds 18, 3, 70000), 2 samples each, 2 problems per batch,
    # so the longest-first order splits them over two batches of 4 and 2 rows. The model
    # answers problem 0 right twice (the second time without \\boxed{}), problem 1 right then
    # wrong, problem 2 wrong twice, each wrong answer another problem's gold: a completion
    # graded against the wrong problem changes the outcome. By hand: per problem 2/2, 1/2, 0/2
    # -> accuracy (1 + 0.5 + 0) / 3 = 0.5 = pass@1; pass@2 = (1 + 1 + 0) / 3 (1 − C(1,2)/C(2,2)
    # = 1 for problem 1); strict (boxed answers only) per problem 1/2, 1/2, 0/2 -> 1/3.
    _, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    problems = load_gsm8k("test", str(DATA))
    assert [p["gold"] for p in problems] == ["18", "3", "70000"]
    answers = {
        problems[0]["question"]: ["So \\boxed{18}.", "So 9 * 2 = 18"],  # a question's samples share a first token
        problems[1]["question"]: ["\\boxed{3}", "\\boxed{70000}"],
        problems[2]["question"]: ["So \\boxed{18}", "So the answer is 3"],
    }
    model = AnsweringModel(tokenizer, eos_ids[0], answers)
    monkeypatch.setattr(evaluate, "load_model", lambda *args, **kwargs: (model, tokenizer, eos_ids))
    # The scripted model knows a row by its place in the batch: finished rows must not leave it.
    monkeypatch.setattr(evaluate, "generate", functools.partial(grpo.generate, compact_below=0.0))
    argv = f"--model scripted --benchmarks gsm8k --data_dir {DATA} --batch_size 2 --num_samples 2"
    run_dir = main(parse_args(Args, argv.split() + ["--temperature", "1.0", "--output_dir", str(tmp_path)]))
    samples = read_jsonl(run_dir / "samples.jsonl")
    graded = {(s["index"], s["sample"]): (s["gold"], s["extracted"], s["correct"], s["strict"]) for s in samples}
    assert graded == {
        (0, 0): ("18", "18", True, True),
        (0, 1): ("18", "18", True, False),  # right, but not in \\boxed{}
        (1, 0): ("3", "3", True, True),
        (1, 1): ("3", "70000", False, False),
        (2, 0): ("70000", "18", False, False),
        (2, 1): ("70000", "3", False, False),
    }
    for s in samples:  # each record's prompt and output belong together
        assert s["output"] in answers[problems[s["index"]]["question"]] and s["truncated"] is False
        assert problems[s["index"]]["question"] in s["prompt"]
    result = json.loads((run_dir / "results.json").read_text())["results"]["gsm8k"]
    assert (result["n"], result["num_samples"]) == (3, 2)
    assert result["accuracy"] == pytest.approx(0.5) and result["pass@1"] == pytest.approx(0.5)
    assert result["pass@2"] == pytest.approx(2 / 3)
    assert result["strict_accuracy"] == pytest.approx(1 / 3)
    assert result["formatted"] == pytest.approx(4 / 6)  # all boxed but 'So 9 * 2 = 18' and 'So the answer is 3'
    assert result["truncated"] == 0.0


def report_truncation(completion: str, problem: dict, truncated: bool = False) -> Score:
    """A scorer that writes the truncation flag it was given where samples.jsonl shows it."""
    return Score(REWARD_NONE, correct=False, formatted=False, extracted=f"truncated={truncated}")


def test_each_completion_is_graded_with_its_own_truncation_flag(tmp_path, monkeypatch):
    # Problem 0's answer is cut at the 12-token cap after its right \\boxed{18}; the others end.
    # Graded by GSM8K's grader, the cut one stays correct and strict (the grades ignore the cut;
    # samples.jsonl and results.json report it); a scorer echoing its flag shows that each
    # completion reached the grader with its own.
    _, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    problems = load_gsm8k("test", str(DATA))
    answers = {
        problems[0]["question"]: ["\\boxed{18}" + " and 18" * 20],
        problems[1]["question"]: ["\\boxed{3}"],
        problems[2]["question"]: ["\\boxed{1}"],
    }
    model = AnsweringModel(tokenizer, eos_ids[0], answers)
    monkeypatch.setattr(evaluate, "load_model", lambda *args, **kwargs: (model, tokenizer, eos_ids))
    # The scripted model knows a row by its place in the batch: finished rows must not leave it.
    monkeypatch.setattr(evaluate, "generate", functools.partial(grpo.generate, compact_below=0.0))
    argv = f"--model scripted --benchmarks gsm8k --data_dir {DATA} --max_new_tokens 12".split()
    samples = read_jsonl(main(parse_args(Args, argv + ["--output_dir", str(tmp_path / "a")])) / "samples.jsonl")
    graded = {s["index"]: (s["truncated"], s["correct"], s["strict"]) for s in samples}
    assert graded == {0: (True, True, True), 1: (False, True, True), 2: (False, False, False)}
    task = evaluate.load_benchmark("gsm8k", str(DATA))
    task.score = report_truncation
    monkeypatch.setattr(evaluate, "load_benchmark", lambda *args, **kwargs: task)
    samples = read_jsonl(main(parse_args(Args, argv + ["--output_dir", str(tmp_path / "b")])) / "samples.jsonl")
    assert sorted((s["index"], s["extracted"]) for s in samples) == [
        (0, "truncated=True"),
        (1, "truncated=False"),
        (2, "truncated=False"),
    ]


def test_each_prompt_goes_through_the_chat_template_once(tmp_path, monkeypatch):
    # 3 problems: 3 calls, in grpo.encode_prompts (samples.jsonl decodes the ids the model saw), not 6.
    _, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    answers = {p["question"]: ["\\boxed{1}"] for p in load_gsm8k("test", str(DATA))}
    model = AnsweringModel(tokenizer, eos_ids[0], answers)
    monkeypatch.setattr(evaluate, "load_model", lambda *args, **kwargs: (model, tokenizer, eos_ids))
    # The scripted model knows a row by its place in the batch: finished rows must not leave it.
    monkeypatch.setattr(evaluate, "generate", functools.partial(grpo.generate, compact_below=0.0))
    calls, template = [], tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **kw: calls.append(a) or template(*a, **kw))
    argv = f"--model scripted --benchmarks gsm8k --data_dir {DATA} --batch_size 2 --output_dir {tmp_path}"
    run_dir = main(parse_args(Args, argv.split()))
    assert len(calls) == 3
    assert json.loads((run_dir / "results.json").read_text())["results"]["gsm8k"]["n"] == 3


def test_sampling_reports_pass_at_k(tmp_path):
    argv = "--model tiny --benchmarks countdown --countdown_problems 3 --max_new_tokens 3 --num_samples 2"
    run_dir = main(parse_args(Args, argv.split() + ["--temperature", "1.0", "--output_dir", str(tmp_path)]))
    result = json.loads((run_dir / "results.json").read_text())["results"]["countdown"]
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert result["num_samples"] == 2 and len(samples) == 6
    assert sorted((s["index"], s["sample"]) for s in samples) == [(i, k) for i in range(3) for k in range(2)]
    assert "pass@1" in result and "pass@2" in result
    table = (run_dir / "table.md").read_text()
    assert table.startswith("| benchmark | accuracy % | 95% CI | strict % | strict 95% CI | n | pass@1 | pass@2 |")


def write_results(path, results):
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({"model": path.name, "results": results}))


def test_compare_joins_runs_into_one_table(tmp_path):
    write_results(
        tmp_path / "eval-base",
        {
            "gsm8k": {"accuracy": 0.5, "ci95": [0.4, 0.6], "n": 100},
            "math500": {"accuracy": 0.25, "ci95": [0.2, 0.3], "n": 500},
        },
    )
    write_results(tmp_path / "eval-grpo", {"gsm8k": {"accuracy": 0.625, "ci95": [0.6, 0.65], "n": 100}})
    table = compare_table([str(tmp_path / "eval-base"), str(tmp_path / "eval-grpo" / "results.json")])
    assert table.splitlines() == [
        "| benchmark | eval-base | eval-grpo |",
        "|---|---|---|",
        "| gsm8k | 50.0 (40.0–60.0, n=100) | 62.5 (60.0–65.0, n=100) |",
        "| math500 | 25.0 (20.0–30.0, n=500) | – |",
    ]
    with pytest.raises(SystemExit, match="no results.json there"):
        compare_table([str(tmp_path)])


def test_tables_show_tool_calls_errors_and_settings(tmp_path):
    # issue 59: a run with tools shows its calls a completion and the share that failed, in table.md
    # and in --compare, with each run's tool flags; a run without them shows none of it.
    base = {"accuracy": 0.5, "ci95": [0.4, 0.6], "n": 100}
    tools = {"tool_calls": 1.5, "tool_errors": 0.25}
    (tmp_path / "eval-tools").mkdir()
    content = {"tools": "calculator", "tool": "", "max_turns": 4, "max_tool_tokens": 256, "tool_timeout": 10.0}
    content["results"] = {"gsm8k": {**base, **tools}}
    (tmp_path / "eval-tools" / "results.json").write_text(json.dumps(content))
    write_results(tmp_path / "eval-plain", {"gsm8k": base})
    assert compare_table([str(tmp_path / "eval-tools"), str(tmp_path / "eval-plain")]).splitlines()[3:] == [
        "| gsm8k tool calls, errors % | 1.50, 25.0 | – |",
        "| tools | calculator: 4 turns × 256 tokens, 10.0 s | – |",
    ]
    assert "tool" not in compare_table([str(tmp_path / "eval-plain")])
    summary = {
        **base,
        "strict_accuracy": 0.5,
        "strict_ci95": [0.4, 0.6],
        "mean_length": 9,
        "truncated": 0.0,
        "seconds": 3,
    }
    table = results_table({"gsm8k": {**summary, **tools}, "digit": summary}).splitlines()
    assert table[0].endswith("| tool calls | tool errors % |")
    assert table[2].endswith("| 1.50 | 25.0 |") and table[3].endswith("| 3 |  |  |")
    assert "tool" not in results_table({"digit": summary})


def test_compare_adds_a_strict_row_where_a_run_has_strict_accuracy(tmp_path):
    strict = {"strict_accuracy": 0.25, "strict_ci95": [0.2, 0.3]}
    write_results(tmp_path / "eval-new", {"gsm8k": {"accuracy": 0.5, "ci95": [0.4, 0.6], "n": 100, **strict}})
    write_results(tmp_path / "eval-old", {"gsm8k": {"accuracy": 0.5, "ci95": [0.4, 0.6], "n": 100}})  # no strict yet
    table = compare_table([str(tmp_path / "eval-new"), str(tmp_path / "eval-old")])
    assert table.splitlines() == [
        "| benchmark | eval-new | eval-old |",
        "|---|---|---|",
        "| gsm8k | 50.0 (40.0–60.0, n=100) | 50.0 (40.0–60.0, n=100) |",
        "| gsm8k strict | 25.0 (20.0–30.0, n=100) | – |",
    ]


def test_compare_from_the_command_line(tmp_path, capsys):
    write_results(tmp_path / "a", {"bbh": {"accuracy": 0.5, "ci95": [0.25, 0.75], "n": 8}})
    assert main(parse_args(Args, ["--compare", str(tmp_path / "a"), str(tmp_path / "a")])) is None
    assert "| bbh | 50.0 (25.0–75.0, n=8) | 50.0 (25.0–75.0, n=8) |" in capsys.readouterr().out


def test_plot_writes_a_png_with_curves(tmp_path):
    keys = ["reward/mean", "reward/accuracy", "completion/length_mean", "policy/entropy", "kl/mean", "clip/fraction"]
    runs = []
    for offset, name in enumerate(["grpo-run", "dapo-run"]):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, **{k: (s + offset) / (10 + i) for i, k in enumerate(keys)}} for s in range(1, 21)]
        rows[9]["eval/accuracy"] = 0.3 + 0.1 * offset
        run.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(run))
    out = main(parse_args(Args, ["--plot", *runs, "--plot_file", str(tmp_path / "curves.png")]))
    assert out == tmp_path / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (850, 1600)  # figsize (16, 8.5) at 100 dpi
    colours = {tuple(pixel) for pixel in image.reshape(-1, image.shape[-1])[::97].round(2).tolist()}
    assert len(colours) > 20  # curves, text and grid, not a blank canvas
    with pytest.raises(SystemExit, match="no metrics.jsonl there"):
        plot_curves([str(tmp_path)], tmp_path / "x.png")
    # A file matplotlib cannot write (by its suffix) stops before any run is read, naming the ones it can;
    # it used to be matplotlib's ValueError after every run was read. .pdf and .svg are pictures too.
    with pytest.raises(SystemExit, match=r"--plot_file .*curves\.txt: matplotlib cannot write a \.txt file.*png.*svg"):
        main(parse_args(Args, ["--plot", "missing-run", "--plot_file", str(tmp_path / "curves.txt")]))
    assert not (tmp_path / "curves.txt").exists()
    svg = main(parse_args(Args, ["--plot", *runs, "--plot_file", str(tmp_path / "curves.svg")]))
    assert svg.read_text().startswith("<?xml")


def test_plot_adds_the_tools_panels_where_a_run_had_tools(tmp_path):
    plain = [("a", [{"step": 1, "reward/mean": 0.5}])]
    tools = [("b", [{"step": 1, "reward/mean": 0.5, "tools/calls": 1.0, "tools/errors": 0.0}])]
    assert plot_panels(plain) == PLOT_PANELS
    assert [key for key, _ in plot_panels(plain + tools)[len(PLOT_PANELS) :]] == ["tools/calls", "tools/errors"]
    run = tmp_path / "grpo-tools"
    run.mkdir()
    run.joinpath("metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in tools[0][1]))
    assert plot_curves([str(run)], tmp_path / "tools.png").read_bytes()[:4] == b"\x89PNG"


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        parse_args(Args, ["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in Args.__dataclass_fields__:
        assert f"--{name}" in text
    assert "eval run dirs (or results.json files) to join into one table" in text
    assert "completion cap (seed study: 2048)" in text and "(default: 2048)" in text
