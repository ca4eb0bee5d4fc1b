"""Tasks: their data, prompts and rule-based rewards, and the tools' environment (docs/tasks.md, docs/tools.md).

A task (`Task`) is a list of problems (dicts), a function turning one into chat messages, and a scorer
of a completion's text, told whether it was cut at max_new_tokens. The scripts and evaluate.py see
only `training_task`, `heldout_task`, `load_task` and `load_benchmark`: a new task touches this file
alone. Tasks: countdown, digit and secret (CPU toys; secret is learnt only by calling its tool), gsm8k,
file (your data, a grader or --reward_fn). Benchmarks: countdown's held-out share, gsm8k, math500, bbh,
mmlu_pro, graded strict and flexibly as lm-eval does. Tools: their parser and runner, and the turns'
environment generate() uses. Model output is untrusted input: parsed with `ast`, never `eval`ed.
"""

import ast
import asyncio
import contextlib
import csv
import functools
import hashlib
import importlib.util
import inspect
import io
import json
import operator
import random
import re
import signal
import sys
import threading
import typing
import weakref
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

import torch
from jinja2 import TemplateError

# ----------------------------------------------------------------------------------------
# Flags: a task's, its reward's and its tools' (a training script's Args extends TaskArgs)


def arg(default, help: str):
    """A field of Args with its --help text, on one line: `lr: float = arg(1e-6, "learning rate")`."""
    metadata = {"help": help.replace("%", "%%")}  # argparse formats help strings with %
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TaskArgs:
    """The flags of the task, its reward and its tools (docs/tasks.md, docs/tools.md)."""

    task: str = arg("countdown", "a task of rewards.py: countdown, digit, secret, gsm8k, or file (--data_file)")
    dataset: str = arg("", "Hub dataset for the task (Jiayi-Pan/Countdown-Tasks-3to4); '' = offline generator")
    data_dir: str = arg("", "gsm8k offline: a directory holding gsm8k/train.jsonl and gsm8k/test.jsonl; '' = the Hub")
    num_problems: int = arg(20000, "problems drawn from the offline Countdown generator")
    countdown_numbers: str = arg("3-4", "numbers per Countdown problem, N or MIN-MAX (training and held-out)")
    shots: int = arg(0, "worked examples in each prompt, as earlier turns (countdown, gsm8k); 0 = none")
    # your own task (--task file), your own reward
    data_file: str = arg("", "--task file: a .jsonl/.json/.csv/.parquet file or a Hub dataset id (owner/name[:config])")
    data_split: str = arg("train", "--task file: the split of a Hub dataset (or the key of a JSON file) to train on")
    prompt_key: str = arg("prompt", "--task file: the column of the prompt (a text, or a list of chat messages)")
    answer_key: str = arg("answer", "--task file: the column of the reference answer")
    grader: str = arg("math", "--task file: math (math-verify), number, choice (A-J), exact, countdown (nums, target)")
    system_prompt: str = arg("", "--task file: a system message before each prompt; '' = none")
    instruction: str = arg("auto", "--task file: appended to each prompt; auto = the grader's own, '' = none")
    eval_data_file: str = arg("", "--task file: held-out problems (a file or Hub id); '' = 1 row in 10 of --data_file")
    eval_data_split: str = arg("test", "--task file: the split of --eval_data_file when it is a Hub dataset")
    reward_fn: str = arg("", "your reward: module:function or file.py:function, called (completion, row, truncated)")
    reward_fn_timeout: float = arg(10.0, "seconds a --reward_fn call may take; past it, or raising: reward 0, counted")
    # tools to call
    tools: str = arg("", "built-in tools, comma separated: calculator; '' = none (the task's own still apply)")
    tool: str = arg("", "your tools: module:function or file.py:function (type hints, docstring), comma separated")
    max_turns: int = arg(4, "tool turns a completion may take; a call past them ends it")
    max_tool_tokens: int = arg(256, "tokens one tool turn adds (answers cut to fit); not in --max_new_tokens")
    tool_timeout: float = arg(10.0, "seconds a tool call may take; past it, or raising: the error is its answer")
    tool_workers: int = arg(1, "calls run at once, beside the decode; 1 keeps the rows' order (seeded draws)")


# Reward levels (TinyZero's scheme; the DAPO paper uses ±1 instead).
REWARD_CORRECT = 1.0  # the answer is right
REWARD_FORMAT = 0.1  # well-formed (right tags, a parseable answer) but wrong
REWARD_NONE = 0.0  # anything else: missing or repeated tags, text outside them, garbage

# Bounds on a Countdown answer: generous for 4 numbers, small enough to keep the verifier quick.
MAX_EXPRESSION_CHARS = 100
MAX_EXPRESSION_DEPTH = 12  # 4 numbers need 3 operators; parentheses don't add AST depth
MAX_LITERAL = 10**6
ALLOWED_CHARS = frozenset("0123456789+-*/() ")
# One problem in this many, by a hash of it, is held out for evaluation (Countdown's and a file's).
HELDOUT_SHARE = 10


@dataclass
class Score:
    reward: float  # the training reward (REWARD_CORRECT / REWARD_FORMAT / REWARD_NONE)
    correct: bool  # the answer solves the problem (a benchmark's flexible grade: its fallbacks too)
    formatted: bool  # the completion follows the task's answer format
    extracted: str | None = None  # the answer as read from the completion (None: none found)
    strict: bool | None = None  # correct, read only where the instruction asks (lm-eval); None: = correct
    failed: bool = False  # --reward_fn raised, ran past its time or returned no number: reward 0

    def __post_init__(self):
        if self.strict is None:
            self.strict = self.correct


@dataclass
class Task:
    name: str
    problems: list[dict]
    messages: Callable[[dict], list[dict]]  # problem -> chat messages for apply_chat_template
    score: Callable[[str, dict, bool], Score]  # (completion, problem, truncated: cut with no EOS)
    tools: list[Callable] = field(default_factory=list)  # callable in a rollout: the task's, then --tool(s)'


# ----------------------------------------------------------------------------------------
# Countdown: data, prompt and verifier

# Exact arithmetic, the generator's and the verifier's: an operator's AST node -> its operation on fractions
OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
OPERATORS = dict(zip("+-*/", OPERATIONS))  # written -> node
COUNTDOWN_NUMBERS = "3-4"  # the seed study's problems: 3 or 4 numbers
COUNTDOWN_MAX_NUMBERS = 6
COUNTDOWN_MAX_NUMBER, COUNTDOWN_MAX_TARGET = 99, 100  # numbers in [1, 99], targets in [1, 100]


def random_expression(numbers: list[int], rng: random.Random) -> tuple[str, Fraction] | None:
    """The numbers in random order joined by random operators: (text, exact value); None on a division by 0."""
    pool = [(str(n), Fraction(n)) for n in numbers]
    rng.shuffle(pool)
    while len(pool) > 1:
        (left_text, left), (right_text, right) = pool.pop(), pool.pop()
        op = rng.choice("+-*/")
        if op == "/" and right == 0:
            return None
        pool.append((f"({left_text} {op} {right_text})", OPERATIONS[OPERATORS[op]](left, right)))
        rng.shuffle(pool)
    text, value = pool[0]
    return text[1:-1], value  # drop the outermost parentheses


def is_heldout(text: str) -> bool:
    """Whether a problem (its text) is in the held-out share: a fixed residue class of its hash."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % HELDOUT_SHARE == 0


def is_heldout_countdown(numbers: list[int], target: int) -> bool:
    """The same problem in any order, from any seed, falls on the same side: no training set holds it."""
    return is_heldout(f"{sorted(numbers)} {target}")


def generate_countdown(n: int, seed: int, min_numbers: int = 3, max_numbers: int = 4, heldout: bool = False):
    """n solvable problems {"nums", "target", "solution"} from seed: numbers drawn, then a random
    expression over them whose value is a whole target in range (the witness). heldout: from the held-out share."""
    rng = random.Random(seed)
    problems = []
    while len(problems) < n:
        numbers = [rng.randint(1, COUNTDOWN_MAX_NUMBER) for _ in range(rng.randint(min_numbers, max_numbers))]
        solution, value = random_expression(numbers, rng) or ("", Fraction(0))  # a division by 0: a new draw
        if value.denominator != 1 or not 1 <= value <= COUNTDOWN_MAX_TARGET:
            continue
        if is_heldout_countdown(numbers, int(value)) == heldout:
            problems.append({"nums": numbers, "target": int(value), "solution": solution})
    return problems


def countdown_sizes(text: str) -> tuple[int, int]:
    """--countdown_numbers as typed, 'N' or 'MIN-MAX', -> (min, max) numbers per problem."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 2 <= low <= high <= COUNTDOWN_MAX_NUMBERS:
        raise SystemExit(
            f"--countdown_numbers {text!r}: give how many numbers a Countdown problem has, N or MIN-MAX, "
            f"between 2 and {COUNTDOWN_MAX_NUMBERS} (the seed study's is {COUNTDOWN_NUMBERS})."
        )
    return low, high


COUNTDOWN_SYSTEM = "You are a careful assistant. First reason about the problem step by step, then give the answer."
COUNTDOWN_USER = (
    "Reach the target {target} with the numbers {nums}. Combine them with +, -, * and / "
    "and parentheses; every number must be used exactly once. Reason inside <think> </think>, "
    "then write just the equation, without '= {target}', inside <answer> </answer>. "
    "Example of the format: <think> ... </think> <answer> (7 - 3) * 5 </answer>"
)


def countdown_messages(problem: dict) -> list[dict]:
    user = COUNTDOWN_USER.format(target=problem["target"], nums=problem["nums"])
    return [{"role": "system", "content": COUNTDOWN_SYSTEM}, {"role": "user", "content": user}]


def extract_answer(completion: str) -> str | None:
    """The text inside <answer> … </answer> when the completion is exactly `<think> … </think> <answer>
    … </answer>` (whitespace around), else None: looser rules are what format hacking exploits."""
    text = completion.strip()
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        if text.count(tag) != 1:
            return None
    think_end, answer_start = text.index("</think>"), text.index("<answer>")
    if not (text.startswith("<think>") and text.endswith("</answer>") and think_end < answer_start):
        return None
    if text[think_end + len("</think>") : answer_start].strip():
        return None  # text between the two blocks
    return text[answer_start + len("<answer>") : -len("</answer>")].strip()


