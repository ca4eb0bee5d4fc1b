"""Scores a model or a checkpoint on countdown, gsm8k, math500, bbh and mmlu_pro; compares runs; plots
training curves; runs a study (docs/evaluation.md, docs/study.md).

Zero-shot chain of thought through the chat template, batched with grpo.py's KV-cache `generate`,
greedy by default (--num_samples k --temperature t: mean accuracy and the unbiased pass@k). Two
grades, as lm-eval's strict-match and flexible-extract: `strict_accuracy` reads only the answer
format the instruction asks for, `accuracy` also each extractor's fallbacks (rewards.py).

  python evaluate.py --model Qwen2.5-1.5B-Instruct                 # all five, from the Hub
  python evaluate.py --model tiny --data_dir tests/fixtures/data --limit 5 --max_new_tokens 32  # CPU
  python evaluate.py --compare runs/eval-a runs/eval-b             # one table, a column per run
  python evaluate.py --plot runs/grpo-… runs/dapo-…                # training curves, PNG
  python evaluate.py --study recipes/study-tiny.yaml               # train, evaluate, report

Writes runs/eval-<benchmarks>-<model>-<time>/: args.json, results.json, samples.jsonl, table.md.
Shape letters: N rows of a generation batch (prompts × num_samples) · P prompt · T completion tokens.
"""

import dataclasses
import functools
import json
import math
import multiprocessing
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

import common
import rewards
from common import arg, load_model
from grpo import encode_prompts, generate
from rewards import BENCHMARKS, REWARD_NONE, Score, TaskArgs, load_benchmark

Z_95 = 1.959963984540054  # standard normal quantile of 0.975: two-sided 95% intervals
# Training-curve panels of --plot: (metrics.jsonl key, title). Runs lacking a key skip that panel.
PLOT_PANELS = (
    ("reward/mean", "reward"),
    ("reward/accuracy", "accuracy (training samples; eval/accuracy dashed)"),
    ("completion/length_mean", "completion length (tokens)"),
    ("policy/entropy", "entropy"),
    ("kl/mean", "KL to the reference"),
    ("clip/fraction", "clip fraction"),
)


def task_flag(name: str):
    """The flag `name` of rewards.TaskArgs, its default and help: one definition for training and here."""
    spec = next(f for f in dataclasses.fields(TaskArgs) if f.name == name)
    return dataclasses.field(default=spec.default, metadata=spec.metadata)


@dataclass
class Args:
    # what to evaluate
    model: str = arg("Qwen2.5-1.5B-Instruct", "local dir (e.g. runs/<run>/final), Hub id, short name or 'tiny'")
    benchmarks: str = arg("gsm8k,math500,bbh,mmlu_pro,countdown", "these five, file (--data_file) or digit (the toy)")
    data_dir: str = arg("", "offline: a directory laid out like tests/fixtures/data (gsm8k/test.jsonl, ...); '' = Hub")
    limit: int = arg(0, "problems per benchmark at most, spread over BBH tasks / MMLU-Pro categories; 0 = all")
    countdown_problems: int = arg(500, "size of the held-out Countdown set (and of the digit toy's prompts)")
    countdown_numbers: str = task_flag("countdown_numbers")
    shots: int = task_flag("shots")
    prompt_format: str = arg("auto", common.PROMPT_FORMAT_HELP)
    # your own task (--benchmarks file; docs/tasks.md): its held-out rows, graded by --grader
    data_file: str = arg("", "file: the training file or Hub id whose held-out share (1 row in 10) is evaluated")
    data_split: str = arg("train", "file: the split of a Hub --data_file")
    prompt_key: str = arg("prompt", "file: the column of the prompt (a text, or a list of chat messages)")
    answer_key: str = arg("answer", "file: the column of the reference answer")
    grader: str = arg("math", "file: math (math-verify), number, choice (A-J), exact, countdown (nums, target)")
    system_prompt: str = arg("", "file: a system message before each prompt; '' = none")
    instruction: str = arg("auto", "file: appended to each prompt; auto = the grader's own, '' = none")
    eval_data_file: str = arg("", "file: the problems to evaluate (a file or Hub id) instead of --data_file's share")
    eval_data_split: str = arg("test", "file: the split of a Hub --eval_data_file")
    # generation
    max_new_tokens: int = arg(2048, "completion cap (seed study: 2048); longer completions count as truncated")
    batch_size: int = arg(32, "problems per generation batch (each generates num_samples completions)")
    num_samples: int = arg(1, "k completions per problem; k > 1 reports pass@k and needs --temperature > 0")
    temperature: float = arg(0.0, "0 = greedy decoding")
    top_p: float = arg(1.0, "nucleus sampling when temperature > 0")
    grade_timeout: float = arg(60.0, "seconds one grading may take before its worker process is killed (counted wrong)")
    reward_fn: str = arg("", "grade by your reward (as in training): module:function or file.py:function; >= 1 = right")
    reward_fn_timeout: float = arg(10.0, "seconds a --reward_fn call may take; past it, or raising: wrong, counted")
    # tools (docs/tools.md): the model may call them mid-answer; training's flags (rewards.TaskArgs)
    tools: str = task_flag("tools")
    tool: str = task_flag("tool")
    max_turns: int = task_flag("max_turns")
    max_tool_tokens: int = task_flag("max_tool_tokens")
    tool_timeout: float = task_flag("tool_timeout")
    # run
    seed: int = arg(0, "seeds sampling when temperature > 0")
    device: str = arg("auto", "auto, cpu, cuda, cuda:1, ...")
    dtype: str = arg("auto", "auto (bf16 compute on GPU; fp32 on CPU), bfloat16, float32")
    output_dir: str = arg("runs", "results go to <output_dir>/eval-<benchmarks>-<model>-<time>/")
    # other modes
    compare: list[str] = arg([], "eval run dirs (or results.json files) to join into one table")
    plot: list[str] = arg([], "training run dirs whose metrics.jsonl to plot")
    plot_file: str = arg("", "picture --plot writes, by suffix (.png, .svg, .pdf); '' = <output_dir>/curves-<time>.png")
    study: str = arg("", "a study file (recipes/study-*.yaml): train its arms, evaluate each, report every finding")
    study_model: str = arg("", "--study: the model of every arm, in place of the study file's (e.g. a local path)")
    study_dry_run: bool = arg(False, "--study: print the plan (and a GPU-time estimate) and stop")
    study_report_only: bool = arg(False, "--study: write the report from what has finished, and train nothing")
    study_into: str = arg("", "--study: a markdown file whose <!-- study:NAME --> section becomes the report")
    study_prune: bool = arg(False, "--study: once a run is evaluated, delete its step-* checkpoints and resume state")


