"""The held-out evaluation of the three training scripts (--eval_every) and the GSM8K
training task (--task gsm8k)."""

import re
from types import SimpleNamespace

import pytest
import torch

import common
import dapo
import grpo
import ppo
from common import load_model, parse_args, read_jsonl
from conftest import ROOT
from grpo import Args, rollout, train
from rewards import load_heldout_task, load_task

DATA = ROOT / "tests" / "fixtures" / "data"


class ScriptedModel(torch.nn.Module):
    """Stands in for a causal LM: at generation step k, row r puts all its mass on script[r][k].
    generate calls it once for the prompts (each distinct prompt once: the problems here are
    distinct), then once per token."""

    def __init__(self, script, rows):
        super().__init__()
        self.script, self.rows, self.calls = torch.tensor(script), rows, 0
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the model a device

    def forward(self, input_ids, **kwargs):
        step, self.calls = self.calls, self.calls + 1
        logits = torch.full((input_ids.shape[0], 1, self.rows), -30.0)
        logits[torch.arange(input_ids.shape[0]), 0, self.script[:, step]] = 10.0
        return SimpleNamespace(logits=logits)


def test_evaluate_heldout_by_hand():
    # The digit task's 4 prompts; row 0 answers "7", row 1 "x", row 2 "3", row 3 "ab…" without
    # ever stopping. Digit reward: 1 when the completion starts with a digit, so rows 0 and 2
    # are correct (and formatted): accuracy = reward = format = 2/4. Lengths 2, 2, 2 and 2
    # (row 3 truncated at max_new_tokens = 2): mean 2; truncated 1/4.
    _, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    token = {text: tokenizer.encode(text, add_special_tokens=False)[0] for text in "7x3ab"}
    eos = eos_ids[0]
    script = [
        [token["7"], eos, eos],
        [token["x"], eos, eos],
        [token["3"], eos, eos],
        [token["a"], token["b"], token["a"]],
    ]
    model = ScriptedModel(script, rows=len(tokenizer) + 8)
    task = load_task("digit")
    metrics = common.evaluate_heldout(rollout, model, tokenizer, eos_ids, task, max_new_tokens=2, batch_size=4)
    assert metrics["eval/accuracy"] == metrics["eval/reward"] == metrics["eval/format"] == 0.5
    assert metrics["eval/length_mean"] == 2.0 and metrics["eval/truncated"] == 0.25
    assert metrics["eval/seconds"] > 0


def test_evaluate_heldout_counts_only_the_asked_format_on_gsm8k():
    # The first two GSM8K test problems (golds 18 and 3). Row 0 ends "\boxed{18}" (strict and
    # flexible: correct); row 1 ends "= 3" with no box, the gold by the flexible last-number
    # fallback only; row 2 boxes the right 18 but never stops (truncated). eval/accuracy is
    # the strict grade, which ignores truncation: rows 0 and 2, so 2/3. eval/reward is the
    # training reward: 1 for row 0, 0 for row 1 (no box), 0 for row 2 (cut): 1/3.
    _, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    task = load_heldout_task("gsm8k", 3, data_dir=str(DATA))
    task.problems = [task.problems[0], task.problems[1], task.problems[0]]
    assert [p["gold"] for p in task.problems] == ["18", "3", "18"]
    texts = ["so \\boxed{18}", "2 + 1 = 3", "\\boxed{18} and"]
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    width = max(len(ids) for ids in encoded) + 1
    eos = eos_ids[0]
    script = [ids + [eos] * (width - len(ids)) for ids in encoded[:2]]
    script.append((encoded[2] * width)[:width])  # no EOS within max_new_tokens = width
    model = ScriptedModel(script, rows=len(tokenizer) + 8)
    metrics = common.evaluate_heldout(rollout, model, tokenizer, eos_ids, task, max_new_tokens=width, batch_size=3)
    assert metrics["eval/truncated"] == pytest.approx(1 / 3)
    assert metrics["eval/accuracy"] == pytest.approx(2 / 3)
    assert metrics["eval/reward"] == pytest.approx(1 / 3)


# Settings of each script that a 4-token run needs: DAPO's length buffer must fit in L_max = 4
# and its dynamic sampling must not skip the steps this test looks at; PPO's 4 completions
# split into mini-batches of 1.
SMALL = {
    grpo: {},
    dapo: {"overlong_buffer": 0, "dynamic_sampling": False},
    ppo: {"num_mini_batches": 1},
}


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=lambda m: m.__name__)
def test_eval_every_logs_held_out_metrics_that_the_readme_explains(tmp_path, script):
    args = script.Args(
        model="tiny", task="digit", max_steps=3, batch_size=2, group_size=2, max_new_tokens=4,
        eval_every=2, eval_problems=3, eval_batch_size=2, output_dir=str(tmp_path), save_every=0, beta=0.0,
        **SMALL[script],
    )  # fmt: skip
    rows = read_jsonl(script.train(args) / "metrics.jsonl")
    evaluated = [r["step"] for r in rows if "eval/accuracy" in r]
    assert evaluated == [2, 3]  # every 2 steps, and at the end
    eval_keys = {k for k in rows[1] if k.startswith("eval/")}
    assert eval_keys == {
        "eval/accuracy",
        "eval/reward",
        "eval/format",
        "eval/length_mean",
        "eval/truncated",
        "eval/seconds",
    }
    documented = set(re.findall(r"^\| `([\w/]+)` \|", (ROOT / "docs" / "metrics.md").read_text(), flags=re.M))
    assert set(rows[1]) - documented == set(), "metrics missing from docs/metrics.md"


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=lambda m: m.__name__)
def test_eval_every_must_not_be_negative(script):
    with pytest.raises(SystemExit, match="--eval_every must be >= 0"):
        script.check_args(script.Args(eval_every=-1))


def test_grpo_trains_on_gsm8k_offline(tmp_path):
    # The command line as a user types it, parsed by the script's own parser, run in-process.
    argv = f"--model tiny --task gsm8k --data_dir {DATA} --max_steps 2 --batch_size 2 --group_size 2"
    argv += f" --max_new_tokens 8 --beta 0 --eval_every 2 --eval_problems 2 --output_dir {tmp_path / 'out'}"
    run_dir = train(parse_args(Args, argv.split()))
    assert run_dir.name.startswith("grpo-gsm8k-tiny-")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert "eval/accuracy" not in rows[0] and 0 <= rows[1]["eval/accuracy"] <= 1
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert "\\boxed{}" in samples[0]["prompt"]  # the GSM8K instruction reached the model
    train_questions = [row["question"] for row in read_jsonl(DATA / "gsm8k" / "train.jsonl")]
    assert any(question in samples[0]["prompt"] for question in train_questions)  # trained on the train split