def read_expression(expression: str, decimals: bool = False) -> tuple[ast.AST, list[int]]:
    """Whole numbers, + - * / and parentheses: (tree, literals), or a ValueError saying what is wrong.
    decimals (the calculator's, not Countdown's): decimal numbers too, each read exactly (a Fraction of
    its digits, on the node as .exact), and a sign before a number or a parenthesis."""
    if not expression:
        raise ValueError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    others = "".join(sorted(set(expression) - ALLOWED_CHARS - ({"."} if decimals else set())))  # '**' below
    if others:
        numbers = "numbers" if decimals else "digits"
        raise ValueError(f"only {numbers}, + - * /, parentheses and spaces may be written, not: {' '.join(others)}")
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError as error:  # includes leading zeros ('07') and unbalanced parentheses
        raise ValueError("not a complete expression (a parenthesis or a number missing, or a leading 0)") from error
    literals = []

    def check(node: ast.AST, depth: int) -> None:
        if depth > MAX_EXPRESSION_DEPTH:
            raise ValueError(f"more than {MAX_EXPRESSION_DEPTH} operations nested in one another")
        if isinstance(node, ast.Constant):
            if type(node.value) is not int and not (decimals and type(node.value) is float):  # a bool: not int
                raise ValueError("only whole numbers may be written")
            if not 0 <= node.value <= MAX_LITERAL:
                raise ValueError(f"{node.value} is above {MAX_LITERAL}, the largest number allowed")
            if decimals:  # "0.1" is 1/10, where the float 0.1 is not
                node.exact = Fraction(ast.get_source_segment(expression, node))
            literals.append(node.value)
        elif isinstance(node, ast.BinOp) and type(node.op) in OPERATIONS:
            check(node.left, depth + 1)
            check(node.right, depth + 1)
        elif isinstance(node, ast.BinOp):  # Pow, FloorDiv; Mod's '%' is not an allowed character
            raise ValueError("only + - * / are operators here (not ** or //)")
        elif isinstance(node, ast.UnaryOp) and decimals and isinstance(node.op, ast.USub | ast.UAdd):
            check(node.operand, depth + 1)
        elif isinstance(node, ast.UnaryOp):
            raise ValueError("no sign before a number or a parenthesis (unary minus): write 0 - 5 for -5")
        else:  # a tuple '()', a comparison, ...
            raise ValueError("not arithmetic: write numbers joined by + - * / and parentheses")

    check(tree, 0)
    return tree, literals


def evaluate_expression(tree: ast.AST) -> Fraction:
    """The exact value of a tree read_expression accepted. Raises ZeroDivisionError."""
    if isinstance(tree, ast.Constant):
        return getattr(tree, "exact", None) or Fraction(tree.value)
    if isinstance(tree, ast.UnaryOp):
        value = evaluate_expression(tree.operand)
        return -value if isinstance(tree.op, ast.USub) else value
    return OPERATIONS[type(tree.op)](evaluate_expression(tree.left), evaluate_expression(tree.right))


def countdown_score(completion: str, problem: dict, truncated: bool = False) -> Score:
    """1.0 correct, 0.1 well-formed (the tags, an allowed expression) but wrong, else 0.0. Correct: the
    given numbers (a multiset), the target exactly. A completion cut before `</answer>` already scores 0."""
    answer = extract_answer(completion)
    try:
        tree, literals = read_expression(answer or "")  # None or "": "the expression is empty"
    except ValueError:
        return Score(REWARD_NONE, correct=False, formatted=False, extracted=answer)
    if sorted(literals) != sorted(problem["nums"]):
        return Score(REWARD_FORMAT, correct=False, formatted=True, extracted=answer)
    try:
        correct = evaluate_expression(tree) == problem["target"]
    except ZeroDivisionError:
        correct = False
    return Score(REWARD_CORRECT if correct else REWARD_FORMAT, correct=correct, formatted=True, extracted=answer)


# ----------------------------------------------------------------------------------------
# Few-shot prompts: worked examples as earlier turns, from training data only (their own seed, GSM8K's train).

COUNTDOWN_SHOTS_SEED = 314_159_265
NO_SHOTS = "--shots is for countdown and gsm8k; {} has no worked examples: drop --shots."
CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: 48/2 = <<48/2=24>>24


def countdown_worked(problem: dict) -> str:
    """A Countdown problem's answer in the strict format, from its witness (its "solution")."""
    return f"<think> {problem['solution']} = {problem['target']} </think> <answer> {problem['solution']} </answer>"


def with_examples(messages: Callable[[dict], list[dict]], examples: list[tuple[dict, str]]):
    """messages with the worked examples as turns before the last user message; no examples: messages."""
    if not examples:
        return messages

    def few_shot(problem: dict) -> list[dict]:
        *head, question = messages(problem)
        turns = []
        for example, answer in examples:
            turns += [messages(example)[-1], {"role": "assistant", "content": answer}]
        return [*head, *turns, question]

    return few_shot


def task_examples(name: str, shots: int, countdown_numbers: str = COUNTDOWN_NUMBERS, data_dir: str = ""):
    """--shots worked (problem, answer) pairs; GSM8K's answer: its solution, ending 'The answer is \\boxed{gold}.'."""
    if shots < 0:
        raise SystemExit(f"--shots {shots}: the number of worked examples in each prompt must be >= 0.")
    if not shots:
        return []
    if name == "countdown":
        problems = generate_countdown(shots, COUNTDOWN_SHOTS_SEED, *countdown_sizes(countdown_numbers))
        return [(p, countdown_worked(p)) for p in problems]
    if name != "gsm8k":
        raise SystemExit(NO_SHOTS.format(name))
    rows = benchmark_rows(data_dir, "gsm8k/train.jsonl", "openai/gsm8k", "main", "train", {"question", "answer"})
    examples = []
    for row in rows[:shots]:
        steps, gold = CALCULATOR.sub("", row["answer"].split("####")[0]).strip(), gsm8k_gold(row["answer"])
        examples.append(({"question": row["question"], "gold": gold}, f"{steps}\nThe answer is \\boxed{{{gold}}}."))
    return examples


# ----------------------------------------------------------------------------------------
# The CPU toys. digit: a digit first. secret (tool use): a tool draws the digit to say at each call,
# so the only way to the reward is to call it and copy its answer.

DIGIT_PROMPTS = [
    "Reply with a single digit.",
    "Say one digit, nothing else.",
    "Pick a digit from 0 to 9.",
    "Answer with a digit.",
]


def digit_messages(problem: dict) -> list[dict]:
    return [{"role": "user", "content": problem["prompt"]}]


def digit_score(completion: str, problem: dict, truncated: bool = False) -> Score:
    """1.0 when the first character is an ASCII digit: the first token decides, so E[reward] has a closed form."""
    hit = completion[:1] in set("0123456789")
    return Score(REWARD_CORRECT if hit else REWARD_NONE, correct=hit, formatted=hit)


SECRET_PROMPTS = [
    "What is the secret digit? Call the tool, then reply with the digit alone.",
    "Call the tool to learn the secret digit, then say that digit and nothing else.",
    "The secret digit changes every time. Ask the tool for it, then reply with it alone.",
    "Find the secret digit with the tool and answer with the digit only.",
]
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def secret_digit() -> str:
    """Tells the secret digit, drawn anew at every call.

    Returns:
        The secret digit, one character from 0 to 9.
    """
    # Python's own generator, which seed_everything seeds from --seed: a run draws the same digits again.
    return str(random.randint(0, 9))


def secret_score(completion: str, problem: dict, truncated: bool = False) -> Score:
    """1.0 when the first digit after the last tool answer (Qwen's <tool_response>…</tool_response>) is its
    digit, 0.1 for a call and another digit, 0.0 without both; a call alone earns nothing (docs/tools.md)."""
    close = completion.rfind(TOOL_RESPONSE_CLOSE)
    start = completion.rfind(TOOL_RESPONSE_OPEN, 0, close) if close >= 0 else -1
    if start < 0:
        return Score(REWARD_NONE, correct=False, formatted=False)
    answer = completion[start + len(TOOL_RESPONSE_OPEN) : close].strip()
    after = completion[close + len(TOOL_RESPONSE_CLOSE) :]
    reply = next((character for character in after if character in "0123456789"), None)
    hit = len(answer) == 1 and answer in "0123456789" and reply == answer
    reward = REWARD_CORRECT if hit else REWARD_FORMAT if reply is not None else REWARD_NONE
    return Score(reward, correct=hit, formatted=reply is not None, extracted=reply)


# ----------------------------------------------------------------------------------------
# Benchmarks: data. From the Hugging Face Hub by default; offline from --data_dir, laid out as
# tests/fixtures/data: gsm8k/{train,test}.jsonl, math500/test.jsonl, bbh/<task>.json, mmlu_pro/sample.jsonl.

BENCHMARKS = ("countdown", "gsm8k", "math500", "bbh", "mmlu_pro")
COUNTDOWN_EVAL_SEED = 982_451_653  # drawn from the held-out share, which no training set holds
BBH_SUBSETS = (
    "boolean_expressions", "causal_judgement", "date_understanding", "disambiguation_qa", "dyck_languages",
    "formal_fallacies", "geometric_shapes", "hyperbaton", "logical_deduction_five_objects",
    "logical_deduction_seven_objects", "logical_deduction_three_objects", "movie_recommendation",
    "multistep_arithmetic_two", "navigate", "object_counting", "penguins_in_a_table", "reasoning_about_colored_objects",
    "ruin_names", "salient_translation_error_detection", "snarks", "sports_understanding", "temporal_sequences",
    "tracking_shuffled_objects_five_objects", "tracking_shuffled_objects_seven_objects",
    "tracking_shuffled_objects_three_objects", "web_of_lies", "word_sorting",
)  # fmt: skip
MMLU_PRO_LETTERS = "ABCDEFGHIJ"
HUB_HINT = "or run offline with --data_dir <dir> (laid out as tests/fixtures/data)."
DATA_DIR_HINT = (
    "Lay the directory out like tests/fixtures/data (docs/evaluation.md), or drop --data_dir to load from the Hub."
)


