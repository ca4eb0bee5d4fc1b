"""Scores a model or a checkpoint on the seed study's benchmarks; compares runs; plots
training curves.

Benchmarks (rewards.py holds their data, prompts and graders):
  countdown  a held-out set from the offline generator (seed rewards.COUNTDOWN_EVAL_SEED)
  gsm8k      openai/gsm8k (main, test): the final number against the gold after '####'
  math500    HuggingFaceH4/MATH-500 (test): equivalence checked by HF's math-verify
  bbh        SaylorTwift/bbh, all 27 tasks (test): per task, and over all questions
  mmlu_pro   TIGER-Lab/MMLU-Pro (test): options A-J, per category and overall

Zero-shot chain of thought through the model's chat template, one fixed instruction per
benchmark for where the final answer goes. Generation is batched, greedy by default, with the
KV-cache `generate` of grpo.py (imported, not copied). With --num_samples k --temperature t it
reports the mean accuracy over the k samples and the unbiased pass@k.

Two accuracies, as lm-eval's strict-match and flexible-extract: `strict_accuracy` counts only
answers in the format the instruction asks for (GSM8K: the last \\boxed{} number; MATH-500: a
\\boxed{}; BBH: after "So the answer is"; MMLU-Pro: "The answer is (X)"; Countdown has one
format, so the two agree); `accuracy` (flexible) also reads each extractor's fallbacks (GSM8K's
last number of the text, ...). Both grade truncated completions like any other: the cap
(--max_new_tokens) belongs to the setup, and the `truncated` rate is reported beside them.

Run:
  python evaluate.py --model Qwen2.5-1.5B-Instruct                 # all five, from the Hub
  python evaluate.py --model runs/dapo-…/final --benchmarks gsm8k --limit 200
  python evaluate.py --model tiny --data_dir tests/fixtures/data --limit 5 --max_new_tokens 32
                                                                   # offline CPU smoke run
  python evaluate.py --compare runs/eval-a runs/eval-b             # one table, a column per run
  python evaluate.py --plot runs/grpo-… runs/dapo-…                # training curves, PNG

Writes runs/eval-<benchmarks>-<model>-<time>/: args.json, results.json (per benchmark:
accuracy and strict_accuracy with their 95% confidence intervals, n, mean completion length,
truncation rate, seconds, and per subset), samples.jsonl (every completion: prompt, output,
extracted, gold, correct, strict) and table.md, the markdown table it prints at the end.

Shape letters in comments: N rows of a generation batch (prompts × num_samples) ·
P prompt tokens · T completion tokens.
"""

import json
import math
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from common import (
    PROMPT_FORMAT_HELP,
    append_jsonl,
    arg,
    autocast,
    check_prompt_format,
    load_model,
    make_run_dir,
    parse_args,
    read_jsonl,
    resolve_device,
    resolve_precision,
    seed_everything,
    use_device,
)
from grpo import encode_prompts, generate
from rewards import BENCHMARKS, REWARD_NONE, FileTaskSpec, Score, load_benchmark, load_file_task

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


@dataclass
class Args:
    # what to evaluate
    model: str = arg("Qwen2.5-1.5B-Instruct", "local dir (e.g. runs/<run>/final), Hub id, short name or 'tiny'")
    benchmarks: str = arg("gsm8k,math500,bbh,mmlu_pro,countdown", "comma-separated, any of these five")
    data_dir: str = arg("", "offline: a directory laid out like tests/fixtures/data (gsm8k/test.jsonl, ...); '' = Hub")
    limit: int = arg(0, "problems per benchmark at most, spread over BBH tasks / MMLU-Pro categories; 0 = all")
    countdown_problems: int = arg(500, "size of the held-out Countdown set")
    countdown_numbers: str = arg("3-4", "numbers per Countdown problem, N or MIN-MAX (training and held-out)")
    shots: int = arg(0, "worked examples in each prompt, as earlier turns (countdown, gsm8k); 0 = none")
    prompt_format: str = arg("auto", PROMPT_FORMAT_HELP)
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
    # run
    seed: int = arg(0, "seeds sampling when temperature > 0")
    device: str = arg("auto", "auto, cpu, cuda, cuda:1, ...")
    dtype: str = arg("auto", "auto (bf16 compute on GPU; fp32 on CPU), bfloat16, float32")
    output_dir: str = arg("runs", "results go to <output_dir>/eval-<benchmarks>-<model>-<time>/")
    # other modes
    compare: list[str] = arg([], "eval run dirs (or results.json files) to join into one table")
    plot: list[str] = arg([], "training run dirs whose metrics.jsonl to plot")
    plot_file: str = arg("", "PNG written by --plot; '' = <output_dir>/curves-<time>.png")


