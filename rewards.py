"""Tasks: their data, their prompts and their rule-based rewards.

A task is a list of problems (dicts), a function that turns a problem into chat messages, and
a function that scores a completion's text against its problem. The training scripts and
evaluate.py only see that interface (`load_task`), so adding a task touches this file alone.

Tasks:
  countdown  the seed study's training task: reach a target with 3-4 numbers and + - * /.
             Offline generator by default; `--dataset Jiayi-Pan/Countdown-Tasks-3to4` loads
             the public set from the Hugging Face Hub instead.
  digit      a toy task for watching RL learn on a CPU in minutes: reward 1 when the
             completion starts with a digit. Its expected reward under a policy π is exactly
             Σ_{v ∈ digit tokens} π(v | prompt) at the first position, so tests can measure
             learning without sampling noise.

Model output is untrusted input: the Countdown verifier parses it with `ast` and computes
with exact fractions; nothing is ever passed to `eval`.
"""

import ast
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

# Reward levels, in one place (TinyZero's scheme; the DAPO paper uses ±1 instead).
REWARD_CORRECT = 1.0  # the answer is right
REWARD_FORMAT = 0.1  # well-formed (right tags, a parseable answer) but wrong
REWARD_NONE = 0.0  # anything else: missing or repeated tags, text outside them, garbage

# Bounds on the Countdown answer: generous for 4 numbers below 1000, small enough that no
# answer can make the verifier slow (`ast.parse` is linear; nesting is at most 50 deep).
MAX_EXPRESSION_CHARS = 100
MAX_EXPRESSION_DEPTH = 12  # 4 numbers need 3 operators; parentheses don't add AST depth
MAX_LITERAL = 10**6
ALLOWED_CHARS = frozenset("0123456789+-*/() ")


@dataclass
class Score:
    reward: float
    correct: bool  # the answer solves the problem
    formatted: bool  # the completion follows the task's answer format


@dataclass
class Task:
    name: str
    problems: list[dict]
    messages: Callable[[dict], list[dict]]  # problem -> chat messages for apply_chat_template
    score: Callable[[str, dict], Score]  # (completion text, problem) -> Score


# ----------------------------------------------------------------------------------------
# Countdown: data


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[str, Fraction] | None:
    """Combines the numbers in random order with random operators into one expression.
    Returns (text, exact value), or None when a division by zero came up."""
    pool = [(str(n), Fraction(n)) for n in numbers]
    rng.shuffle(pool)
    while len(pool) > 1:
        (left_text, left), (right_text, right) = pool.pop(), pool.pop()
        op = rng.choice("+-*/")
        if op == "/" and right == 0:
            return None
        if op == "+":
            value = left + right
        elif op == "-":
            value = left - right
        elif op == "*":
            value = left * right
        else:
            value = left / right
        pool.append((f"({left_text} {op} {right_text})", value))
        rng.shuffle(pool)
    text, value = pool[0]
    return text[1:-1], value  # drop the outermost parentheses


def generate_countdown(
    n: int,
    seed: int,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 99,
    max_target: int = 100,
) -> list[dict]:
    """n guaranteed-solvable problems {"nums", "target", "solution"}, reproducible from seed.

    Numbers are drawn first and a random expression over all of them is the witness; a draw
    is kept when its value is an integer in [1, max_target], so every problem has a solution
    (not necessarily the only one). Intermediate values may be fractions, as in the game.
    """
    rng = random.Random(seed)
    problems = []
    while len(problems) < n:
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
        witness = _random_expression(numbers, rng)
        if witness is None:
            continue
        solution, value = witness
        if value.denominator == 1 and 1 <= value <= max_target:
            problems.append({"nums": numbers, "target": int(value), "solution": solution})
    return problems


def load_countdown_hub(name: str, split: str = "train") -> list[dict]:
    """The public Countdown set (columns `target`, `nums`) from the Hugging Face Hub."""
    import datasets

    try:
        rows = datasets.load_dataset(name, split=split)
    except Exception as error:  # datasets raises many types (connection, 404, auth); all fatal here
        raise SystemExit(
            f"Could not load the Countdown dataset {name!r} ({split}) from the Hugging Face Hub: "
            f"{type(error).__name__}: {error}\n"
            "Check the internet connection and the dataset name, or drop --dataset to use the "
            "offline generator (the default)."
        ) from error
    missing = {"target", "nums"} - set(rows.column_names)
    if missing:
        raise SystemExit(f"Dataset {name!r} lacks the column(s) {sorted(missing)}; it has {rows.column_names}.")
    return [{"nums": list(row["nums"]), "target": int(row["target"])} for row in rows]