def load_hub_rows(name: str, config: str | None, split: str, columns: set[str], hint: str = HUB_HINT) -> list[dict]:
    """A Hub dataset split as row dicts, checked to have `columns` and rows; `hint`: what else to do."""
    import datasets

    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # datasets raises many types (connection, 404, auth); all fatal here
        raise SystemExit(
            f"Could not load {name!r} (config {config!r}, split {split!r}) from the Hugging Face Hub: "
            f"{type(error).__name__}: {error}\n"
            f"Check the internet connection; {hint}"
        ) from error
    missing = columns - set(rows.column_names)
    if missing:
        raise SystemExit(
            f"Dataset {name!r} ({split}) lacks the column(s) {sorted(missing)}; it has {rows.column_names}."
        )
    if len(rows) == 0:
        raise SystemExit(f"Dataset {name!r} (config {config!r}, split {split!r}) holds no rows.")
    return rows.to_list()


def benchmark_rows(data_dir: str, relative: str, name: str, config: str | None, split: str, columns: set[str]):
    """The rows of --data_dir/<relative> when data_dir is set, else of the Hub dataset."""
    if data_dir:
        return read_data_file(data_dir, relative, columns)
    return load_hub_rows(name, config, split, columns)


def read_data_file(data_dir: str, relative: str, columns: set[str]) -> list[dict]:
    """Rows of --data_dir/<relative>: JSON lines, or BBH's {"examples": [...]} JSON file."""
    path = Path(data_dir) / relative
    if not path.is_file():
        raise SystemExit(f"--data_dir {data_dir}: {relative} is missing ({path}). {DATA_DIR_HINT}")
    if path.suffix == ".jsonl":
        rows = jsonl_rows(path, str(path))
    else:
        content = json_value(data_text(path), str(path))
        if not isinstance(content, dict) or "examples" not in content:
            raise SystemExit(f"{path}: expected a JSON object with an 'examples' list (the BIG-Bench-Hard layout).")
        rows = content["examples"]
    if not rows:
        raise SystemExit(f"--data_dir {data_dir}: {relative} holds no rows ({path}).")
    for number, row in enumerate(rows, start=1):
        missing = columns - set(row)
        if missing:
            raise SystemExit(f"{path}: row {number} lacks the field(s) {sorted(missing)}; it has {sorted(row)}.")
    return rows


def load_gsm8k(split: str, data_dir: str = "") -> list[dict]:
    """openai/gsm8k (config main): {"question", "gold", "subset"}, gold the number after '####'."""
    rows = benchmark_rows(data_dir, f"gsm8k/{split}.jsonl", "openai/gsm8k", "main", split, {"question", "answer"})
    problems = []
    for number, row in enumerate(rows, start=1):
        gold = gsm8k_gold(row["answer"])
        if gold is None:
            raise SystemExit(f"gsm8k {split} row {number}: the answer has no '#### <number>' line.")
        problems.append({"question": row["question"], "gold": gold, "subset": ""})
    return problems


def gsm8k_gold(solution: str) -> str | None:
    """The text after a GSM8K solution's last '####', thousands separators dropped; None without one."""
    return solution.rsplit("####", 1)[1].strip().replace(",", "") if "####" in solution else None


def load_math500(data_dir: str = "") -> list[dict]:
    """HuggingFaceH4/MATH-500 (test): {"question", "gold", "subset"}; gold is the `answer` field."""
    rows = benchmark_rows(data_dir, "math500/test.jsonl", "HuggingFaceH4/MATH-500", None, "test", {"problem", "answer"})
    return [{"question": row["problem"], "gold": row["answer"], "subset": ""} for row in rows]


def load_bbh(data_dir: str = "") -> list[dict]:
    """The 27 BIG-Bench-Hard tasks from SaylorTwift/bbh (lukaemon/bbh no longer loads): subset = the task."""
    problems = []
    for subset in BBH_SUBSETS:
        rows = benchmark_rows(data_dir, f"bbh/{subset}.json", "SaylorTwift/bbh", subset, "test", {"input", "target"})
        problems += [{"question": row["input"], "gold": row["target"], "subset": subset} for row in rows]
    return problems


def load_mmlu_pro(data_dir: str = "") -> list[dict]:
    """TIGER-Lab/MMLU-Pro (test): {"question", "options" (A-J; "N/A" padding dropped), "gold", "subset"}."""
    columns = {"question", "options", "answer", "category"}
    rows = benchmark_rows(data_dir, "mmlu_pro/sample.jsonl", "TIGER-Lab/MMLU-Pro", None, "test", columns)
    problems = []
    for number, row in enumerate(rows, start=1):
        options = list(row["options"])
        while options and options[-1] == "N/A":
            options.pop()
        answer = row["answer"]
        if len(options) > len(MMLU_PRO_LETTERS) or answer not in tuple(MMLU_PRO_LETTERS[: len(options)]):
            raise SystemExit(f"mmlu_pro row {number}: answer {answer!r} is not one of its {len(options)} options.")
        problems.append({"question": row["question"], "options": options, "gold": answer, "subset": row["category"]})
    return problems


# Prompts: zero-shot chain of thought, an instruction saying where the final answer goes.
BOXED_NUMBER_INSTRUCTION = "Solve the problem step by step. Then write the final answer, a number only, in \\boxed{}."
BOXED_MATH_INSTRUCTION = "Solve the problem step by step. Then write the final answer, in simplest form, in \\boxed{}."
BBH_INSTRUCTION = (
    'Think it through step by step. End with the sentence "So the answer is X.", where X is the '
    "answer alone (for a multiple-choice question, its option label such as (A))."
)
MMLU_PRO_INSTRUCTION = (
    'Think it through step by step. End with the sentence "The answer is (X).", where X is the '
    "letter of the correct option."
)


def instructed(instruction: str) -> Callable[[dict], list[dict]]:
    """problem -> one user message: its question, a blank line, the instruction."""
    return lambda problem: [{"role": "user", "content": f"{problem['question']}\n\n{instruction}"}]


gsm8k_messages = instructed(BOXED_NUMBER_INSTRUCTION)
math500_messages = instructed(BOXED_MATH_INSTRUCTION)
bbh_messages = instructed(BBH_INSTRUCTION)


def mmlu_pro_messages(problem: dict) -> list[dict]:
    options = "\n".join(f"({letter}) {option}" for letter, option in zip(MMLU_PRO_LETTERS, problem["options"]))
    return [{"role": "user", "content": f"{problem['question']}\n\nOptions:\n{options}\n\n{MMLU_PRO_INSTRUCTION}"}]


# ----------------------------------------------------------------------------------------
# Benchmarks: answer extraction, where the instruction says first, then where models commonly put it.
# Linear-time scans and regexes without nested quantifiers: completions are untrusted input.

MAX_NUMBER_CHARS = 40  # longer digit strings are no answer (and int() refuses > 4300 digits)
# 1,234.5 or 1234.5 or -7; a '-' after a letter, digit or '.' is a hyphen ('5-3', '2024-2025')
NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# LaTeX digit grouping: 1{,}234 · 1,\!234 · 1\,234 · 1 234 (removed before reading a boxed number)
DIGIT_GROUPING = re.compile(r"\{,\}|\\!|\\,|(?<=\d) +(?=\d)")
ANSWER_IS = re.compile(r"(?i:answer is)\s*:?\s*")
# one character class after the phrase: adjacent \s* runs backtrack polynomially on long whitespace
ANSWER_IS_LETTER = re.compile(r"(?i:answer is)[\s:*]*\(?([A-J])\)?(?![A-Za-z])")  # The answer is (C)
LETTER_PATTERNS = (  # in order of trust; the last match of the first pattern that matches wins
    ANSWER_IS_LETTER,  # what MMLU_PRO_INSTRUCTION asks for (markdown such as **C** allowed)
    re.compile(r"(?i:answer)\s*:[\s*]*\(?([A-J])\)?(?![A-Za-z])"),  # Answer: C
    re.compile(r"\\boxed\{\s*(?:\\text\{)?\(?([A-J])\)?\}?\s*\}"),  # \boxed{C}
)
MATH_DELIMITERS = ("", "$", "$$", "\\[", "\\]", "\\(", "\\)")  # lines that hold no answer
BBH_CHOICE = re.compile(r"\(([A-R])\)")  # BBH's multiple-choice golds: (A) … (R)
BBH_NUMBER_GOLD = re.compile(r"-?\d+(?:\.\d+)?")  # object counting, multistep arithmetic: '3', '-123'
BBH_YES_NO_GOLDS = ("yes", "no", "true", "false", "valid", "invalid")  # compared by the answer's first word
TEXT_COMMAND = re.compile(r"\\text(?:bf)?\{([^{}]*)\}")  # \text{Yes}, \textbf{Yes} -> Yes
BBH_LABEL = re.compile(r"\(?([A-R])\)?(?![A-Za-z0-9])")  # the label an answer starts with: '(C)', 'C.'
# further labels anywhere in the answer: '(B)', or a bare letter listed after ',', '/', 'or', 'and'
BBH_MORE_LABELS = re.compile(r"\(([A-R])\)|(?:,|/|\bor\b|\band\b)\s*\(?([A-R])\)?(?![A-Za-z0-9])")


def extract_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{…} (or \\fbox{…}), braces balanced; None: none, or unclosed."""
    matches = list(BOXED.finditer(text))
    if not matches:
        return None
    depth, begin = 1, matches[-1].end()
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in the text, thousands separators removed ('1,234.5' -> '1234.5')."""
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_boxed_number(text: str) -> str | None:
    """The last number inside the last \\boxed{}, LaTeX digit grouping removed ('1{,}234' -> '1234')."""
    boxed = extract_boxed(text)
    return None if boxed is None else extract_last_number(DIGIT_GROUPING.sub("", boxed))