def check_args(args: Args) -> list[str]:
    """The benchmark names, or a SystemExit naming every setting that cannot work."""
    names = [name.strip() for name in args.benchmarks.split(",") if name.strip()]
    known = (*BENCHMARKS, "file")  # file: your own data (--data_file or --eval_data_file, --grader)
    problems = [f"--benchmarks: {name!r} is not one of {', '.join(known)}." for name in names if name not in known]
    if "file" in names and not (args.data_file or args.eval_data_file):
        problems.append("--benchmarks file needs --eval_data_file (the problems) or --data_file (its held-out share).")
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
    problems += check_prompt_format(args.prompt_format)
    if args.shots < 0:
        problems.append(f"--shots must be >= 0 (got {args.shots}).")
    if args.limit < 0 or args.grade_timeout <= 0:
        problems.append("--limit must be >= 0 and --grade_timeout > 0.")
    if problems:
        raise SystemExit("Invalid arguments:\n  " + "\n  ".join(problems))
    return names


# ----------------------------------------------------------------------------------------
# Statistics


def wilson_interval(accuracy: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion over n problems (Wilson 1927):
        (p + z²/2n ± z·sqrt(p(1−p)/n + z²/4n²)) / (1 + z²/n).
    Unlike p ± z·sqrt(p(1−p)/n) it stays inside [0, 1] and is not empty at p = 0 or 1. With
    k samples per problem, p is the mean accuracy and n still counts problems: the problems
    are the independent draws, so the interval is, if anything, conservative."""
    denominator = 1 + z * z / n
    center = (accuracy + z * z / (2 * n)) / denominator
    half = z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, Eq. 1):
        1 − C(n−c, k) / C(n, k), the chance that k of the n samples, drawn without
    replacement, include a correct one. Exact integer binomials."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def limit_problems(problems: list[dict], limit: int) -> list[dict]:
    """The first `limit` problems; when problems come in subsets (BBH tasks, MMLU-Pro
    categories), taken round-robin over the subsets so that every subset is represented."""
    if not limit or limit >= len(problems):
        return problems
    by_subset: dict[str, list[dict]] = {}
    for problem in problems:
        by_subset.setdefault(problem["subset"], []).append(problem)
    if len(by_subset) == 1:
        return problems[:limit]
    chosen, position = [], 0
    while len(chosen) < limit:
        chosen += [rows[position] for rows in by_subset.values() if position < len(rows)][: limit - len(chosen)]
        position += 1
    return chosen


# ----------------------------------------------------------------------------------------
# Grading in a worker process


class Grader:
    """Runs a task's grader in a worker process with a hard deadline.

    math-verify bounds its work with SIGALRM, which works only in a main thread, and which
    cannot interrupt a computation inside C (sympy raising 10 to the 10^10^10 holds the
    interpreter). The worker's main thread keeps the alarms working; the deadline here
    catches what they cannot: the worker is killed, a fresh one starts, and the completion
    counts as wrong (and as a grading timeout in results.json)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.pool = None
        self.timeouts = 0

    def score(self, score_fn, completion: str, problem: dict, truncated: bool = False) -> Score:
        if self.pool is None:
            # fork: the worker starts in milliseconds and runs only Python graders (no torch,
            # no CUDA, no tokenizer), so the parent's threads and GPU state are never touched.
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


# ----------------------------------------------------------------------------------------
# One benchmark


def evaluate_benchmark(model, tokenizer, eos_ids, task, problems, args: Args, grader: Grader, samples_path: Path):
    """Generates num_samples completions for every problem, grades them, appends each to
    samples.jsonl, and returns the benchmark's entry of results.json."""
    device = next(model.parameters()).device
    _, compute_dtype = resolve_precision(args.dtype, device)
    k = args.num_samples
    conversations = [task.messages(p) for p in problems]
    # Longest prompts first: batches of similar length waste less padding, and a batch that
    # runs out of memory does so at once, not an hour in.
    order = sorted(range(len(problems)), key=lambda i: -sum(len(m["content"]) for m in conversations[i]))
    correct = [[False] * k for _ in problems]  # [problem][sample], the flexible grade
    strict = [[False] * k for _ in problems]  # [problem][sample], the answer in the asked format only
    lengths, truncations, formatted = [], [], []
    timeouts_before = grader.timeouts
    start = time.perf_counter()
    progress = tqdm(total=len(problems), desc=task.name, unit="problem")
    for first in range(0, len(order), args.batch_size):
        batch = order[first : first + args.batch_size]
        # Encoded exactly as in training: chat template, left padding, each repeated k times.
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [conversations[i] for i in batch], k, device)  # (N, P)
        with autocast(device, compute_dtype):
            completion_ids, completion_mask, truncated, _ = generate(
                model,
                prompt_ids,
                prompt_mask,
                args.max_new_tokens,
                eos_ids,
                tokenizer.pad_token_id,
                len(tokenizer),
                args.temperature,
                args.top_p,
            )  # (N, T), (N, T), (N,)
        row_lengths = completion_mask.sum(-1).tolist()  # (N,) the EOS included
        texts = tokenizer.batch_decode(
            [ids[:length] for ids, length in zip(completion_ids.tolist(), row_lengths)], skip_special_tokens=True
        )
        for row, text in enumerate(texts):
            index, sample = batch[row // k], row % k  # rows i·k … i·k+k−1 belong to problem i
            score = grader.score(task.score, text, problems[index], truncated=bool(truncated[row]))
            correct[index][sample], strict[index][sample] = score.correct, score.strict
            lengths.append(row_lengths[row])
            truncations.append(bool(truncated[row]))
            formatted.append(score.formatted)
            record = {
                "benchmark": task.name,
                "subset": problems[index]["subset"],
                "index": index,
                "sample": sample,
                "prompt": tokenizer.decode(prompt_ids[row][prompt_mask[row].bool()]),  # what the model saw
                "output": text,
                "extracted": score.extracted,
                "gold": problems[index]["gold"],
                "correct": score.correct,
                "strict": score.strict,
                "length": row_lengths[row],
                "truncated": bool(truncated[row]),
            }
            append_jsonl(samples_path, record)
        progress.update(len(batch))
    progress.close()
    result = summarize(correct, strict, [p["subset"] for p in problems])
    result.update(
        {
            "mean_length": sum(lengths) / len(lengths),
            "truncated": sum(truncations) / len(truncations),
            "formatted": sum(formatted) / len(formatted),
            "grade_timeouts": grader.timeouts - timeouts_before,
            "seconds": time.perf_counter() - start,
        }
    )
    return result


def summarize(correct: list[list[bool]], strict: list[list[bool]], subsets: list[str]) -> dict:
    """Accuracy statistics of one benchmark from correct[problem][sample] (the flexible grade)
    and strict[problem][sample] (the answer in the asked format only): mean accuracy and
    strict_accuracy, each with its Wilson 95% interval over problems (ci95, strict_ci95),
    pass@k of the flexible grade for k = 1, 2, 4, … up to the sample count, and per subset
    (BBH task / MMLU-Pro category) both accuracies, n, and their plain means."""
    num_samples = len(correct[0])
    per_problem = [sum(c) / num_samples for c in correct]  # (problems,)
    strict_per_problem = [sum(c) / num_samples for c in strict]  # (problems,)
    accuracy = sum(per_problem) / len(per_problem)
    strict_accuracy = sum(strict_per_problem) / len(strict_per_problem)
    result = {"accuracy": accuracy, "ci95": wilson_interval(accuracy, len(per_problem)), "n": len(per_problem)}
    result["strict_accuracy"] = strict_accuracy
    result["strict_ci95"] = wilson_interval(strict_accuracy, len(strict_per_problem))
    result["num_samples"] = num_samples
    if num_samples > 1:
        k = 1
        while k <= num_samples:
            result[f"pass@{k}"] = sum(pass_at_k(num_samples, sum(c), k) for c in correct) / len(correct)
            k *= 2
        if f"pass@{num_samples}" not in result:
            result[f"pass@{num_samples}"] = sum(any(c) for c in correct) / len(correct)
    if any(subsets):
        groups: dict[str, list[tuple[float, float]]] = {}
        for subset, value, strict_value in zip(subsets, per_problem, strict_per_problem):
            groups.setdefault(subset, []).append((value, strict_value))
        result["subsets"] = {
            name: {
                "accuracy": sum(v for v, _ in values) / len(values),
                "strict_accuracy": sum(s for _, s in values) / len(values),
                "n": len(values),
            }
            for name, values in groups.items()
        }
        result["subset_mean"] = sum(s["accuracy"] for s in result["subsets"].values()) / len(groups)
        result["strict_subset_mean"] = sum(s["strict_accuracy"] for s in result["subsets"].values()) / len(groups)
    return result


# ----------------------------------------------------------------------------------------
# Tables


def percent(value: float) -> str:
    return f"{100 * value:.1f}"


def interval(ci: list[float]) -> str:
    low, high = ci
    return f"{percent(low)}–{percent(high)}"


def results_table(results: dict) -> str:
    """The markdown table of one evaluation: a row per benchmark, then one per subset.
    'accuracy %' is the flexible grade, 'strict %' the answer in the asked format only."""
    pass_keys = sorted(
        {key for r in results.values() for key in r if key.startswith("pass@")}, key=lambda s: int(s[5:])
    )
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
    """One markdown table of several evaluations: columns runs; per benchmark a row of the
    (flexible) accuracy % with its 95% interval and n, then a row '<benchmark> strict' of the
    strict accuracy when a run has one; '–' where a run lacks it (results.json files written
    before strict_accuracy existed). (The Wilson interval is not symmetric around the
    accuracy, so it is shown whole, not as ±.)"""
    runs = [load_results(path) for path in paths]
    names = list(dict.fromkeys(name for _, results in runs for name in results))
    lines = ["| benchmark | " + " | ".join(label for label, _ in runs) + " |", "|---|" + "---|" * len(runs)]
    for name in names:
        for label, key, ci_key in ((name, "accuracy", "ci95"), (f"{name} strict", "strict_accuracy", "strict_ci95")):
            if key == "strict_accuracy" and not any(key in results.get(name, {}) for _, results in runs):
                continue
            cells = []
            for _, results in runs:
                result = results.get(name, {})
                if key not in result:
                    cells.append("–")
                    continue
                cells.append(f"{percent(result[key])} ({interval(result[ci_key])}, n={result['n']})")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Training curves


def plot_curves(run_dirs: list[str], out_file: Path) -> Path:
    """One PNG with a panel per PLOT_PANELS key, a line per training run (its directory
    name), from each run's metrics.jsonl. eval/accuracy, when logged (--eval_every), is
    drawn dashed with markers in the accuracy panel."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    runs = []
    for run_dir in run_dirs:
        metrics = Path(run_dir) / "metrics.jsonl"
        if not metrics.is_file():
            raise SystemExit(f"--plot {run_dir}: no metrics.jsonl there. Pass training run directories (runs/grpo-…).")
        runs.append((Path(run_dir).name, read_jsonl(metrics)))
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for ax, (key, title) in zip(axes.flat, PLOT_PANELS):
        for index, (label, rows) in enumerate(runs):
            color = f"C{index}"
            points = [(row["step"], row[key]) for row in rows if key in row]
            if points:
                ax.plot(*zip(*points), color=color, label=label)
            evaluated = [(row["step"], row["eval/accuracy"]) for row in rows if "eval/accuracy" in row]
            if key == "reward/accuracy" and evaluated:
                ax.plot(*zip(*evaluated), color=color, linestyle="--", marker="o", label=f"{label} (eval)")
        ax.set_title(title)
        ax.set_xlabel("step")
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


def main(args: Args) -> Path | None:
    """Runs the mode the arguments ask for. Returns the eval run directory or the PNG."""
    if args.compare:
        print(compare_table(args.compare))
        return None
    if args.plot:
        out_file = Path(args.plot_file or Path(args.output_dir) / f"curves-{time.strftime('%Y%m%d-%H%M%S')}.png")
        print(f"wrote {plot_curves(args.plot, out_file)}")
        return out_file
    names = check_args(args)
    # Data first: a missing file or column stops the run before the model is loaded.
    tasks = {
        name: load_file_task(FileTaskSpec.from_args(args), "heldout", shots=args.shots)
        if name == "file"
        else load_benchmark(name, args.data_dir, args.countdown_problems, args.shots, args.countdown_numbers)
        for name in names
    }
    device = use_device(resolve_device(args.device))  # a GPU named by --device becomes the current one
    weight_dtype, _ = resolve_precision(args.dtype, device)
    seed_everything(args.seed)
    model, tokenizer, eos_ids = load_model(args.model, device, weight_dtype, prompt_format=args.prompt_format)
    model.eval().requires_grad_(False)
    run_dir = make_run_dir(args, "eval", task="+".join(names))
    settings = {k: getattr(args, k) for k in ("model", "max_new_tokens", "num_samples", "temperature", "top_p")}
    results = {}
    grader = Grader(args.grade_timeout)
    try:
        for name, task in tasks.items():
            problems = limit_problems(task.problems, args.limit)
            results[name] = evaluate_benchmark(
                model, tokenizer, eos_ids, task, problems, args, grader, run_dir / "samples.jsonl"
            )
            # Rewritten after every benchmark: an interrupted run keeps what it finished.
            (run_dir / "results.json").write_text(json.dumps({**settings, "results": results}, indent=2) + "\n")
    finally:
        grader.close()
    table = results_table(results)
    (run_dir / "table.md").write_text(table + "\n")
    print(f"\n{args.model} ({run_dir})\n\n{table}")
    return run_dir


if __name__ == "__main__":
    main(parse_args(Args))
