"""Micro-batches sized before step 1 (common.size_micro_batches, common.preflight): the most rows of
the longest sequence a run can produce whose pass fits the GPU, found by measurement, as a token
budget for every micro-batch and scoring chunk (chunks_of); an explicit size wins; a CPU keeps 4 and
8 rows. The preflight's search is checked here with peaks given by hand; on a GPU, tests/test_cuda.py."""

import pytest
import torch

import dapo
import grpo
import ppo
from common import UNSIZED_ROWS, longest_prompt, pass_speeds, preflight, size_micro_batches
from rewards import load_task

GiB = 2**30


def linear_peaks(base: float, per_row: float, measured: list, limit: float = float("inf")):
    """A fake measure(run, rows): base + per_row · rows GiB (inf from `limit` rows on), recording the rows."""

    def measure(run, rows):
        measured.append(rows)
        return float("inf") if rows >= limit else (base + per_row * rows) * GiB

    return measure


def test_preflight_doubles_then_fills_the_budget_along_the_line():
    # Peaks of 10 + 3·rows GiB against a budget of 40: 1, 2, 4, 8 rows fit (13, 16, 22, 34); the line
    # through 4 and 8 (3 GiB a row) puts 16 at 58, over, so 16 is not run (under torchrun an
    # out-of-memory error would strand the other ranks); it puts 10 at 34 + 3·2 = 40, and 10 rows,
    # run once more, fit: 10.
    measured = []
    assert preflight(None, 64, "--flags", 40 * GiB, linear_peaks(10, 3, measured), "pass") == 10
    assert measured == [1, 2, 4, 8, 10]


def test_preflight_stops_at_the_rows_there_are():
    measured = []  # a mini-batch of 6 rows: 1, 2, 4, then 6, all within the budget
    assert preflight(None, 6, "--flags", 40 * GiB, linear_peaks(10, 3, measured), "pass") == 6
    assert measured == [1, 2, 4, 6]


def test_preflight_keeps_what_fitted_when_the_line_overreaches():
    # The same line, but 9 rows and more run out of memory (fragmentation, a kernel's workspace):
    # 10, the line's guess, fails, and 8, the last measured to fit, stays.
    measured = []
    assert preflight(None, 64, "--flags", 40 * GiB, linear_peaks(10, 3, measured, limit=9), "pass") == 8
    assert measured == [1, 2, 4, 8, 10]


def test_the_preflight_says_what_each_size_of_pass_runs_at():
    # Its passes, timed as they ran, as tokens per second: 1 row of 1,000 tokens in 0.5 s is 2.0k
    # tok/s, 4 rows in 0.8 s 5.0k; 256 rows of scoring in 3.2 s 80.0k; each with the second at which
    # the host had launched all of it (0.45 of 0.5: the GPU waited on the host; 0.1 of 3.2: the host
    # on the GPU).
    timings = {"micro_batch": {1: (0.5, 0.45), 4: (0.8, 0.5)}, "logprob_chunk": {256: (3.2, 0.1)}}
    expected = (
        "micro_batch: 1 row 2.0k tok/s (host 0.45 of 0.50 s), 4 rows 5.0k tok/s (host 0.50 of 0.80 s); "
        "logprob_chunk: 256 rows 80.0k tok/s (host 0.10 of 3.20 s)"
    )
    assert pass_speeds(timings, 1000) == expected


def test_preflight_stops_the_run_when_one_row_does_not_fit():
    with pytest.raises(SystemExit) as stop:
        preflight(None, 64, "--micro_batch_tokens or --micro_batch_size, --lora_rank 32", 40 * GiB,
                  linear_peaks(41, 3, []), "micro_batch of 1280 tokens")  # fmt: skip
    message = str(stop.value)
    assert "one row of the micro_batch of 1280 tokens does not fit: 44.0 GiB at its peak" in message
    assert "over the 40.0 GiB left of 80% of this GPU" in message and "--lora_rank 32" in message
    with pytest.raises(SystemExit, match="one row of the pass does not fit: ran out of memory, over"):
        preflight(None, 64, "--flags", 40 * GiB, linear_peaks(10, 3, [], limit=1), "pass")


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=lambda s: s.__name__)
def test_on_a_cpu_the_unset_sizes_are_rows_and_no_pass_runs(script):
    # No GPU memory to measure: 4 rows a micro-batch and 8 a scoring chunk where neither rows nor
    # tokens are given (the defaults before the preflight, so CPU runs are unchanged); what is given stays.
    from common import load_model

    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    task = load_task("digit", seed=0, num_problems=4)
    never = lambda sequences: pytest.fail("no preflight pass on a CPU")  # noqa: E731
    args = script.Args(model="tiny")
    assert (args.micro_batch_size, args.micro_batch_tokens, args.logprob_chunk_size, args.logprob_chunk_tokens) == (
        0, 0, 0, 0,
    )  # fmt: skip
    size_micro_batches(args, task, tokenizer, [model], never, never)
    assert (args.micro_batch_size, args.logprob_chunk_size) == (4, 8) == tuple(UNSIZED_ROWS.values())
    given = script.Args(model="tiny", micro_batch_tokens=2000, logprob_chunk_size=3)
    size_micro_batches(given, task, tokenizer, [model], never, never)
    assert (given.micro_batch_size, given.micro_batch_tokens, given.logprob_chunk_size) == (0, 2000, 3)


def test_longest_prompt_is_the_widest_a_step_pads_to():
    from common import load_model

    _, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    task = load_task("countdown", seed=0, num_problems=6)
    prompt_ids, _ = grpo.encode_prompts(tokenizer, [task.messages(p) for p in task.problems], 1, "cpu")
    assert longest_prompt(tokenizer, task) == prompt_ids.shape[1]
    # With tools, the prompts show their schemas: the preflight counts them too.
    _, tokenizer, _ = load_model("tiny-tools", torch.device("cpu"))
    task = load_task("secret")
    prompt_ids, _ = grpo.encode_prompts(tokenizer, [task.messages(p) for p in task.problems], 1, "cpu", task.tools)
    without, _ = grpo.encode_prompts(tokenizer, [task.messages(p) for p in task.problems], 1, "cpu")
    assert longest_prompt(tokenizer, task) == prompt_ids.shape[1] > without.shape[1]


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=lambda s: s.__name__)
def test_negative_sizes_are_refused(script):
    with pytest.raises(SystemExit, match="--micro_batch_tokens must be >= 0"):
        script.check_args(script.Args(model="tiny", micro_batch_tokens=-1))