def extract_gsm8k_answer(text: str) -> str | None:
    """The last number in the last \\boxed{}; else on the last 'answer is' line, the number after its
    last '=', or its first; else the last number of the text ('#### 18')."""
    if (number := extract_boxed_number(text)) is not None:
        return number
    matches = list(ANSWER_IS.finditer(text))
    if matches:
        line = text[matches[-1].end() :].split("\n", 1)[0]
        number = NUMBER.search(line.rsplit("=", 1)[-1])  # the whole line when it has no '='
        if number is not None:
            return number.group().replace(",", "")
    return extract_last_number(text)


def numbers_equal(answer: str | None, gold: str) -> bool:
    """Exact numeric equality ('18.00' == '18'), by Fraction, never float."""
    if answer is None or len(answer) > MAX_NUMBER_CHARS or len(gold) > MAX_NUMBER_CHARS:
        return False
    try:
        return Fraction(answer.replace(",", "")) == Fraction(gold.replace(",", ""))
    except (ValueError, ZeroDivisionError):  # not a number at all
        return False


def extract_bbh_answer(text: str) -> str | None:
    """BBH's 'So the answer is X.': after the last 'answer is', its last \\boxed{}, else its first line
    that is not just a math delimiter ('$$'); with no phrase, a \\boxed{} anywhere. \\text{X} reads X;
    markdown, quotes and the final period are stripped. None: no phrase and no box, or nothing left."""
    matches = list(ANSWER_IS.finditer(text))
    if matches:
        rest = text[matches[-1].end() :]
        answer = extract_boxed(rest)
        if answer is None:
            lines = (line.strip() for line in rest.split("\n"))
            answer = next((line for line in lines if line not in MATH_DELIMITERS), "")
    else:
        answer = extract_boxed(text)
        if answer is None:
            return None
    answer = TEXT_COMMAND.sub(r"\1", answer)
    for _ in range(2):  # '**valid**.' and '**valid.**' both read 'valid'
        answer = answer.strip()
        answer = answer[:-1] if answer.endswith(".") else answer
        answer = answer.strip("*`\"'$ ")
    return answer or None


def bbh_correct(answer: str | None, gold: str) -> bool:
    """A choice gold '(C)': the answer's leading label, no other named (a hedge is wrong); a number gold:
    the answer's last number (LaTeX dropped); yes/no: its first word; else the whole text, case and spaces aside."""
    if answer is None:
        return False
    choice = BBH_CHOICE.fullmatch(gold.strip())
    if choice:
        label = BBH_LABEL.match(answer)
        named = {first or listed for first, listed in BBH_MORE_LABELS.findall(answer)}
        return label is not None and named | {label.group(1)} == {choice.group(1)}
    if BBH_NUMBER_GOLD.fullmatch(gold.strip()):
        plain = answer.replace("\\(", "").replace("\\)", "").replace("$", "").replace("\u2212", "-")
        return numbers_equal(extract_last_number(plain), gold.strip())
    if gold.strip().casefold() in BBH_YES_NO_GOLDS:
        first_word = re.match(r"[A-Za-z]+", answer)
        return first_word is not None and first_word.group().casefold() == gold.strip().casefold()
    return " ".join(answer.split()).casefold() == " ".join(gold.split()).casefold()


def extract_choice_letter(text: str) -> str | None:
    """The option letter A-J: the last 'answer is (X)', else 'Answer: X', else \\boxed{X}; else None."""
    for pattern in LETTER_PATTERNS:
        letters = pattern.findall(text)
        if letters:
            return letters[-1]
    return None


# ----------------------------------------------------------------------------------------
# Benchmarks: graders. `strict`: the answer where the instruction asks (lm-eval's strict-match); `correct`:
# the fallbacks too (flexible-extract). `reward` (graded): 1.0 strict, 0.1 formatted, else 0; 0 when truncated.

MATH_VERIFY_TIMEOUT_S = 5  # seconds math-verify may spend on one parse or one comparison


def graded(correct: bool, strict: bool, formatted: bool, extracted: str | None, truncated: bool) -> Score:
    reward = REWARD_NONE if truncated else REWARD_CORRECT if strict else REWARD_FORMAT if formatted else REWARD_NONE
    return Score(reward, correct=correct, formatted=formatted, extracted=extracted, strict=strict)


def gsm8k_reward(completion: str, problem: dict, truncated: bool = False) -> Score:
    """GSM8K's training reward: 1.0 when the boxed number is the gold, 0.1 when not, 0 without one or
    when truncated. Not the fallbacks: they credit rambling to the token cap (docs/tasks.md)."""
    boxed = extract_boxed_number(completion)
    formatted = boxed is not None and not truncated
    correct = formatted and numbers_equal(boxed, problem["gold"])
    return graded(correct, correct, formatted, boxed, truncated)


def gsm8k_score(completion: str, problem: dict, truncated: bool = False) -> Score:
    """GSM8K's grade. strict: the boxed number is the gold; correct: extract_gsm8k_answer's; gsm8k_reward's reward."""
    answer = extract_gsm8k_answer(completion)
    boxed = extract_boxed_number(completion)
    correct, strict = numbers_equal(answer, problem["gold"]), numbers_equal(boxed, problem["gold"])
    return graded(correct, strict, boxed is not None, answer, truncated)


def math500_score(
    completion: str, problem: dict, truncated: bool = False, *, timeout_s: int = MATH_VERIFY_TIMEOUT_S
) -> Score:
    """math-verify's equivalence of \\boxed{gold} and the last \\boxed{} (else the whole completion: not
    strict). Its SIGALRM bounds each step to timeout_s: call it from the main thread."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold = parse(f"\\boxed{{{problem['gold']}}}", extraction_config=config, parsing_timeout=timeout_s)
    boxed = extract_boxed(completion)
    answer = completion if boxed is None else f"\\boxed{{{boxed}}}"
    predicted = parse(answer, extraction_config=config, parsing_timeout=timeout_s)
    correct = bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=timeout_s)
    extracted = predicted[-1] if predicted and isinstance(predicted[-1], str) else None
    if predicted and extracted is None:
        extracted = str(predicted[0])
    return graded(correct, correct and boxed is not None, boxed is not None, extracted, truncated)


def bbh_score(completion: str, problem: dict, truncated: bool = False) -> Score:
    """strict: the answer after the last "answer is"; correct also reads a lone \\boxed{} (extract_bbh_answer)."""
    answer = extract_bbh_answer(completion)
    phrase = ANSWER_IS.search(completion) is not None  # then extract_bbh_answer read after it
    correct = bbh_correct(answer, problem["gold"])
    return graded(correct, phrase and correct, phrase and answer is not None, answer, truncated)


def mmlu_pro_score(completion: str, problem: dict, truncated: bool = False) -> Score:
    """strict: the letter of the last "answer is (X)"; correct: extract_choice_letter's (its fallbacks too)."""
    letter = extract_choice_letter(completion)
    phrase_letters = ANSWER_IS_LETTER.findall(completion)
    strict_letter = phrase_letters[-1] if phrase_letters else None  # = letter when not None
    gold = problem["gold"]
    return graded(letter == gold, strict_letter == gold, strict_letter is not None, letter, truncated)


def load_benchmark(
    name: str,
    data_dir: str = "",
    countdown_problems: int = 500,
    shots: int = 0,
    countdown_numbers: str = COUNTDOWN_NUMBERS,
) -> Task:
    """A benchmark's problems ("gold", "subset"), prompt and grader; shots, countdown_numbers as load_task's."""
    if name == "countdown":
        sizes = countdown_sizes(countdown_numbers)
        problems = [
            {**p, "gold": f"{p['solution']} = {p['target']}", "subset": ""}
            for p in generate_countdown(countdown_problems, COUNTDOWN_EVAL_SEED, *sizes, heldout=True)
        ]
        messages = with_examples(countdown_messages, task_examples(name, shots, countdown_numbers))
        return Task(name, problems, messages, countdown_score)
    if name == "gsm8k":
        messages = with_examples(gsm8k_messages, task_examples(name, shots, data_dir=data_dir))
        return Task(name, load_gsm8k("test", data_dir), messages, gsm8k_score)
    if shots:
        raise SystemExit(NO_SHOTS.format(name))
    if name == "digit":  # its own prompts (nothing is held out): smoke runs, the tiny study
        problems = [{**p, "gold": "a digit", "subset": ""} for p in load_task(name).problems[:countdown_problems]]
        return Task(name, problems, digit_messages, digit_score)
    if name == "math500":
        return Task(name, load_math500(data_dir), math500_messages, math500_score)
    if name == "bbh":
        return Task(name, load_bbh(data_dir), bbh_messages, bbh_score)
    if name == "mmlu_pro":
        return Task(name, load_mmlu_pro(data_dir), mmlu_pro_messages, mmlu_pro_score)
    raise SystemExit(f"Benchmark {name!r} is not one of: {', '.join(BENCHMARKS)}.")


# ----------------------------------------------------------------------------------------
# Your own task (--task file): problems from a data file or a Hub dataset, a grader by name, or
# your own reward function by import path (docs/tasks.md, "Your own task").

GRADERS = ("math", "number", "choice", "exact", "countdown")
FILE_FORMATS = (".jsonl", ".json", ".csv", ".parquet")
EXACT_INSTRUCTION = "Think it through step by step. Then write the final answer alone in \\boxed{}."
GRADER_INSTRUCTIONS = {  # what each grader reads, said to the model
    "math": BOXED_MATH_INSTRUCTION,
    "number": BOXED_NUMBER_INSTRUCTION,
    "choice": MMLU_PRO_INSTRUCTION,
    "exact": EXACT_INSTRUCTION,
    "countdown": "",  # Countdown's own prompt says where the answer goes
}