# ----------------------------------------------------------------------------------------
# Countdown: prompt and verifier

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
    """The text inside <answer> … </answer> when the completion is exactly
    `<think> … </think> <answer> … </answer>` up to surrounding whitespace, else None.

    Strict on purpose: one pair of each tag, in that order, nothing outside them. Looser rules
    (the last <answer> anywhere, the last line) are what format hacking exploits.
    Linear time: counts and index lookups only, no backtracking regex.
    """
    text = completion.strip()
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        if text.count(tag) != 1:
            return None
    think_end = text.index("</think>")
    answer_start = text.index("<answer>")
    if not (text.startswith("<think>") and text.endswith("</answer>") and think_end < answer_start):
        return None
    if text[think_end + len("</think>") : answer_start].strip():
        return None  # text between the two blocks
    return text[answer_start + len("<answer>") : -len("</answer>")].strip()


def parse_expression(expression: str) -> tuple[ast.AST, list[int]] | None:
    """Parses an arithmetic expression over non-negative integer literals with + - * / and
    parentheses. Returns (syntax tree, literals) or None if it is anything else."""
    if not expression or len(expression) > MAX_EXPRESSION_CHARS or not set(expression) <= ALLOWED_CHARS:
        return None  # also rejects '.', '**' is caught below, names, unicode digits, '_'
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError:  # includes leading zeros ('07') and unbalanced parentheses
        return None
    literals = []

    def valid(node: ast.AST, depth: int) -> bool:
        if depth > MAX_EXPRESSION_DEPTH:
            return False
        if isinstance(node, ast.Constant):
            # bool is a subclass of int; the charset already excludes True/False, but be explicit
            if type(node.value) is not int or not 0 <= node.value <= MAX_LITERAL:
                return False
            literals.append(node.value)
            return True
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            return valid(node.left, depth + 1) and valid(node.right, depth + 1)
        return False  # Pow, FloorDiv, Mod, unary minus, calls, names, ...

    return (tree, literals) if valid(tree, 0) else None


def evaluate_expression(tree: ast.AST) -> Fraction:
    """Exact value of a tree accepted by parse_expression. Raises ZeroDivisionError."""
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    left, right = evaluate_expression(tree.left), evaluate_expression(tree.right)
    if isinstance(tree.op, ast.Add):
        return left + right
    if isinstance(tree.op, ast.Sub):
        return left - right
    if isinstance(tree.op, ast.Mult):
        return left * right
    return left / right


def countdown_score(completion: str, problem: dict) -> Score:
    """1.0 correct, 0.1 well-formed but wrong, 0.0 otherwise (constants above).

    Well-formed: the strict tag format holds and the answer parses as an allowed expression.
    Correct: additionally, its literals are exactly the given numbers (as a multiset) and its
    exact value is the target. Division by zero is simply wrong.
    """
    answer = extract_answer(completion)
    parsed = parse_expression(answer) if answer is not None else None
    if parsed is None:
        return Score(REWARD_NONE, correct=False, formatted=False)
    tree, literals = parsed
    if sorted(literals) != sorted(problem["nums"]):
        return Score(REWARD_FORMAT, correct=False, formatted=True)
    try:
        correct = evaluate_expression(tree) == problem["target"]
    except ZeroDivisionError:
        correct = False
    return Score(REWARD_CORRECT if correct else REWARD_FORMAT, correct=correct, formatted=True)


# ----------------------------------------------------------------------------------------
# digit: the CPU toy task

DIGIT_PROMPTS = [
    "Reply with a single digit.",
    "Say one digit, nothing else.",
    "Pick a digit from 0 to 9.",
    "Answer with a digit.",
]


def digit_messages(problem: dict) -> list[dict]:
    return [{"role": "user", "content": problem["prompt"]}]


def digit_score(completion: str, problem: dict) -> Score:
    """1.0 if the completion's first character is an ASCII digit, else 0.0. Depends on the
    first token only, which is what makes its expected reward computable in closed form."""
    hit = completion[:1] in set("0123456789")
    return Score(REWARD_CORRECT if hit else REWARD_NONE, correct=hit, formatted=hit)


# ----------------------------------------------------------------------------------------

TASKS = ("countdown", "digit")


def load_task(name: str, seed: int = 0, num_problems: int = 20000, dataset: str = "", split: str = "train") -> Task:
    """A task's problems, prompt and scorer. Countdown comes from the offline generator with
    `seed` unless `dataset` names a Hub dataset."""
    if name == "countdown":
        if dataset:
            problems = load_countdown_hub(dataset, split)
        else:
            problems = generate_countdown(num_problems, seed)
        return Task(name, problems, countdown_messages, countdown_score)
    if name == "digit":
        problems = [{"prompt": prompt} for prompt in DIGIT_PROMPTS]
        return Task(name, problems, digit_messages, digit_score)
    raise SystemExit(f"--task {name!r} is not one of: {', '.join(TASKS)}.")