def check_args(args: Args) -> list[str]:
    """The benchmark names, or a SystemExit naming every setting that cannot work."""
    names = [name.strip() for name in args.benchmarks.split(",") if name.strip()]
    known = (*BENCHMARKS, "file", "digit")  # file: your own data (--data_file, --grader); digit: the toy
    problems = [f"--benchmarks: {name!r} is not one of {', '.join(known)}." for name in names if name not in known]
    problems += common.output_dir_problems(args.output_dir)
    if "file" in names and not (args.data_file or args.eval_data_file):
        problems.append("--benchmarks file needs --eval_data_file (the problems) or --data_file (its held-out share).")
    if "file" not in names and (args.data_file or args.eval_data_file):
        problems.append("--data_file and --eval_data_file are for --benchmarks file: add it, or drop them.")
    if "file" in names and args.shots and not args.data_file:  # the examples are --data_file's training rows
        problems.append("--shots with --benchmarks file takes its examples from --data_file's rows: add --data_file.")
    if not names:
        problems.append("--benchmarks names no benchmark.")
    if len(set(names)) != len(names):
        problems.append("--benchmarks names a benchmark twice.")
    if args.num_samples > 1 and args.temperature <= 0:
        problems.append("--num_samples > 1 needs --temperature > 0: greedy decoding gives k identical completions.")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        problems.append("Needs --temperature >= 0 and 0 < --top_p <= 1.")
    for name in ("max_new_tokens", "batch_size", "num_samples", "countdown_problems"):
        if getattr(args, name) < 1:
            problems.append(f"--{name} must be at least 1.")
    problems += common.check_prompt_format(args.prompt_format)
    if args.shots < 0:
        problems.append(f"--shots must be >= 0 (got {args.shots}).")
    if args.limit < 0 or args.grade_timeout <= 0:
        problems.append("--limit must be >= 0 and --grade_timeout > 0.")
    if args.max_turns < 0 or args.max_tool_tokens < 1:
        problems.append("--max_turns must be >= 0 and --max_tool_tokens >= 1.")
    problems += common.timeout_problems(args)
    if problems:
        raise SystemExit("Invalid arguments:\n  " + "\n  ".join(problems))
    return names


# ----------------------------------------------------------------------------------------
# Scoring: statistics, the grader's worker, one benchmark