@dataclass
class FileTaskSpec:
    """The flags of a file task (TaskArgs' of the same names say what each is)."""

    data_file: str
    data_split: str = "train"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    grader: str = "math"
    system_prompt: str = ""
    instruction: str = "auto"
    eval_data_file: str = ""
    eval_data_split: str = "test"

    @classmethod
    def from_args(cls, args) -> "FileTaskSpec":
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def read_rows(source: str, split: str) -> list[dict]:
    """The rows of a .jsonl/.json/.csv/.parquet file, or of a Hub dataset's split (owner/name[:config])."""
    path = Path(source)
    if path.suffix in FILE_FORMATS or path.exists():
        if not path.is_file():
            raise SystemExit(f"--data_file {source}: no such file. Give a {'/'.join(FILE_FORMATS)} file or a Hub id.")
        if path.suffix == ".jsonl":
            rows = jsonl_rows(path, source)
        elif path.suffix == ".json":
            content = json_value(data_text(path), source)
            rows = content.get(split) if isinstance(content, dict) else content
            if not isinstance(rows, list):
                raise SystemExit(f"{source}: a JSON file holds a list of rows, or {{{split!r}: [rows]}}.")
        elif path.suffix == ".csv":
            rows = list(csv.DictReader(io.StringIO(data_text(path), newline="")))
        elif path.suffix == ".parquet":
            import pyarrow.parquet  # datasets' own dependency

            rows = pyarrow.parquet.read_table(path).to_pylist()
        else:
            raise SystemExit(
                f"--data_file {source}: {path.suffix or 'no suffix'} is not one of {', '.join(FILE_FORMATS)}."
            )
        if not rows:
            raise SystemExit(f"--data_file {source} holds no rows.")
        if not all(isinstance(row, dict) for row in rows):
            raise SystemExit(f"{source}: every row must be an object of named columns.")
        return rows
    name, _, config = source.partition(":")
    return load_hub_rows(name, config or None, split, set(), hint="or give a local file (docs/tasks.md).")


def data_text(path: Path) -> str:
    """A data file's UTF-8 text, a byte-order mark read past; else a SystemExit naming the file."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise SystemExit(f"{path}: not UTF-8 text ({error}): save it as UTF-8.") from error


def jsonl_rows(path: Path, where: str) -> list:
    """The values of a JSON-lines file, blank lines skipped; a SystemExit names `where` and the line."""
    lines = enumerate(data_text(path).splitlines(), start=1)
    return [json_value(line, f"{where}, line {number}") for number, line in lines if line.strip()]


def json_value(text: str, where: str):
    """json.loads(text), or a SystemExit naming where (a file, a line of it) and what is wrong."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise SystemExit(f"{where}: not valid JSON ({error}).") from error


def file_problem(row: dict, spec: FileTaskSpec, where: str) -> dict:
    """A row with "gold" (text) and, for the countdown grader, numbers; ValueError: the grader cannot read it."""
    if spec.grader == "countdown":  # the answer is an equation: no answer column, the target says it
        numbers = row["nums"] if not isinstance(row["nums"], str) else json.loads(row["nums"])
        target = int(row["target"])
        gold = f"{row['solution']} = {target}" if row.get("solution") else str(target)
        return dict(row, nums=[int(n) for n in numbers], target=target, gold=gold, subset="")
    problem = dict(row, gold=str(row[spec.answer_key]).strip(), subset="")
    if spec.grader == "number" and extract_last_number(problem["gold"]) != problem["gold"].replace(",", ""):
        raise ValueError(f"{where}: {problem['gold']!r} is not a number")
    elif spec.grader == "choice":
        problem["gold"] = problem["gold"].strip("() ").upper()
        if len(problem["gold"]) != 1 or problem["gold"] not in MMLU_PRO_LETTERS:
            raise ValueError(f"{where}: {row[spec.answer_key]!r} is not a letter A-J")
    return problem


def file_problems(spec: FileTaskSpec, source: str, split: str) -> list[dict]:
    """Every row of `source` as a problem; stops on a missing column or answers the grader cannot read."""
    rows = read_rows(source, split)
    needed = {"nums", "target"} if spec.grader == "countdown" else {spec.prompt_key, spec.answer_key}
    problems, unreadable = [], []  # a missing column or prompt stops at once; unreadable answers are counted
    for number, row in enumerate(rows, start=1):
        missing = needed - set(row)
        if missing:
            flags = "" if spec.grader == "countdown" else " (--prompt_key, --answer_key)"
            at = f", row {number}" if number > 1 else ""
            raise SystemExit(f"{source}{at}: no column {sorted(missing)}{flags}; its columns are {sorted(row)}.")
        prompt = row.get(spec.prompt_key, "Countdown's own")  # the countdown grader's rows may have none
        chat = isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
        if not (isinstance(prompt, str) and prompt.strip() or chat and prompt):
            raise SystemExit(
                f"{source}, row {number}: the prompt ({spec.prompt_key!r}) is {prompt!r}: give text, or a chat as a "
                'list of {"role": ..., "content": ...} messages.'
            )
        try:
            problems.append(file_problem(row, spec, f"row {number}"))
        except (KeyError, ValueError, TypeError) as error:
            unreadable.append(str(error))
    if unreadable:
        raise SystemExit(
            f"{source}: the {spec.grader} grader cannot read {len(unreadable)} of {len(rows)} answers; the first, "
            f"{unreadable[0]}. Choose another --grader ({', '.join(GRADERS)}) or fix the rows."
        )
    return problems


def file_prompt_text(problem: dict, spec: FileTaskSpec) -> str:
    """What identifies a problem: its prompt (Countdown: its numbers and target)."""
    if spec.grader == "countdown" and spec.prompt_key not in problem:
        return f"{sorted(problem['nums'])} {problem['target']}"
    return json.dumps(problem[spec.prompt_key], sort_keys=True)


def file_messages(spec: FileTaskSpec) -> Callable[[dict], list[dict]]:
    """problem -> chat: a row's own chat; else [system,] prompt and instruction; Countdown's without a prompt."""
    instruction = GRADER_INSTRUCTIONS[spec.grader] if spec.instruction == "auto" else spec.instruction

    def messages(problem: dict) -> list[dict]:
        if spec.grader == "countdown" and spec.prompt_key not in problem:
            return countdown_messages(problem)
        prompt = problem[spec.prompt_key]
        if isinstance(prompt, list):  # already a conversation
            return [dict(message) for message in prompt]
        system = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
        content = f"{prompt}\n\n{instruction}" if instruction else str(prompt)
        return [*system, {"role": "user", "content": content}]

    return messages


def exact_score(completion: str, problem: dict, truncated: bool = False) -> Score:
    """The last \\boxed{} (strict), else the first line after "answer is", else the last line, equals the
    gold, both normalised (case, spaces, punctuation around, $…$)."""
    boxed = extract_boxed(completion)
    flexible = boxed
    if boxed is None:
        parts = ANSWER_IS.split(completion)  # after the last "answer is": its first line; else the last line
        lines = [line.strip() for line in parts[-1].splitlines() if line.strip()]
        flexible = (lines[0] if len(parts) > 1 else lines[-1]) if lines else None
    gold = normalised_text(problem["gold"])
    correct = flexible is not None and normalised_text(flexible) == gold
    strict = boxed is not None and normalised_text(boxed) == gold
    return graded(correct, strict, boxed is not None, flexible, truncated)


def normalised_text(text: str) -> str:
    text = text.strip().strip("$").replace("\\text{", "").replace("}", "").replace("{", "")
    return " ".join(text.lower().split()).strip(" .,:;!\"'`*")


FILE_GRADERS: dict[str, Callable[[str, dict, bool], Score]] = {
    "math": math500_score,
    "number": gsm8k_reward,  # the boxed number only, as GSM8K's training reward (gsm8k_reward says why)
    "choice": mmlu_pro_score,
    "exact": exact_score,
    "countdown": countdown_score,
}


def load_file_task(spec: FileTaskSpec, split: str, shots: int = 0) -> Task:
    """--task file's training rows ("train") or held-out ones ("heldout": --eval_data_file's, else the hash
    share), the first `shots` training rows as worked examples. Stops before any model loads."""
    if spec.grader not in GRADERS:
        raise SystemExit(f"--grader {spec.grader!r} is not one of: {', '.join(GRADERS)}.")
    if split == "heldout" and spec.eval_data_file and not spec.data_file:  # evaluate.py on a file of its own
        problems = file_problems(spec, spec.eval_data_file, spec.eval_data_split)
        return Task("file", problems, file_messages(spec), FILE_GRADERS[spec.grader])
    if not spec.data_file:
        raise SystemExit("--task file needs --data_file: a .jsonl/.json/.csv/.parquet file or a Hub dataset id.")
    rows = file_problems(spec, spec.data_file, spec.data_split)
    if spec.eval_data_file:
        train, heldout = rows, file_problems(spec, spec.eval_data_file, spec.eval_data_split)
        seen = {file_prompt_text(p, spec) for p in train}
        overlap = [p for p in heldout if file_prompt_text(p, spec) in seen]
        if overlap:
            raise SystemExit(
                f"--eval_data_file {spec.eval_data_file}: {len(overlap)} of its {len(heldout)} problems are also in "
                f"--data_file (the first: {file_prompt_text(overlap[0], spec)[:80]}). Held-out problems must be unseen."
            )
    else:  # the hash share (Countdown's own rule for the countdown grader)
        countdown = spec.grader == "countdown"
        held = [
            is_heldout_countdown(p["nums"], p["target"]) if countdown else is_heldout(file_prompt_text(p, spec))
            for p in rows
        ]
        train, heldout = [p for p, h in zip(rows, held) if not h], [p for p, h in zip(rows, held) if h]
    if shots < 0 or shots >= len(train):
        raise SystemExit(f"--shots {shots}: between 0 and the {len(train)} training rows less one.")
    examples, train = train[:shots], train[shots:]
    answer = "The answer is ({})." if spec.grader == "choice" else "The answer is \\boxed{{{}}}."
    if spec.grader == "countdown" and not all(e.get("solution") for e in examples):
        raise SystemExit("--shots with --grader countdown needs a 'solution' column (an equation) in the rows.")
    worked = [(e, countdown_worked(e) if spec.grader == "countdown" else answer.format(e["gold"])) for e in examples]
    problems = train if split == "train" else heldout
    if not problems:
        raise SystemExit(f"--data_file {spec.data_file}: no {split} rows (held out: 1 in {HELDOUT_SHARE}).")
    return Task("file", problems, with_examples(file_messages(spec), worked), FILE_GRADERS[spec.grader])