def wilson_interval(accuracy: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """95% Wilson interval (Wilson 1927) of accuracy p over n problems, inside [0, 1] even at p = 0 or 1:
    (p + z²/2n ± z·sqrt(p(1−p)/n + z²/4n²)) / (1 + z²/n). With k samples, p is their mean and n counts problems."""
    denominator = 1 + z * z / n
    center = (accuracy + z * z / (2 * n)) / denominator
    half = z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples, c correct (Chen et al. 2021, Eq. 1): 1 − C(n−c, k) / C(n, k), exactly."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def limit_problems(problems: list[dict], limit: int) -> list[dict]:
    """`limit` problems, round-robin over the subsets (BBH tasks, MMLU-Pro categories): every one is represented."""
    if not limit or limit >= len(problems):
        return problems
    by_subset: dict[str, list[dict]] = {}
    for problem in problems:
        by_subset.setdefault(problem["subset"], []).append(problem)
    chosen, position = [], 0
    while len(chosen) < limit:
        chosen += [rows[position] for rows in by_subset.values() if position < len(rows)][: limit - len(chosen)]
        position += 1
    return chosen


class Grader:
    """Grades in a worker process, killed past a deadline (math-verify's alarms cannot stop sympy inside C): wrong."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.pool, self.timeouts = timeout_s, None, 0

    def score(self, score_fn, completion: str, problem: dict, truncated: bool = False) -> Score:
        if self.pool is None:  # fork: starts in milliseconds; the worker runs only Python graders, no torch
            self.pool = multiprocessing.get_context("fork").Pool(processes=1)
        job = self.pool.apply_async(score_fn, (completion, problem), {"truncated": truncated})
        try:
            return job.get(self.timeout_s)
        except multiprocessing.TimeoutError:
            self.close()
            self.timeouts += 1
            return Score(REWARD_NONE, correct=False, formatted=False, extracted=None, strict=False)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


def evaluate_benchmark(model, tokenizer, eos_ids, task, problems, args: Args, grader: Grader, run_dir: Path):
    """Generates, grades and writes to samples.jsonl num_samples completions a problem; returns results.json's entry."""
    device = next(model.parameters()).device
    _, compute_dtype = common.resolve_precision(args.dtype, device)
    k = args.num_samples
    conversations = [task.messages(p) for p in problems]
    # Longest prompts first: less padding, and a batch that runs out of memory does so at once.
    order = sorted(range(len(problems)), key=lambda i: -sum(len(m["content"]) for m in conversations[i]))
    correct = [[False] * k for _ in problems]  # [problem][sample], the flexible grade
    strict = [[False] * k for _ in problems]  # [problem][sample], the answer in the asked format only
    seen, calls, failures = [], [], []  # seen: (length, truncated, formatted) a completion
    timeouts_before, start = grader.timeouts, time.perf_counter()
    # --reward_fn in this process, as in training (a reward may hold a model, use the GPU), with its own time limit
    grade = task.score if args.reward_fn else functools.partial(grader.score, task.score)
    sampling = (args.max_new_tokens, eos_ids, tokenizer.pad_token_id, len(tokenizer), args.temperature, args.top_p)
    for first in tqdm(range(0, len(order), args.batch_size), desc=task.name, unit="batch"):
        batch = order[first : first + args.batch_size]
        # Encoded exactly as in training: chat template, left padding, each repeated k times.
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [conversations[i] for i in batch], k, device, task.tools)
        limits = len(prompt_ids), args.max_turns, args.max_tool_tokens, args.tool_timeout
        tool_turn, counts = rewards.tool_turns(tokenizer, task.tools, *limits) if task.tools else (None, None)
        tools = {"tool_turn": tool_turn, "max_turns": args.max_turns, "max_tool_tokens": args.max_tool_tokens}
        with common.autocast(device, compute_dtype):  # (N, T), (N, T), (N,), _, (N, T)
            completion_ids, completion_mask, truncated, _, tool_mask = generate(
                model, prompt_ids, prompt_mask, *sampling, **tools
            )
        row_lengths = completion_mask.sum(-1).tolist()  # (N,) the model's own tokens, the EOS included
        ends = (completion_mask + tool_mask).sum(-1).tolist()  # (N,) with the tools' answers between them
        kept = [ids[:end] for ids, end in zip(completion_ids.tolist(), ends)]
        texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
        for row, text in enumerate(texts):
            index, sample = batch[row // k], row % k  # rows i·k … i·k+k−1 belong to problem i
            problem, cut = problems[index], bool(truncated[row])
            score = grade(text, problem, truncated=cut)
            correct[index][sample], strict[index][sample] = score.correct, score.strict
            seen.append((row_lengths[row], cut, score.formatted))
            record = {"benchmark": task.name, "subset": problem["subset"], "index": index, "sample": sample}
            record |= {"prompt": tokenizer.decode(prompt_ids[row][prompt_mask[row].bool()]), "output": text}
            record |= {"extracted": score.extracted, "gold": problem["gold"], "correct": score.correct}
            record |= {"strict": score.strict, "length": row_lengths[row], "truncated": cut}
            if args.reward_fn:  # what the user's reward gave, and whether its call failed
                record["reward"], record["fn_failed"] = score.reward, score.failed
                failures.append(score.failed)
            if counts is not None:  # (N, 3) calls, failed, turns: who wrote what, and the row's calls
                record["turns"] = common.turns_of(tokenizer, completion_ids[row], completion_mask[row], tool_mask[row])
                record["tool_calls"], record["tool_failed"] = counts[row, 0].item(), counts[row, 1].item()
                calls.append(counts[row, :2].tolist())
            common.append_jsonl(run_dir / "samples.jsonl", record)
    result = summarize(correct, strict, [p["subset"] for p in problems])
    result["mean_length"], result["truncated"], result["formatted"] = (sum(v) / len(v) for v in zip(*seen))
    result["grade_timeouts"] = grader.timeouts - timeouts_before
    result["seconds"] = time.perf_counter() - start
    if args.reward_fn:  # the share of completions whose --reward_fn call failed, as training's reward/fn_failed
        result["reward_fn_failed"] = sum(failures) / len(failures)
    if calls:  # per completion, as training's tools/calls; the share of calls that failed, as tools/errors
        made, failed = sum(c for c, _ in calls), sum(f for _, f in calls)
        result.update({"tool_calls": made / len(calls), "tool_errors": failed / made if made else 0.0})
    return result


def summarize(correct: list[list[bool]], strict: list[list[bool]], subsets: list[str]) -> dict:
    """Both accuracies of correct/strict[problem][sample] with 95% intervals, pass@k for k = 1, 2, 4, …, per subset."""
    n, num_samples = len(correct), len(correct[0])
    per_problem = [sum(c) / num_samples for c in correct]  # (problems,)
    strict_per_problem = [sum(c) / num_samples for c in strict]  # (problems,)
    accuracy, strict_accuracy = mean(per_problem), mean(strict_per_problem)
    result = {"accuracy": accuracy, "ci95": wilson_interval(accuracy, n), "n": n, "strict_accuracy": strict_accuracy}
    result |= {"strict_ci95": wilson_interval(strict_accuracy, n), "num_samples": num_samples}
    if num_samples > 1:
        for k in sorted({2**i for i in range(num_samples.bit_length())} | {num_samples}):
            result[f"pass@{k}"] = sum(pass_at_k(num_samples, sum(c), k) for c in correct) / len(correct)
    if any(subsets):
        result["subsets"] = {}
        for name in dict.fromkeys(subsets):  # in the order they first appear
            rows = [i for i, subset in enumerate(subsets) if subset == name]
            means = mean([per_problem[i] for i in rows]), mean([strict_per_problem[i] for i in rows])
            result["subsets"][name] = {"accuracy": means[0], "strict_accuracy": means[1], "n": len(rows)}
        result["subset_mean"] = mean([s["accuracy"] for s in result["subsets"].values()])
        result["strict_subset_mean"] = mean([s["strict_accuracy"] for s in result["subsets"].values()])
    return result


# ----------------------------------------------------------------------------------------
# Tables and curves


def percent(value: float) -> str:
    return f"{100 * value:.1f}"


def interval(ci: list[float]) -> str:
    return f"{percent(ci[0])}–{percent(ci[1])}"


def results_table(results: dict) -> str:
    """The markdown table of one evaluation: a row per benchmark, then one per subset."""
    pass_keys = {key for r in results.values() for key in r if key.startswith("pass@")}
    pass_keys = sorted(pass_keys, key=lambda key: int(key[5:]))
    header = ["benchmark", "accuracy %", "95% CI", "strict %", "strict 95% CI", "n", *pass_keys]
    header += ["mean length", "truncated %", "seconds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in results.items():
        cells = [name, percent(r["accuracy"]), interval(r["ci95"])]
        cells += [percent(r["strict_accuracy"]), interval(r["strict_ci95"]), str(r["n"])]
        cells += [percent(r[key]) if key in r else "" for key in pass_keys]
        cells += [f"{r['mean_length']:.0f}", percent(r["truncated"]), f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for name, r in results.items():
        if "subsets" in r:
            lines += ["", f"| {name} subset | accuracy % | strict % | n |", "|---|---|---|---|"]
            lines += [
                f"| {s} | {percent(v['accuracy'])} | {percent(v['strict_accuracy'])} | {v['n']} |"
                for s, v in r["subsets"].items()
            ]
            means = f"{percent(r['subset_mean'])} | {percent(r['strict_subset_mean'])}"
            lines.append(f"| mean over subsets | {means} | {len(r['subsets'])} |")
    return "\n".join(lines)


def load_results(path: str) -> tuple[str, dict]:
    """(label, results) of an eval run directory or a results.json file."""
    file = Path(path) / "results.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise SystemExit(f"--compare {path}: no results.json there. Pass eval run directories (runs/eval-…).")
    content = json.loads(file.read_text())
    if "results" not in content:
        raise SystemExit(f"{file}: no 'results' key; is it a results.json written by evaluate.py?")
    return file.parent.name, content["results"]


def compare_table(paths: list[str]) -> str:
    """One markdown table, a column per run: per benchmark the accuracy % (95% interval, n), then its strict one."""
    runs = [load_results(path) for path in paths]
    names = list(dict.fromkeys(name for _, results in runs for name in results))
    lines = ["| benchmark | " + " | ".join(label for label, _ in runs) + " |", "|---|" + "---|" * len(runs)]
    for name in names:
        for label, key, ci_key in ((name, "accuracy", "ci95"), (f"{name} strict", "strict_accuracy", "strict_ci95")):
            if key == "strict_accuracy" and not any(key in results.get(name, {}) for _, results in runs):
                continue
            cells = [
                f"{percent(r[key])} ({interval(r[ci_key])}, n={r['n']})" if key in r else "–"
                for r in (results.get(name, {}) for _, results in runs)
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(run_dirs: list[str], out_file: Path, labels: list[str] | None = None) -> Path:
    """A panel per PLOT_PANELS key, a line per training run's metrics.jsonl; the format by out_file's suffix."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    kinds = plt.figure().canvas.get_supported_filetypes()  # png, pdf, svg, …: savefig picks by the suffix
    plt.close("all")
    if out_file.suffix.lstrip(".").lower() not in kinds:
        raise SystemExit(
            f"--plot_file {out_file}: matplotlib cannot write a {out_file.suffix or 'suffix-less'} file. "
            f"End the name with one of: {', '.join('.' + kind for kind in sorted(kinds))}."
        )
    runs = []
    for run_dir in run_dirs:
        metrics = Path(run_dir) / "metrics.jsonl"
        if not metrics.is_file():
            raise SystemExit(f"--plot {run_dir}: no metrics.jsonl there. Pass training run directories (runs/grpo-…).")
        runs.append((labels[len(runs)] if labels else Path(run_dir).name, common.read_jsonl(metrics)))
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for ax, (key, title) in zip(axes.flat, PLOT_PANELS):
        for index, (label, rows) in enumerate(runs):
            points = [(row["step"], row[key]) for row in rows if key in row]
            if points:
                ax.plot(*zip(*points), color=f"C{index}", label=label)
            evaluated = [(row["step"], row["eval/accuracy"]) for row in rows if "eval/accuracy" in row]
            if key == "reward/accuracy" and evaluated:
                ax.plot(*zip(*evaluated), color=f"C{index}", linestyle="--", marker="o", label=f"{label} (eval)")
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, f"no run logs {key}", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out_file.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_file, dpi=100)
    plt.close(fig)
    return out_file


# ----------------------------------------------------------------------------------------
# A study (--study FILE, docs/study.md): arms (recipes × seeds) trained and evaluated, then
# compared finding by finding.

SCRIPTS = ("grpo.py", "dapo.py", "ppo.py")
FINDING_METRICS = ("accuracy", "stability", "length", "cost", "base", "sweep")
TRAINED_METRICS = ("stability", "length", "cost", "sweep")  # read training curves: every arm trains
# Settings the runner gives each evaluation itself: a study's `evaluate` may not set them.
RUNNER_SETTINGS = ("model", "seed", "output_dir", "compare", "plot", "plot_file", "study", "study_model")
RUNNER_SETTINGS += ("study_dry_run", "study_into", "study_report_only", "study_prune")
# The GPU-time estimate of --study: FLOPs at an assumed sustained throughput, ~40% of an H100's
# dense bf16 peak (989 TFLOP/s), every completion at its cap and a 200-token prompt. An estimate.
ASSUMED_FLOPS_PER_S = 4e14
ASSUMED_PROMPT_TOKENS = 200
DYNAMIC_SAMPLING_FACTOR = 1.25  # the seed study's extra generation with dynamic sampling (~25%)
KNOWN_PARAMETERS = {  # parameter counts of the models a study at the paper's scale names
    "Qwen2.5-0.5B-Instruct": 0.49e9,
    "Qwen2.5-1.5B-Instruct": 1.54e9,
    "Qwen2.5-3B-Instruct": 3.09e9,
    "Qwen2.5-7B-Instruct": 7.62e9,
}


@dataclass
class Arm:
    """A training script with its recipe and settings, or (script None) a model evaluated as it is."""

    name: str
    script: str | None
    recipe: Path | None
    settings: dict  # the study's `set`, updated by the arm's own, checked against the script's Args
    seeds: list[int]

    def config(self, seed: int) -> dict:
        return {**common.read_config(str(self.recipe), self.module().Args), **self.settings, "seed": seed}

    def module(self):
        return __import__(self.script.removesuffix(".py"))

    def args(self, seed: int):
        args = self.module().Args(**self.config(seed))
        self.module().check_args(args)
        return args

    def folder(self, study_dir: Path, kind: str, seed: int) -> Path:
        return study_dir / kind / self.name / f"seed{seed}"

    def described(self, root: Path) -> str:
        if not self.script:
            return f"{Path(self.settings['model']).name} as it is"
        settings = "".join(f" --{k} {Path(v).name if k == 'model' else v}" for k, v in self.settings.items())
        return f"{self.script} --config {os.path.relpath(self.recipe, root)}{settings}"


def seed_list(value, where: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(seed, int) for seed in value):
        raise SystemExit(f"{where}: seeds must be a non-empty list of integers, not {value!r}")
    return value


def load_study(path: str, model: str = "") -> dict:
    """The study file, every arm, the evaluation and every finding checked before anything trains."""
    file, where = Path(path), f"--study {path}"
    if not file.is_file():
        raise SystemExit(f"--study {path}: no such file.")
    study = common.parsed_file(file, "--study") or {}
    unknown = set(study) - {"name", "seeds", "set", "evaluate", "arms", "findings"}
    if unknown:
        raise SystemExit(
            f"{where}: unknown keys {sorted(unknown)}: a study has name, seeds, set, evaluate, arms, findings"
        )
    if not isinstance(study.get("arms"), dict) or not study["arms"]:
        raise SystemExit(f"{where}: arms: a mapping of arm names to {{script, recipe, set, seeds}}, at least one")
    seeds = seed_list(study.get("seeds", [0]), where)
    problems, arms = [], {}
    for name, spec in study["arms"].items():
        spec = spec or {}
        if set(spec) - {"script", "recipe", "set", "seeds"}:
            problems.append(f"arm {name}: unknown keys {sorted(set(spec) - {'script', 'recipe', 'set', 'seeds'})}")
            continue
        script, settings = spec.get("script"), {**(study.get("set") or {}), **(spec.get("set") or {})}
        settings |= {"model": model} if model else {}
        if script is None and set(settings) != {"model"}:
            problems.append(f"arm {name}: an arm without a script is a model evaluated as it is: set its model alone")
        elif script is None:  # evaluated as it is: greedy, so one seed is all
            arms[name] = Arm(name, None, None, settings, seeds[:1])
        elif script not in SCRIPTS or not spec.get("recipe"):
            problems.append(f"arm {name}: needs a script, one of {', '.join(SCRIPTS)}, and a recipe")
        else:
            try:
                arm_seeds = seed_list(spec.get("seeds", seeds), f"arm {name}")
                arm = Arm(name, script, (file.parent / spec["recipe"]).resolve(), {}, arm_seeds)
                arm.settings = common.checked_settings(settings, arm.module().Args, f"arm {name}: set")
                arm.args(arm.seeds[0])
                arms[name] = arm
            except SystemExit as error:
                problems.append(f"arm {name}: {error}")
    evaluation = study.get("evaluate") or {}
    reserved = sorted(set(evaluation) & set(RUNNER_SETTINGS))
    if reserved:
        problems.append(f"evaluate: the runner sets {reserved} itself; a study's evaluate may not")
    else:
        try:
            evaluation = common.checked_settings(evaluation, Args, "evaluate")
            check_args(Args(**evaluation))
        except SystemExit as error:
            problems.append(str(error))
    for index, finding in enumerate(study.get("findings") or [], 1):
        problems += finding_problems(finding, arms, f"finding {index}")
    if problems:
        raise SystemExit(f"{where}:\n  " + "\n  ".join(problems))
    return {**study, "name": study.get("name", file.stem), "arms": arms, "evaluate": evaluation, "file": path}


def finding_problems(finding: dict, arms: dict, where: str) -> list[str]:
    """What is wrong with one finding of a study file (nothing: [])."""
    known = {"claim", "metric", "arms", "best", "setting"}
    if not isinstance(finding, dict) or set(finding) - known or not finding.get("claim"):
        return [f"{where}: a finding is a mapping of claim, metric, arms (best, setting), with a claim"]
    problems, named = [], finding.get("arms") or []
    if finding.get("metric") not in FINDING_METRICS:
        problems.append(f"{where}: metric {finding.get('metric')!r} is not one of {', '.join(FINDING_METRICS)}")
    missing = [arm for arm in named if arm not in arms]
    if missing or len(named) < 2:
        return problems + [f"{where}: arms must name two or more arms of the study (unknown: {missing})"]
    if finding["metric"] in TRAINED_METRICS and any(arms[arm].script is None for arm in named):
        problems.append(f"{where}: a {finding['metric']} finding reads training curves: every arm must train")
    if finding["metric"] in ("base", "sweep") and finding.get("best") not in named:
        problems.append(f"{where}: best must name one of its arms")
    if finding["metric"] == "sweep" and not problems:
        values = [getattr(arms[arm].args(arms[arm].seeds[0]), finding.get("setting") or "", None) for arm in named]
        if any(not isinstance(value, (int, float)) or isinstance(value, bool) for value in values):
            problems.append(f"{where}: setting must name a number every arm of the sweep sets (got {values})")
    return problems


def arm_state(arm: Arm, seed: int, study_dir: Path) -> tuple[str, Path | None]:
    """("finished", run dir with final/), ("resume", newest step-* checkpoint) or ("new", None)."""
    runs = sorted(path.parent for path in arm.folder(study_dir, "arms", seed).glob("*/args.json"))
    expected = dataclasses.asdict(arm.args(seed))
    for run in runs:
        recorded = json.loads((run / "args.json").read_text())
        unknown = sorted(set(recorded) - set(expected))
        if unknown:  # grpo.py gained a setting after this runner imported it: the code changed mid-study
            raise SystemExit(
                f"{run} was trained by a newer {arm.script} than this study runner loaded (it records "
                f"{', '.join(unknown)}): the code changed while the study ran. Run the same --study command again."
            )
        changed = sorted(k for k in recorded if k not in ("output_dir", "resume_from") and recorded[k] != expected[k])
        if changed:
            raise SystemExit(
                f"{run} was trained with other settings than arm {arm.name}'s now: "
                + ", ".join(f"{k} {recorded[k]!r} -> {expected.get(k)!r}" for k in changed)
                + ". Move that run away (or use another --output_dir) to train the arm afresh."
            )
    for run in runs:
        if (run / "final").is_dir():
            return "finished", run
    checkpoints = sorted(checkpoint for run in runs for checkpoint in run.glob("step-*") if checkpoint.is_dir())
    return ("resume", checkpoints[-1]) if checkpoints else ("new", None)


def eval_results(study: dict, model: str, seed: int, where: Path) -> Path | None:
    """The results.json of `model`'s finished evaluation with the study's settings in `where`, or None."""
    expected = dataclasses.asdict(Args(**study["evaluate"], model=model, seed=seed))
    tail = Path(model).parts[-5:]
    for table in sorted(where.glob("*/table.md")):
        recorded = json.loads(table.with_name("args.json").read_text())
        moved = tail[:1] == ("arms",) and Path(recorded["model"]).parts[-5:] == tail
        ignored = ("output_dir", "model") if moved else ("output_dir",)  # a study folder moved whole
        changed = ", ".join(sorted(k for k in recorded if k not in ignored and recorded[k] != expected[k]))
        if changed:
            raise SystemExit(
                f"{table.parent} evaluated with other settings than the study's now: {changed}. Move it away."
            )
        return table.with_name("results.json")
    return None


def gpu_hours(plan: list[tuple[Arm, int, str]]) -> float | None:
    """H100-hours left to train: a token's generation 2·P, scoring 2·P, update 6·P (a critic as much); None: no P."""
    total = 0.0
    for arm, seed, state in plan:
        if arm.script is None or state == "finished":
            continue
        args = arm.args(seed)
        parameters = KNOWN_PARAMETERS.get(Path(args.model).name)
        if parameters is None:
            return None
        sequences = args.batch_size * args.group_size
        tokens = sequences * (ASSUMED_PROMPT_TOKENS + args.max_new_tokens)
        updates = getattr(args, "num_iterations", getattr(args, "ppo_epochs", 1))
        generation = 2 * parameters * sequences * args.max_new_tokens
        generation *= DYNAMIC_SAMPLING_FACTOR if getattr(args, "dynamic_sampling", False) else 1
        scoring = 2 * parameters * tokens * (2 if args.beta > 0 else 1)
        update = 6 * parameters * tokens * updates
        critic = (2 + 6 * updates) * parameters * tokens if arm.script == "ppo.py" else 0
        total += args.max_steps * (generation + scoring + update + critic)
    return total / ASSUMED_FLOPS_PER_S / 3600


def run_study(args: Args) -> Path:
    """--study: prints the plan, trains (or resumes) every arm × seed, evaluates each once, writes report.md."""
    study = load_study(args.study, args.study_model)
    study_dir = Path(args.output_dir) / f"study-{study['name']}"
    local = args.study_model.startswith(("/", "./", "../", "~")) or args.study_model.endswith(".gguf")
    if local and not Path(args.study_model).expanduser().exists():  # a path, not a Hub id: found now, not in run 1
        raise SystemExit(f"--study_model {args.study_model}: no such file or directory.")
    if args.study_into:  # where the report goes, checked before anything trains
        into_markers(Path(args.study_into), study["name"])
    study["command"] = shlex.join(["python", "evaluate.py", "--study", args.study, "--output_dir", args.output_dir])
    study["command"] += f" --study_model {shlex.quote(args.study_model)}" if args.study_model else ""
    arms = study["arms"].values()
    order = [(arm, s) for s in sorted({s for arm in arms for s in arm.seeds}) for arm in arms if s in arm.seeds]
    root = Path(__file__).resolve().parent
    print(f"study {study['name']} -> {study_dir}")
    plan = []
    for arm, seed in order:
        if arm.script:
            state = arm_state(arm, seed, study_dir)[0]
        else:
            done = eval_results(study, arm.settings["model"], seed, arm.folder(study_dir, "evals", seed))
            state = "finished" if done else "evaluate"
        plan.append((arm, seed, state))
        print(f"  {arm.name:<16} seed {seed}  {state:<9} {arm.described(root)}")
    hours = gpu_hours(plan)
    if hours is not None:
        print(f"GPU time to train what is not finished, an estimate, not a measurement: {hours:.1f} H100-hours")
        print(f"  (FLOPs at an assumed {ASSUMED_FLOPS_PER_S / 1e12:.0f} TFLOP/s, every completion at its cap)")
    if args.study_dry_run:
        return study_dir
    for arm, seed in [] if args.study_report_only else order:
        if arm.script:
            state, where = arm_state(arm, seed, study_dir)
            if state != "finished":
                folder = arm.folder(study_dir, "arms", seed)
                command = [str(root / arm.script), "--config", write_config(folder, arm.config(seed))]
                command += ["--output_dir", str(folder)] + (["--resume_from", str(where)] if state == "resume" else [])
                run_command(command, f"{arm.name} seed {seed}")
            model = str(arm_state(arm, seed, study_dir)[1] / "final")
        else:
            model = arm.settings["model"]
        folder = arm.folder(study_dir, "evals", seed)
        if eval_results(study, model, seed, folder) is None:
            config = write_config(folder, {**study["evaluate"], "model": model, "seed": seed})
            command = [str(root / "evaluate.py"), "--config", config, "--output_dir", str(folder)]
            run_command(command, f"evaluating {arm.name} seed {seed}")
        freed = prune(Path(model).parent) if args.study_prune and arm.script else 0
        if freed:
            print(f"[{arm.name} seed {seed}] pruned {freed / 2**30:.1f} GiB of checkpoints")
    report = study_report(study, study_dir)
    (study_dir / "report.md").write_text(report)
    print(f"wrote {study_dir / 'report.md'}")
    if args.study_into:
        write_into(Path(args.study_into), study, study_dir, report)
    return study_dir


def prune(run: Path) -> int:
    """--study_prune: deletes step-* and final/trainer_state*.pt of an evaluated run. Returns the bytes freed."""
    doomed = [path for path in run.glob("step-*") if path.is_dir()] + list((run / "final").glob("trainer_state*.pt"))
    freed = sum(f.stat().st_size for path in doomed for f in [path, *path.rglob("*")] if f.is_file())
    for path in doomed:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return freed


def write_config(folder: Path, settings: dict) -> str:
    """settings as folder/config.json, the --config of one run. Returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return str(folder / "config.json")


def run_command(command: list[str], what: str) -> None:
    """One run as its own process: a first Ctrl-C waits for it to stop (a checkpoint being written), a second kills."""
    print(f"[{what}] {shlex.join(['python', *command])}", flush=True)
    process = subprocess.Popen([sys.executable, *command])
    try:
        status = process.wait()
    except KeyboardInterrupt:
        print(f"\nWaiting for {what} to stop (Ctrl-C again kills it).", flush=True)
        try:
            process.wait()
        except KeyboardInterrupt:
            process.kill()
        raise SystemExit(f"Interrupted during {what}. Run the same --study command again to go on.") from None
    if status:
        raise SystemExit(f"{what} stopped with exit status {status}; run the same --study command again to resume.")


@dataclass
class Outcome:
    """One arm × seed, as its own files recorded it."""

    arm: str
    seed: int
    run_dir: Path | None  # None for an arm that only evaluates
    rows: list[dict]  # its metrics.jsonl
    correct: int  # held-out problems answered right (strict), of n
    n: int
    eval_length: float  # mean held-out completion length, tokens


def study_outcomes(study: dict, study_dir: Path) -> dict[str, list[Outcome]]:
    """Every arm's finished and evaluated seeds (the first benchmark of the study's evaluate)."""
    outcomes = {name: [] for name in study["arms"]}
    for arm in study["arms"].values():
        for seed in arm.seeds:
            state, run_dir = arm_state(arm, seed, study_dir) if arm.script else ("finished", None)
            if state != "finished":  # not trained (yet)
                continue
            model = str(run_dir / "final") if run_dir else arm.settings["model"]
            results = eval_results(study, model, seed, arm.folder(study_dir, "evals", seed))
            if results is None:  # not evaluated (yet)
                continue
            result = next(iter(json.loads(results.read_text())["results"].values()))
            rows = common.read_jsonl(run_dir / "metrics.jsonl") if run_dir else []
            n, correct = result["n"], round(result["strict_accuracy"] * result["n"])
            outcomes[arm.name].append(Outcome(arm.name, seed, run_dir, rows, correct, n, result["mean_length"]))
    return outcomes


def pooled(outcomes: list[Outcome]) -> tuple[float, tuple[float, float], int]:
    """Strict accuracy, the mean over seeds, with the interval of ONE evaluation's n (seeds share the problems)."""
    accuracy = mean(scores(outcomes))
    n = min(o.n for o in outcomes)
    return accuracy, wilson_interval(accuracy, n), n


def scores(outcomes: list[Outcome]) -> list[float]:
    return [o.correct / o.n for o in outcomes]


def clearly_above(first: list[Outcome], second: list[Outcome]) -> bool:
    """first's interval lies wholly above second's, and each of its seeds above each of second's."""
    return pooled(first)[1][0] > pooled(second)[1][1] and min(scores(first)) > max(scores(second))


def accuracy_relation(first: list[Outcome], second: list[Outcome], names: tuple[str, str]) -> str:
    """Whose interval lies above, that the intervals lie apart but the seeds do not, or that they overlap."""
    if clearly_above(first, second):
        return f"{names[0]}'s interval lies above {names[1]}'s"
    if clearly_above(second, first):
        return f"{names[1]}'s interval lies above {names[0]}'s"
    (low_1, high_1), (low_2, high_2) = pooled(first)[1], pooled(second)[1]
    if low_1 > high_2 or low_2 > high_1:
        ranges = [f"{percent(min(scores(o)))}–{percent(max(scores(o)))}%" for o in (first, second)]
        return f"the intervals lie apart but the seeds overlap ({names[0]} {ranges[0]}, {names[1]} {ranges[1]})"
    return "the intervals overlap"


def accuracy_cell(outcomes: list[Outcome]) -> str:
    accuracy, (low, high), n = pooled(outcomes)
    seeds = f"; seeds {', '.join(percent(score) for score in scores(outcomes))}" if len(outcomes) > 1 else ""
    return f"{percent(accuracy)}% ({percent(low)}–{percent(high)}, n = {n}){seeds}"


def curve(outcome: Outcome, key: str) -> list[float]:
    return [row[key] for row in outcome.rows if key in row]


def entropy_cell(outcomes: list[Outcome]) -> str:
    """policy/entropy at the first and the last step, each the mean over the seeds; "—" without one."""
    curves = [c for c in (curve(o, "policy/entropy") for o in outcomes) if c]
    return f"{mean([c[0] for c in curves]):.3f} → {mean([c[-1] for c in curves]):.3f}" if curves else "—"


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def spread(values: list[float]) -> float:
    """The population standard deviation (0 for one value)."""
    return math.sqrt(mean([(v - mean(values)) ** 2 for v in values])) if values else float("nan")


def step_spread(outcomes: list[Outcome]) -> float:
    """The spread of the reward curve's step-to-step changes (reward/mean), averaged over seeds."""
    changes = [[b - a for a, b in zip(c, c[1:])] for c in (curve(o, "reward/mean") for o in outcomes)]
    return mean([spread(change) for change in changes if change])


def seed_spread(outcomes: list[Outcome]) -> float:
    """The spread of the seeds' reward curves at each step, averaged over steps; nan with one seed."""
    curves = [curve(o, "reward/mean") for o in outcomes]
    return mean([spread(list(values)) for values in zip(*curves)]) if len(curves) > 1 else float("nan")


def late_lengths(outcome: Outcome) -> list[float]:
    """completion/length_mean over the second half of a run's steps."""
    lengths = curve(outcome, "completion/length_mean")
    return lengths[len(lengths) // 2 :]


def groups_per_step(outcome: Outcome) -> float:
    """Groups generated a step: DAPO logs sampling/groups_generated; a step of the others is B."""
    generated = curve(outcome, "sampling/groups_generated")
    return mean(generated) if generated else json.loads((outcome.run_dir / "args.json").read_text())["batch_size"]


def arm_row(finding: dict, name: str, outcomes: list[Outcome]) -> dict:
    """An arm's row in a finding's table: its held-out accuracy, and what the finding's metric reads."""
    row = {"arm": name, "seeds": len(outcomes), "held-out accuracy": accuracy_cell(outcomes)}
    if finding["metric"] == "stability":
        row["step-to-step spread"] = f"{step_spread(outcomes):.3f}"
        row["spread across seeds"] = f"{seed_spread(outcomes):.3f}"
    if finding["metric"] == "length":
        row["length, 2nd half of training"] = f"{mean([v for o in outcomes for v in late_lengths(o)]):.1f}"
        row["held-out length"] = f"{mean([o.eval_length for o in outcomes]):.1f}"
    if finding["metric"] == "cost":
        row["groups generated a step"] = f"{mean([groups_per_step(o) for o in outcomes]):.1f}"
        row["generation s a step"] = f"{mean([v for o in outcomes for v in curve(o, 'time/generate')]):.1f}"
    if finding["metric"] == "sweep":
        setting = finding["setting"]
        row = {setting: json.loads((outcomes[0].run_dir / "args.json").read_text())[setting], **row}
    return row


def judge(finding: dict, outcomes: dict[str, list[Outcome]]) -> tuple[list[dict], str]:
    """A finding's table rows and its verdict: holds, does not hold or not shown (docs/study.md's table)."""
    names, metric = finding["arms"], finding["metric"]
    missing = [name for name in names if not outcomes[name]]
    if missing:
        return [], f"not run yet: {', '.join(missing)}"
    rows = [arm_row(finding, name, outcomes[name]) for name in names]
    first, second = outcomes[names[0]], outcomes[names[1]]
    if metric == "accuracy":
        verdict = "holds" if clearly_above(first, second) else "not shown"
        verdict = "does not hold" if clearly_above(second, first) else verdict
        detail = accuracy_relation(first, second, (names[0], names[1]))
    elif metric == "stability":
        first_spread, second_spread = step_spread(first), step_spread(second)
        steadier = first_spread < second_spread
        detail = (
            f"{names[0]} {'steadier' if steadier else 'no steadier'} step to step ({first_spread:.3f} against "
            f"{second_spread:.3f}); held-out accuracy: {accuracy_relation(first, second, (names[0], names[1]))}"
        )
        verdict = "holds" if steadier and clearly_above(first, second) else "not shown"
        verdict = "does not hold" if clearly_above(second, first) else verdict  # the claim's accuracy half fails
    elif metric == "length":
        # each seed's mean late length; the steps with one seed (a curve's steps are not independent)
        a, b = (
            [mean(late_lengths(o)) for o in arm] if len(arm) > 1 else late_lengths(arm[0]) for arm in (first, second)
        )
        kind = "seeds" if len(first) > 1 else "steps of one seed"
        error = math.sqrt(spread(a) ** 2 / len(a) + spread(b) ** 2 / len(b))
        difference = mean(a) - mean(b)
        verdict = "holds" if difference > 2 * error else "does not hold" if difference < -2 * error else "not shown"
        detail = f"{difference:+.1f} tokens, standard error {error:.1f} over {kind}"
    elif metric == "cost":
        ratio = mean([groups_per_step(o) for o in first]) / mean([groups_per_step(o) for o in second])
        if ratio <= 1:
            verdict, detail = "does not hold", f"{ratio:.2f}× the groups generated"
        elif clearly_above(first, second):
            verdict, detail = "does not hold", f"{ratio:.2f}× the groups, and a clear gain in accuracy"
        else:
            verdict, detail = "holds", f"{ratio:.2f}× the groups generated, and no accuracy shown gained"
    elif metric == "base":
        base, trained, claimed = first, names[1:], finding["best"]
        above = [name for name in trained if clearly_above(outcomes[name], base)]
        beaten_by = [name for name in trained if name != claimed and clearly_above(outcomes[name], outcomes[claimed])]
        ahead = all(clearly_above(outcomes[claimed], outcomes[name]) for name in trained if name != claimed)
        place = f"lies below {', '.join(beaten_by)}" if beaten_by else "overlaps another arm"
        place = "lies above every other arm" if ahead else place
        detail = f"{len(above)} of {len(trained)} arms lie clearly above the base; {claimed} {place}"
        verdict = "holds" if len(above) == len(trained) and ahead else "does not hold" if beaten_by else "not shown"
    else:  # sweep
        points = sorted(names, key=lambda name: rows[names.index(name)][finding["setting"]])
        claimed, ends = finding["best"], (points[0], points[-1])
        beaten_by = [name for name in points if name != claimed and clearly_above(outcomes[name], outcomes[claimed])]
        ahead = all(clearly_above(outcomes[claimed], outcomes[end]) for end in ends if end != claimed)
        if beaten_by:
            verdict, detail = "does not hold", f"{', '.join(beaten_by)} lies above {claimed}"
        elif claimed not in ends and ahead:
            verdict, detail = "holds", f"{claimed} lies above both ends of the sweep"
        else:
            where = "is an end of the sweep" if claimed in ends else "overlaps an end of the sweep"
            verdict, detail = "not shown", f"{claimed} {where}"
    return rows, f"{verdict}: {detail}"


def study_report(study: dict, study_dir: Path) -> str:
    """report.md: every arm's accuracy, entropy and minutes, then each finding's table, verdict and curves."""
    outcomes = study_outcomes(study, study_dir)
    root = Path(study["file"]).resolve().parent
    lines = [
        f"Generated by `{study['command']}` from the runs' own metrics.jsonl and results.json "
        f"({study_dir}). Held-out accuracy is strict, greedy unless the study's evaluate says otherwise, "
        "the mean over the seeds with the Wilson 95% interval of one evaluation's n problems (every seed "
        "answers the same problems), each seed's beside it.",
        "",
    ]
    arms = []
    for arm in study["arms"].values():
        done = outcomes[arm.name]
        minutes = sum(v for o in done for row in o.rows for k, v in row.items() if k.startswith("time/"))
        arms.append({
            "arm": arm.name,
            "what (recipes relative to the study file)": arm.described(root),
            "seeds done": f"{len(done)} of {len(arm.seeds)}",
            "held-out accuracy": accuracy_cell(done) if done else "—",
            "entropy, first → last step": entropy_cell(done),
            "minutes in the steps": f"{minutes / 60:.1f}" if minutes else "—",
        })  # fmt: skip
    lines += [common.markdown_table(arms), ""]
    for index, finding in enumerate(study["findings"], 1):
        rows, verdict = judge(finding, outcomes)
        lines += [f"#### {index}. {finding['claim']}", "", f"**{verdict}** (metric: {finding['metric']}).", ""]
        if rows:
            lines += [common.markdown_table(rows), ""]
            runs = [
                (o.run_dir, f"{name} seed {o.seed}") for name in finding["arms"] for o in outcomes[name] if o.run_dir
            ]
            if runs:
                picture = study_dir / f"finding-{index}.png"
                plot_curves([str(run) for run, _ in runs], picture, labels=[label for _, label in runs])
                lines += [f"![finding {index}]({picture.name})", ""]
    return "\n".join(lines)


def into_markers(document: Path, name: str) -> tuple[str, str]:
    """The lines <!-- study:NAME --> and <!-- /study:NAME --> of --study_into's document, in this order."""
    begin, end = f"<!-- study:{name} -->", f"<!-- /study:{name} -->"
    markers = f"the lines {begin} and {end}"
    if not document.is_file():
        raise SystemExit(f"--study_into {document}: no such file. Give a markdown file with {markers}.")
    if begin not in (text := document.read_text()) or end not in text.split(begin, 1)[1]:
        raise SystemExit(f"--study_into {document}: add {markers}, in this order, where the report goes.")
    return begin, end


def write_into(document: Path, study: dict, study_dir: Path, report: str) -> None:
    """Puts the report between document's markers, its pictures beside it (study-NAME-finding-k.png)."""
    begin, end = into_markers(document, study["name"])
    text = document.read_text()
    for picture in study_dir.glob("finding-*.png"):
        shutil.copyfile(picture, document.parent / f"study-{study['name']}-{picture.name}")
        report = report.replace(f"({picture.name})", f"(study-{study['name']}-{picture.name})")
    head, rest = text.split(begin, 1)
    document.write_text(f"{head}{begin}\n{report}\n{end}{rest.split(end, 1)[1]}")
    print(f"wrote the report into {document}")


def main(args: Args) -> Path | None:
    """Runs the mode the arguments ask for. Returns the eval run directory, the plot or the study's directory."""
    if args.study:
        return run_study(args)
    if args.compare:
        print(compare_table(args.compare))
        return None
    if args.plot:
        out_file = Path(args.plot_file or Path(args.output_dir) / f"curves-{time.strftime('%Y%m%d-%H%M%S')}.png")
        print(f"wrote {plot_curves(args.plot, out_file)}")
        return out_file
    names = check_args(args)
    tasks = {}  # data first, --tools and --tool too: a missing file or column stops the run before the model loads
    for name in names:
        if name == "file":
            task = rewards.load_file_task(rewards.FileTaskSpec.from_args(args), "heldout", shots=args.shots)
        else:
            task = load_benchmark(name, args.data_dir, args.countdown_problems, args.shots, args.countdown_numbers)
        tasks[name] = rewards.with_tools(task, args)
    if args.reward_fn:  # imported and checked once, before the model loads, as in training
        score = rewards.with_reward_fn(next(iter(tasks.values())), args.reward_fn, args.reward_fn_timeout).score
        tasks = {name: dataclasses.replace(task, score=score) for name, task in tasks.items()}
    device = common.use_device(common.resolve_device(args.device))  # a GPU named by --device becomes the current one
    weight_dtype, _ = common.resolve_precision(args.dtype, device)
    common.seed_everything(args.seed)
    model, tokenizer, eos_ids = load_model(args.model, device, weight_dtype, prompt_format=args.prompt_format)
    model.eval().requires_grad_(False)
    for task in tasks.values():  # the template shows the tools and gives their answers, which fit: before any output
        if task.tools:
            first = task.messages(task.problems[0])
            common.render_chat(tokenizer, first, tools=task.tools, tools_fix="drop --tools/--tool")
            rewards.tool_turns(tokenizer, task.tools, 1, args.max_turns, args.max_tool_tokens, args.tool_timeout)
    run_dir = common.make_run_dir(args, "eval", task="+".join(names))
    keys = ["model", "max_new_tokens", "num_samples", "temperature", "top_p"]  # the settings results.json records
    keys += ["tools", "tool", "max_turns", "max_tool_tokens", "tool_timeout"] if args.tools or args.tool else []
    keys += ["reward_fn", "reward_fn_timeout"] if args.reward_fn else []
    settings = {k: getattr(args, k) for k in keys}
    results, grader = {}, Grader(args.grade_timeout)
    try:
        for name, task in tasks.items():
            problems = limit_problems(task.problems, args.limit)
            results[name] = evaluate_benchmark(model, tokenizer, eos_ids, task, problems, args, grader, run_dir)
            # Rewritten after every benchmark: an interrupted run keeps what it finished.
            (run_dir / "results.json").write_text(json.dumps({**settings, "results": results}, indent=2) + "\n")
    finally:
        grader.close()
    table = results_table(results)
    (run_dir / "table.md").write_text(table + "\n")
    print(f"\n{args.model} ({run_dir})\n\n{table}")
    return run_dir


if __name__ == "__main__":
    main(common.parse_args(Args))