def import_function(path: str, flag: str) -> Callable:
    """The function module:function or path/to/file.py:function names; else a stop naming the flag."""
    module_name, _, function_name = path.rpartition(":")
    if not module_name or not function_name:
        raise SystemExit(f"{flag} {path!r}: write module:function or path/to/file.py:function.")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or not Path(module_name).is_file():
                raise FileNotFoundError(module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as error:  # whatever the user's module raises on import: stop, naming it
        raise SystemExit(f"{flag} {path!r} does not import: {type(error).__name__}: {error}") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise SystemExit(f"{flag} {path!r}: {module_name} has no function {function_name!r}.")
    return function


def import_reward_fn(path: str) -> Callable:
    """The function --reward_fn names, checked to take (completion, problem, truncated) and, where it names a
    parameter `tools`, the row's class tools (tool_state): else every call fails."""
    function = import_function(path, "--reward_fn")
    try:
        inspect.signature(function).bind("completion", {}, False, **({"tools": {}} if takes_tools(function) else {}))
    except TypeError as error:
        raise SystemExit(
            f"--reward_fn {path!r}: {function.__name__}{inspect.signature(function)} cannot be called as "
            f"{function.__name__}(completion, problem, truncated) ({error}): give it those three parameters."
        ) from error
    except ValueError:  # no signature to read (a builtin): the calls will tell
        pass
    return function


class RewardTimeout(BaseException):
    """Past a time limit: a BaseException, so user code catching Exception cannot swallow it."""


def call_with_time_limit(function: Callable, seconds: float, *args):
    """function(*args) cut by a SIGALRM after `seconds`, in the main thread (math-verify's own work only there)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        return function(*args)

    def expire(signum, frame):
        raise RewardTimeout(f"ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return function(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def with_reward_fn(task: Task, path: str, timeout_s: float) -> Task:
    """The task scored by --reward_fn (as it is for ''): a number, or (number, formatted); correct: >=
    REWARD_CORRECT. A call that raises, times out or returns no number scores REWARD_NONE, failed=True."""
    if not path:
        return task
    function = import_reward_fn(path)
    warned = []  # the first failure is shown, once

    def score(completion: str, problem: dict, truncated: bool = False, **tools) -> Score:
        try:
            value = call_with_time_limit(
                functools.partial(function, **tools), timeout_s, completion, problem, truncated
            )
            reward, formatted = value if isinstance(value, tuple) else (value, None)
            reward = float(reward)
            if reward != reward or reward in (float("inf"), float("-inf")):
                raise ValueError(f"returned {reward}")
        except (Exception, RewardTimeout) as error:  # the user's code: a failure is a completion's 0, not the end
            if not warned:
                warned.append(error)
                print(
                    f"--reward_fn {path}: a call failed ({type(error).__name__}: {error}); a failed call scores "
                    f"{REWARD_NONE} and counts in reward/fn_failed (further failures are not shown).",
                    file=sys.stderr,
                    flush=True,
                )
            return Score(REWARD_NONE, correct=False, formatted=False, failed=True)
        formatted = bool(formatted) if formatted is not None else reward > REWARD_NONE
        return Score(reward, correct=reward >= REWARD_CORRECT, formatted=formatted)

    score.takes_tools = takes_tools(function)
    return replace(task, score=score)  # the rest as it was: its tools too


def takes_tools(function: Callable) -> bool:
    """Whether a reward names a parameter `tools` (tool_state hands it the row's class tools)."""
    try:
        return "tools" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def tool_state(task: Task, tool_turn, row: int) -> dict:
    """What task.score takes beyond (completion, problem, truncated) for a rollout row: {"tools": its class
    tools' instances by name, as its calls left them} for a --reward_fn naming `tools`, else nothing."""
    if not getattr(task.score, "takes_tools", False):
        return {}
    return {"tools": dict(tool_turn.instances[row]) if tool_turn is not None else {}}


def scored(task: Task, texts: list[str], problems: list[dict], group_size: int, truncated: list, tool_turn=None):
    """Each completion's Score: rows i·G … i·G+G-1 answer problems[i]; a reward naming `tools` reads them."""
    return [
        task.score(text, problems[i // group_size], truncated[i], **tool_state(task, tool_turn, i))
        for i, text in enumerate(texts)
    ]


# ----------------------------------------------------------------------------------------
# Tools: Python functions with type hints and a Google-style docstring (get_json_schema shows them to the
# model). A call is parsed (parse_tool_calls), run (run_tool_call), its answer rendered (tool_turn_text).

DECIMAL_PLACES = 6  # the calculator's decimal form of a fraction that is not whole
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # Hermes' format: Qwen2.5, Qwen3
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1: what follows it is a call
SPECIAL_TOKEN = re.compile(r"<\|\w+\|>")  # <|eot_id|>, <|im_end|>: the end of the turn, in its text


# The Countdown verifier's parser and exact arithmetic. The docstring is the model's (get_json_schema).
def calculator(expression: str) -> str:
    """Computes an arithmetic expression exactly: numbers to 1000000 (decimals, signs), + - * / and parentheses.

    Args:
        expression: The expression, such as "(7 - 3) * 5 / 2" or "-1.5 * (2.25 + 4)".

    Returns:
        The value: its digits when whole ("12"), else the fraction and its decimal ("7/2 = 3.5", "1/3 ≈ 0.333333").

    Raises:
        ValueError: what is wrong with the expression (division by zero included).
    """
    if not isinstance(expression, str):
        raise ValueError(f'the expression must be text, such as "2 + 3", not {type(expression).__name__}')
    tree, _ = read_expression(expression.strip(), decimals=True)
    try:
        value = evaluate_expression(tree)
    except ZeroDivisionError as error:
        raise ValueError("division by zero") from error
    if value.denominator == 1:
        return str(value.numerator)
    rounded = round(value, DECIMAL_PLACES)  # half to even; "=" when that is exact, else "≈"
    whole, part = divmod(int(abs(rounded) * 10**DECIMAL_PLACES), 10**DECIMAL_PLACES)
    digits = f"{part:0{DECIMAL_PLACES}d}".rstrip("0")
    decimal = ("-" if rounded < 0 else "") + str(whole) + (f".{digits}" if digits else "")
    return f"{value} {'=' if rounded == value else '≈'} {decimal}"


BUILTIN_TOOLS = {"calculator": calculator}  # what --tools may name


def load_tools(builtin: str, user: str) -> list[Callable]:
    """The tools --tools (BUILTIN_TOOLS) and --tool (import paths) name, describable and named apart."""
    from transformers.utils import get_json_schema

    tools = []
    for name in [part.strip() for part in builtin.split(",") if part.strip()]:
        if name not in BUILTIN_TOOLS:
            raise SystemExit(
                f"--tools {name!r} is not a built-in tool; they are: {', '.join(BUILTIN_TOOLS)}. "
                "For a function of your own, use --tool module:function or --tool path/to/file.py:function."
            )
        tools.append(BUILTIN_TOOLS[name])
    for path in [part.strip() for part in user.split(",") if part.strip()]:
        function = import_function(path, "--tool")
        function = class_tool(function) if inspect.isclass(function) else function
        try:  # the schema is all the chat template shows the model of a tool
            get_json_schema(function)
        except Exception as error:  # its own DocstringParsingException, TypeHintParsingException; a partial's, …
            raise SystemExit(
                f"--tool {path!r}: the model cannot be shown {getattr(function, '__name__', function)!r}: {error}. "
                "A tool needs a type hint on every argument and a Google-style docstring: a description, then an "
                "'Args:' section with one line 'name: what it is' for each argument."
            ) from error
        check_tool_signature(function, path)
        tools.append(function)
    check_tool_names(tools)
    return tools


def class_tool(cls: type) -> Callable:
    """A tool given as a class, for state across a completion's turns (a sandbox, a game): described by its
    __call__ under the class's name; tool_turns gives each row an instance of its own (row_tools, release)."""
    call = cls.__call__
    hints = typing.get_type_hints(call)  # resolved here: the stand-in's module is not the tool's

    def stand_in(**arguments):
        raise TypeError(f"{cls.__name__} is called through the instance tool_turns makes for each row")

    stand_in.__name__ = stand_in.__qualname__ = cls.__name__
    stand_in.__doc__ = call.__doc__
    parameters = list(inspect.signature(call).parameters.values())[1:]  # less self
    stand_in.__signature__ = inspect.signature(call).replace(parameters=parameters)
    stand_in.__annotations__ = {name: hint for name, hint in hints.items() if name != "self"}
    stand_in.stateful = cls
    return stand_in


def row_tools(by_name: dict[str, Callable], instances: dict) -> dict[str, Callable]:
    """A row's tools: the functions as they are, and its own instance of each class tool (made now, on its
    first call; a constructor that raises answers every call of that tool with its error)."""
    tools = {}
    for name, tool in by_name.items():
        if getattr(tool, "stateful", None) is None:
            tools[name] = tool
            continue
        if name not in instances:
            try:
                instances[name] = tool.stateful()
            except Exception as error:  # noqa: B023 (bound now, raised when called)

                def failed(*arguments, error=error, **named):
                    raise error

                failed.__signature__ = tool.__signature__
                instances[name] = failed
        tools[name] = instances[name]
    return tools


def release(instances: list[dict]) -> None:
    """Each class tool's instance closed (its close(), if it has one), when its rollout is done."""
    for row in instances:
        for instance in row.values():
            with contextlib.suppress(Exception):
                getattr(instance, "close", lambda: None)()


def check_tool_signature(function: Callable, path: str) -> None:
    """Stops on a tool that cannot be called with its schema's arguments, which the model gives by name."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): its calls will tell
        return
    by_position = [p.name for p in parameters if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY)]
    if by_position:
        raise SystemExit(
            f"--tool {path!r}: {function.__name__}{inspect.signature(function)} takes {', '.join(by_position)} "
            "by position only, and the model names every argument of a call: give it named parameters."
        )


def check_tool_names(tools: list[Callable]) -> None:
    """Stops on two tools of one name: the model calls a tool by its name, the function's."""
    names = [tool.__name__ for tool in tools]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SystemExit(
            f"There are two tools named {twice[0]!r} (the task's own, --tools' and --tool's together); "
            "the model calls a tool by its function's name, so each needs a name of its own."
        )


def with_tools(task: Task, args) -> Task:
    """The task with the tools of --tools and --tool after its own (args may lack those flags)."""
    builtin, user = getattr(args, "tools", ""), getattr(args, "tool", "")
    if not builtin and not user:
        return task
    tools = [*task.tools, *load_tools(builtin, user)]
    check_tool_names(tools)
    return replace(task, tools=tools)


def parse_tool_calls(text: str, whole_turn_json: bool = True) -> list[dict]:
    """A turn's calls as written (special tokens kept): [{"name", "arguments"}], [] for none. Hermes: JSON
    in <tool_call> blocks; Llama 3.x (whole_turn_json): the turn is one JSON object with "name" and "parameters".
    An unreadable call is {"error": why}, which the model gets as the answer. Linear time: untrusted text."""
    if TOOL_CALL_OPEN not in text:  # Llama's, read only with whole_turn_json: the turn, its end (<|eot_id|>) dropped
        body = text.strip() if whole_turn_json else ""
        while (start := body.rfind("<|")) >= 0 and SPECIAL_TOKEN.fullmatch(body, start):
            body = body[:start].rstrip()
        if body.startswith(PYTHON_TAG):
            return [tool_call_from_json(body[len(PYTHON_TAG) :])]
        if not (body.startswith("{") and body.endswith("}")):
            return []
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):  # braces around text that is no JSON: an answer, not a call
            return []
        return [tool_call_from_value(value)] if isinstance(value, dict) and "name" in value else []
    calls, position = [], 0
    while (start := text.find(TOOL_CALL_OPEN, position)) >= 0:
        start += len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, start)
        if end < 0:
            calls.append({"error": f"a {TOOL_CALL_OPEN} with no {TOOL_CALL_CLOSE} to close it"})
            break
        calls.append(tool_call_from_json(text[start:end]))
        position = end + len(TOOL_CALL_CLOSE)
    return calls


def tool_call_format(tokenizer) -> bool:
    """parse_tool_calls' whole_turn_json: False for a template writing <tool_call> blocks, else True."""
    return TOOL_CALL_OPEN not in (tokenizer.chat_template or "")


def tool_call_from_json(text: str) -> dict:
    """One call's JSON text as {"name", "arguments"}, or {"error": what was wrong}."""
    try:
        return tool_call_from_value(json.loads(text))
    except RecursionError:  # json.loads recurses once per bracket: '[' * 100000 exhausts the stack
        return {"error": "the call is not valid JSON: nested too deep"}
    except ValueError as error:
        return {"error": f"the call is not valid JSON ({error})"}


def tool_call_from_value(value) -> dict:
    """A parsed call as {"name", "arguments"}, or {"error": what was wrong}."""
    if not isinstance(value, dict):
        return {"error": 'the call is not a JSON object {"name": ..., "arguments": {...}}'}
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return {"error": 'the call has no "name" (the tool\'s name, a string)'}
    arguments = value["arguments"] if "arguments" in value else value.get("parameters", {})
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None  # not JSON: refused below with the others
    if not isinstance(arguments, dict):
        return {"error": f"the arguments of {name} are not a JSON object {{argument name: value, ...}}"}
    return {"name": name, "arguments": arguments}


def run_tool_call(call: dict, tools: dict[str, Callable], timeout_s: float) -> tuple[str, bool]:
    """Runs a call: (the answer, failed). The result (JSON or str() if not a string), or "error: ..." for a
    malformed call, an unknown tool, wrong arguments, a raise or a timeout. Never raises."""
    if "error" in call:
        return f"error: {call['error']}", True
    name, arguments = call["name"], call["arguments"]
    function = tools.get(name)
    if function is None:
        return f"error: no tool named {name!r}; the tools are: {', '.join(tools) or 'none'}", True
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as error:  # a missing, unknown or repeated argument
        return f"error: wrong arguments for {name}: {error}", True
    try:
        return call_abandoned_at(functools.partial(answer_text, function, arguments), timeout_s), False
    except RewardTimeout:
        return f"error: {name} ran past its time limit of {timeout_s} s", True
    except (Exception, SystemExit) as error:  # the tool's own failure (its exit too) is its answer; the rollout goes on
        return f"error: {type(error).__name__}: {error}", True


def answer_text(function: Callable, arguments: dict) -> str:
    """A tool's result as the model reads it: a str as it is, else JSON, else str() (a set, an object, a
    cycle). An async tool (a coroutine function) is awaited, in an event loop of its own."""
    result = function(**arguments)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return str(result)


def call_abandoned_at(function: Callable, seconds: float):
    """function() in a daemon thread of its own, its value returned or its exception raised here; past
    `seconds` (> 0) a RewardTimeout, the call abandoned where it is: nothing the tool catches can stop that.
    One call at a time: the order of what tools draw from Python's random module stays the run's."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function()
        except BaseException as error:  # handed to the caller, whatever it is
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True, name="nanoPO tool call")
    thread.start()
    thread.join(seconds if seconds > 0 else None)
    if thread.is_alive():
        raise RewardTimeout(f"ran past {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# ----------------------------------------------------------------------------------------

TASKS = ("countdown", "digit", "secret", "gsm8k", "file")


def load_task(
    name: str, seed: int = 0, num_problems: int = 20000, dataset: str = "", split: str = "train", data_dir: str = "",
    shots: int = 0, countdown_numbers: str = COUNTDOWN_NUMBERS,
) -> Task:  # fmt: skip
    """A task's problems, prompt and training reward (Countdown: the generator with `seed`, or `dataset`)."""
    if dataset and name != "countdown":
        raise SystemExit(f"--dataset is for --task countdown; --task {name} has its own data.")
    if data_dir and name != "gsm8k":
        raise SystemExit(f"--data_dir is for --task gsm8k; --task {name} does not read files: drop --data_dir.")
    if countdown_numbers != COUNTDOWN_NUMBERS and (name != "countdown" or dataset):
        raise SystemExit("--countdown_numbers is for the offline Countdown generator (--task countdown, no --dataset).")
    examples = task_examples(name, shots, countdown_numbers, data_dir)
    if name == "countdown":
        if dataset:  # the public set, its columns `target` and `nums`
            hint = "check the dataset name, or drop --dataset to use the offline generator (the default)."
            rows = load_hub_rows(dataset, None, split, {"target", "nums"}, hint)
            problems = [{"nums": list(row["nums"]), "target": int(row["target"])} for row in rows]
        else:
            problems = generate_countdown(num_problems, seed, *countdown_sizes(countdown_numbers))
        return Task(name, problems, with_examples(countdown_messages, examples), countdown_score)
    if name == "digit":
        return Task(name, [{"prompt": prompt} for prompt in DIGIT_PROMPTS], digit_messages, digit_score)
    if name == "secret":  # one user turn, as digit's; its tool is its own
        return Task(name, [{"prompt": p} for p in SECRET_PROMPTS], digit_messages, secret_score, tools=[secret_digit])
    if name == "gsm8k":  # the strict reward, not the benchmark's grade (gsm8k_reward says why)
        return Task(name, load_gsm8k(split, data_dir), with_examples(gsm8k_messages, examples), gsm8k_reward)
    if name == "file":
        raise SystemExit("--task file reads its problems from --data_file: load it with training_task(args).")
    raise SystemExit(f"--task {name!r} is not one of: {', '.join(TASKS)}.")


def training_task(args) -> Task:
    """The task a training script's flags name, with --reward_fn's reward and --tool(s)' tools."""
    file_flags = [f"--{name}" for name in ("data_file", "eval_data_file") if getattr(args, name)]
    if args.task != "file" and file_flags:
        raise SystemExit(f"{' and '.join(file_flags)}: for --task file (your own data); drop it or add --task file.")
    if args.task == "file":
        task = load_file_task(FileTaskSpec.from_args(args), "train", args.shots)
    else:
        task = load_task(
            args.task, args.seed, args.num_problems, args.dataset, "train", args.data_dir, args.shots,
            args.countdown_numbers,
        )  # fmt: skip
    return with_tools(with_reward_fn(task, args.reward_fn, args.reward_fn_timeout), args)


def heldout_task(args) -> Task:
    """--eval_every's problems: load_heldout_task's, or --task file's held-out rows; reward and tools as in training."""
    if args.task == "file":
        task = load_file_task(FileTaskSpec.from_args(args), "heldout", args.shots)
        task.problems = task.problems[: args.eval_problems]
    else:
        task = load_heldout_task(args.task, args.eval_problems, args.data_dir, args.shots, args.countdown_numbers)
    return with_tools(with_reward_fn(task, args.reward_fn, args.reward_fn_timeout), args)


def load_heldout_task(
    name: str, num_problems: int, data_dir: str = "", shots: int = 0, countdown_numbers: str = COUNTDOWN_NUMBERS
) -> Task:
    """Problems no training step sees: the first num_problems of the same benchmark; the toys' own."""
    toy = name in ("digit", "secret")  # their own prompts: nothing is held out
    task = load_task(name) if toy else load_benchmark(name, data_dir, num_problems, shots, countdown_numbers)
    task.problems = task.problems[:num_problems]
    return task


# ----------------------------------------------------------------------------------------
# Tool turns: the environment side of a multi-turn rollout. A turn's calls run, their answers
# rendered by the chat template and cut to --max_tool_tokens, queued for generate() to force.

TOOL_TURN_MARK = "nanoPO: the assistant's turn"  # marks where that turn ends in tool_turn_text


def plain_prompt_advice(tokenizer) -> str:
    """How a message on tools with plain prompts ends: drop --prompt_format plain, or use a chat model."""
    chat_model = "use a chat model (tiny-tools among the tiny ones)."
    if tokenizer.chat_template is not None:
        return f"these prompts are plain text: drop --prompt_format plain, or {chat_model}"
    return f"this model has none, so its prompts are plain text: {chat_model}"


def tool_turn_text(tokenizer, answers: list[tuple[str, str]]) -> str:
    """What the chat template writes after an assistant turn that called tools, from its EOS to the next
    assistant header, the tool messages of `answers` ((name, text) pairs) between: read off the template."""
    if getattr(tokenizer, "plain_prompt", False) or tokenizer.chat_template is None:
        raise SystemExit(
            "Tools need a chat template, to give the model the tools' answers, and " + plain_prompt_advice(tokenizer)
        )
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": TOOL_TURN_MARK}]
    messages += [{"role": "tool", "name": name, "content": answer} for name, answer in answers]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as error:
        raise SystemExit(
            f"This model's chat template has no tool role (it raised on a tool message: {error}), so the "
            "tools' answers cannot be given to the model. Use a model whose template takes tool messages."
        ) from error
    mark = text.find(TOOL_TURN_MARK)
    end = text.find(tokenizer.eos_token, mark) if mark >= 0 else -1
    if end < 0:
        raise SystemExit(
            f"This model's chat template does not end an assistant turn with its EOS token "
            f"{tokenizer.eos_token!r}, so where a tool's answer goes after the model's turn is unknown."
        )
    return text[end + len(tokenizer.eos_token) :]


def check_tool_turns(tokenizer) -> None:
    """Stops where the chat template has no tool role or drops the answer (a plain one: others may be escaped)."""
    if "4242" not in tool_turn_text(tokenizer, [("probe", "4242")]):
        raise SystemExit(
            "This model's chat template drops the tool's answer (a message of role 'tool'), so the model "
            "would never see it. Use a model whose template takes tool messages."
        )


def too_few_tool_tokens(max_tokens: int, around: int) -> str:
    """The message for --max_tool_tokens below what the chat template writes around one empty answer."""
    return (
        f"--max_tool_tokens {max_tokens} is fewer than the {around} tokens the chat template puts around "
        "a tool's answer: raise it (the answers' own tokens come on top)."
    )


def tool_turns(
    tokenizer, tools: list, num_rows: int, max_turns: int, max_tool_tokens: int, timeout_s: float, workers: int = 1
):
    """generate's tool_turn: (row, a turn's ids) -> None to end, or a Future of its calls' answers as ids (cut to
    max_tool_tokens), run by `workers` threads beside the decode. Also returns counts (n, 4): each row's calls,
    failed calls, answered turns, and the calls it made past max_turns (not run: the completion ends there)."""
    by_name = {tool.__name__: tool for tool in tools}
    instances = [{} for _ in range(num_rows)]  # each row's class tools (class_tool): its state across turns
    counts = torch.zeros(num_rows, 4, dtype=torch.long)  # calls, failed calls, turns answered, calls past them
    check_tool_turns(tokenizer)  # stops now where the template cannot give the model an answer…
    fitted_answer(tokenizer, [("", "")], max_tool_tokens)  # …or its own tokens around one do not fit
    whole_turn_json = tool_call_format(tokenizer)  # Llama's whole-turn JSON calls, or Hermes' blocks only
    # No answer of more characters than this fits: each token is at most `longest` characters of text
    longest_answer = max_tool_tokens * max(map(len, tokenizer.get_vocab()))
    pool = futures.ThreadPoolExecutor(workers, thread_name_prefix="nanoPO tools")  # one: in the order handed
    tokenizing = threading.Lock()  # a fast tokenizer may not be used by two threads at once

    def answered(row: int, calls: list[dict]) -> list[int]:  # in a worker: a row's calls run one after another
        answers = [run_tool_call(call, row_tools(by_name, instances[row]), timeout_s) for call in calls]
        counts[row, :2] += torch.tensor([len(calls), sum(failed for _, failed in answers)])
        cut = [text[:longest_answer] + ("…" if len(text) > longest_answer else "") for text, _ in answers]
        with tokenizing:
            texts = [as_text(tokenizer, text) for text in cut]
            names = [call.get("name", "") for call in calls]
            return fitted_answer(tokenizer, list(zip(names, texts)), max_tool_tokens)

    def tool_turn(row: int, ids: list[int]) -> futures.Future | None:
        with tokenizing:
            calls = parse_tool_calls(tokenizer.decode(ids), whole_turn_json)  # the turn as written, its EOS too
        if calls and counts[row, 2] >= max_turns:  # over the budget: counted, not run, and the completion ends
            counts[row, 3] += len(calls)
        if not calls or counts[row, 2] >= max_turns:
            return None
        counts[row, 2] += 1  # the turn is taken now (its calls may still run): the next one sees it
        return pool.submit(answered, row, calls)

    tool_turn.instances = instances  # a reward may read them (tool_state) before they close
    weakref.finalize(tool_turn, release, instances)  # the rollout is done with it: instances close (the pool with it)
    return tool_turn, counts


def as_text(tokenizer, answer: str) -> str:
    """A tool's answer with every special or added token's text in it (<|im_end|>, <tool_call>) broken by a
    zero-width space after its first character: tokenised as text, it can never end the turn."""
    for token in tokenizer.get_added_vocab():
        if len(token) > 1 and token in answer:
            answer = answer.replace(token, token[0] + "\u200b" + token[1:])
    return answer


def fitted_answer(tokenizer, answers: list[tuple[str, str]], max_tokens: int) -> list[int]:
    """The ids of a turn's (name, text) answers as tool_turn_text renders them, the longest cut ("…") to fit."""
    names, texts = [name for name, _ in answers], [text for _, text in answers]
    while True:
        ids = tokenizer(tool_turn_text(tokenizer, list(zip(names, texts))), add_special_tokens=False)["input_ids"]
        if len(ids) <= max_tokens:
            return ids
        longest = max(range(len(texts)), key=lambda k: len(texts[k]))
        if not texts[longest]:
            raise SystemExit(too_few_tool_tokens(max_tokens, len(ids)))
        keep = len(texts[longest]) * max_tokens // len(ids) - 2  # about the share that fits, less the "…"
        texts[longest] = texts[longest][:keep] + "…" if keep > 0 else ""


TOOL_GRACE_S = 0.05  # how long the step after a call waits for it: a quick tool's row goes on as if never waiting


@dataclass
class ToolQueue:
    """Per row of generate's decode loop, the state of its tool turns."""

    ids: torch.Tensor  # (n, max_tool_tokens) the current answer's tokens
    queued: torch.Tensor  # (n,) how many of them are still to come
    next: torch.Tensor  # (n,) the index of the next one
    spent: torch.Tensor  # (n,) the model's own tokens so far
    start: torch.Tensor  # (n,) the column the current turn began at
    waits: torch.Tensor  # (N,) by output row: the steps it waited in place for its calls' answers
    pending: dict = field(default_factory=dict)  # output row -> (the Future of its answer, the step it was handed)
    patient: bool = True  # False once a call outlasted TOOL_GRACE_S: the steps after calls wait no more

    @classmethod
    def empty(cls, num_rows: int, max_tool_tokens: int, pad_id: int, device: torch.device) -> "ToolQueue":
        zeros = torch.zeros(num_rows, dtype=torch.long, device=device)
        ids = torch.full((num_rows, max(max_tool_tokens, 1)), pad_id, device=device)
        return cls(ids, zeros, zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone())

    def keep(self, rows: torch.Tensor) -> "ToolQueue":
        """Only the rows that stay (generate's compaction), in place."""
        self.ids, self.queued, self.next = self.ids[rows], self.queued[rows], self.next[rows]
        self.spent, self.start = self.spent[rows], self.start[rows]
        return self

    def held(self, rows, filled, alive, t: int, hold: bool) -> torch.Tensor:
        """Rows whose answers have landed take them, queued from step t; the rest wait in place: held (n,).
        The calls handed over at step t-1 get TOOL_GRACE_S each, so instant tools change no token (until they
        outlast it: the tools are slow, and waiting again would stall every row for nothing). It blocks
        without `hold` (a sliding window: every row fills each column) or when no other row can decode.
        rows (n,) into the output's N; filled (N,) the columns each row has filled; alive (n,)."""
        held = torch.zeros_like(alive)
        if not self.pending:
            return held
        if self.patient:
            recent = [future for future, at in self.pending.values() if at == t - 1]
            self.patient = not futures.wait(recent, timeout=TOOL_GRACE_S * len(recent)).not_done  # one worker: in turn
        waiting = [future for future, _ in self.pending.values()]
        if not hold or len(waiting) == int(alive.sum()):
            futures.wait(waiting, return_when=futures.FIRST_COMPLETED if hold else futures.ALL_COMPLETED)
        index = {row: i for i, row in enumerate(rows.tolist())}  # output row -> its place in the decoded rows
        for row, (future, _) in list(self.pending.items()):
            if not future.done():
                held[index[row]] = True
                continue
            answer = future.result()
            if not 0 < len(answer) <= self.ids.shape[1]:  # None, not [], ends a row: its call was never run
                raise ValueError(f"tool_turn gave {len(answer)} tokens; max_tool_tokens is {self.ids.shape[1]}")
            i = index.pop(row)
            self.ids[i, : len(answer)] = torch.tensor(answer, device=self.ids.device)
            self.queued[i], self.next[i], self.start[i] = len(answer), 0, filled[row] + len(answer)
            del self.pending[row]
        self.waits[rows[held]] += 1
        return held


def tool_turns_due(env: ToolQueue, ended, completion_ids, rows, filled, t: int, tool_turn, max_new_tokens: int):
    """Rows whose turn ended at step t hand its ids to tool_turn: with a call the row goes on, its answer (a
    list, or a Future a worker fills) queued when it lands (ToolQueue.held). One host sync. Returns `ended`
    less those rows; ended (n,), rows (n,) into (N, ·), filled (N,) the columns each row has filled."""
    due = ended & (env.spent < max_new_tokens)  # (n,)
    if not due.any():
        return ended
    indices = due.nonzero().squeeze(-1)  # (d,)
    ends = filled[rows[indices]].tolist()  # each turn's end, its EOS included
    texts = completion_ids[rows[indices], : max(ends)].tolist()  # (d, ·): each turn's ids, and before it
    going_on = []
    starts = env.start[indices].tolist()
    for i, row, start, end, ids in zip(indices.tolist(), rows[indices].tolist(), starts, ends, texts):
        answer = tool_turn(row, ids[start:end])
        if not answer:  # no call (or no turns left): the completion ends with this turn
            continue
        if not isinstance(answer, futures.Future):  # answered at once
            answer, landed = futures.Future(), answer
            answer.set_result(landed)
        env.pending[row] = (answer, t)
        going_on.append(i)
    ended = ended.clone()
    ended[going_on] = False
    return ended
