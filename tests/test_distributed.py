"""The scripts under torchrun on the CPU: 2 processes (gloo), the tiny model sharded by FSDP2.
Every launch runs with a timeout, so a hang fails the test instead of stalling the suite."""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from common import TRAINER_STATE, read_jsonl
from conftest import ROOT, trainer_state

pytestmark = pytest.mark.launches  # torchrun's processes, in a directory of their own
TIMEOUT = 300  # seconds; a 2-process launch of the tiny model takes ~10-20 on 2 busy cores
CASES = ["grpo-grpo", "grpo-dr_grpo", "grpo-gspo", "grpo-gpg", "grpo-sapo", "dapo-overlong_filter", "ppo-actor"]
CASES += ["ppo-critic", "grpo-clip_cov", "grpo-kl_cov", "grpo-dppo"]  # the techniques of tests/distributed_update.py
CASES += ["grpo-tokens"]  # micro-batches by tokens: the same passes on every rank


class RankCrashed(Exception):
    """A rank of a launch died by a signal: torch's own C++ aborted (SIGABRT) or faulted (SIGSEGV,
    SIGBUS), not a Python error of ours, which exits 1 with its traceback."""


# torchrun's failure report: the rank that failed first died by SIGABRT, SIGBUS or SIGSEGV (a rank
# that raised first, and another that then aborted in gloo, is a Python error: "Root Cause" is 1)
CRASHED = re.compile(r"Root Cause.*?exitcode\s*:\s*-(6|7|11)\b", re.DOTALL)


def launch(args: list, cwd, processes: int | None = 2) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc_per_node 2 …` (processes None: plain
    python). Raises RankCrashed when a rank died by a signal (retried_on_rank_crash)."""
    torchrun = (
        [] if processes is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, *torchrun, *map(str, args)]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if done.returncode != 0 and processes is not None and CRASHED.search(done.stderr):
        raise RankCrashed(done.stderr[-3000:])
    return done


def retried_on_rank_crash(test):
    """The test once more, in a fresh directory, when a launch's rank died by a signal; a Python
    error, a wrong number or a hang (the timeout) fails at once. Torch 2.13's gloo was seen to
    abort in C++ in the middle of a run, "double free or corruption" in one of its threads while
    the main thread waited on an all-gather: once in ~60 launches of tests/distributed_update.py on
    2 busy cores. No Python code can free memory twice; that is torch's. (The other abort seen,
    at exit, is fixed: common.leave_process_group.) Each retry is a warning in pytest's summary."""

    @functools.wraps(test)
    def run(*args, tmp_path, **kwargs):
        try:
            return test(*args, tmp_path=tmp_path, **kwargs)
        except RankCrashed as crash:
            warnings.warn(f"a rank crashed in C++; the test runs once more: {str(crash)[-1500:]}", stacklevel=1)
            (tmp_path / "retry").mkdir()
            return test(*args, tmp_path=tmp_path / "retry", **kwargs)

    return run


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    """tests/distributed_update.py in one process and in two: {launch: {case: result}}."""
    return retried_on_rank_crash(launch_updates)(tmp_path=tmp_path_factory.mktemp("updates"))


def launch_updates(tmp_path) -> dict:
    results = {}
    for name, processes in (("one", None), ("two", 2)):
        out = tmp_path / name
        out.mkdir()
        done = launch([ROOT / "tests" / "distributed_update.py", out], cwd=out, processes=processes)
        assert done.returncode == 0, done.stderr[-3000:]
        results[name] = {case: torch.load(out / f"{case}.pt", weights_only=False) for case in CASES}
    return results


ABORTS = """
import os, sys
if sys.argv[1] == "abort" and os.environ["RANK"] == "1":
    os.abort()  # as torch's C++ does on a double free, or a std::terminate
raise SystemExit(1 if sys.argv[1] == "error" else 0)
"""


def test_a_rank_that_crashes_in_cpp_is_retried_once_and_a_python_error_is_not(tmp_path):
    (tmp_path / "aborts.py").write_text(ABORTS)
    with pytest.raises(RankCrashed, match=r"exitcode\s*: -6"):
        launch([tmp_path / "aborts.py", "abort"], cwd=tmp_path)
    assert launch([tmp_path / "aborts.py", "error"], cwd=tmp_path).returncode == 1  # a failure to assert on
    report = "Failures:\n[1]:\n  exitcode  : -6 (pid: 2)\nRoot Cause (first observed failure):\n[0]:\n  exitcode  : 1"
    assert not CRASHED.search(report)  # rank 0 raised, then rank 1 aborted: the Python error fails the test
    tries = []

    @retried_on_rank_crash
    def crashes(times, tmp_path):
        tries.append(tmp_path)
        if len(tries) <= times:
            raise RankCrashed("terminate called without an active exception")
        return "passed"

    with pytest.warns(UserWarning, match=r"a rank crashed in C\+\+; the test runs once more: terminate called"):
        assert crashes(1, tmp_path=tmp_path) == "passed"
    assert tries == [tmp_path, tmp_path / "retry"]  # the retry starts in an empty directory
    tries.clear()
    with pytest.raises(RankCrashed), pytest.warns(UserWarning):
        crashes(2, tmp_path=tmp_path / "retry")  # once more, not twice: a second crash fails the test


@pytest.mark.xdist_group("updates")  # one worker runs them (-n 2 --dist loadgroup): the fixture launches twice, ~30 s
@pytest.mark.parametrize("case", CASES)
def test_one_update_on_two_processes_equals_one(updates, case):
    # The same 16 rows (4 groups of 4, rewards and log-probs given) as one batch in one process,
    # or as two shares of 2 groups, one a rank, FSDP summing the gradients: every normaliser
    # (GRPO's N, Dr. GRPO's N·L_max, GPG's α and token count, DAPO's tokens after overlong
    # filtering, PPO's whitening sums and token counts, VAPO's positive tokens) is all-reduced,
    # so the gradient is the same up to float32 summation order (measured: ≤ 9e-8 absolute, the
    # largest entries 0.03-0.5) and the weights after one AdamW step agree to 1e-6 (measured:
    # ≤ 2.5e-7 at lr 3e-5). Each gradient entry sums at most N = 16 rows × 12 tokens = 192 tokens'
    # terms: within N·eps (fp32's eps, 1.19e-7) of the largest entry, 2.3e-5 of it (the old bound,
    # 1e-7 absolute, was within 10% of what was measured).
    one, two = updates["one"][case], updates["two"][case]
    assert set(one["weights"]) == set(two["weights"])
    tolerance = 16 * 12 * torch.finfo(torch.float32).eps
    largest = max(g.abs().max().item() for g in one["gradient"].values())
    for name, gradient in one["gradient"].items():
        assert (two["gradient"][name] - gradient).abs().max().item() <= tolerance * largest, name
    assert max(g.abs().max().item() for g in one["gradient"].values()) > 1e-2  # a gradient worth comparing
    for name, weight in one["weights"].items():
        assert (two["weights"][name] - weight).abs().max().item() <= 1e-6, name
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=tolerance)  # its entries' N·eps
    # Clipping scales every rank's shard by the global norm, not the rank's own (torch 2.7-2.9
    # returned a rank's partial norm over FSDP2 gradients): the clipped gradient AdamW steps with
    # is the one-process one, and its norm is max_grad_norm = 1 wherever the norm exceeded it.
    largest = max(g.abs().max().item() for g in one["clipped"].values())
    for name, gradient in one["clipped"].items():
        assert (two["clipped"][name] - gradient).abs().max().item() <= tolerance * largest, name
    clipped_norm = torch.cat([g.flatten() for g in two["clipped"].values()]).norm().item()
    assert clipped_norm == pytest.approx(min(one["grad_norm"], 1.0), rel=1e-4)
    # N·eps relative, and N·eps absolute for a loss whose O(1) terms nearly cancel (clip_cov's: −0.0012)
    assert two["loss"] == pytest.approx(one["loss"], rel=tolerance, abs=tolerance)


SMOKE = ["--model", "tiny", "--task", "digit", "--batch_size", "4", "--group_size", "2", "--max_new_tokens", "6"]
SMOKE += ["--save_every", "1", "--sample_every", "1", "--output_dir", "out"]
EXTRA = {"grpo": ["--ref_ema_decay", "0.9"], "dapo": ["--overlong_buffer", "2", "--overlong_filter"], "ppo": []}
# grpo and ppo run the GPU recipe, forced on the CPU by tests/precision_run.py: fp32 masters, bf16
# autocast, FSDP2 gathering bf16 and reducing fp32; a step that moves the weights (a reward signal
# in 16 prompts of 8 at lr 3e-3), so that a bf16 checkpoint without its masters would show
RECIPE = {"grpo": ["--batch_size", "16", "--group_size", "8", "--max_new_tokens", "2", "--lr", "3e-3"], "dapo": []}
RECIPE["ppo"] = [*RECIPE["grpo"], "--critic_lr", "3e-3"]
RUN = {"grpo": [ROOT / "tests" / "precision_run.py", "grpo"], "dapo": [ROOT / "dapo.py"]}
RUN["ppo"] = [ROOT / "tests" / "precision_run.py", "ppo"]


@pytest.mark.parametrize("script", ["grpo", "dapo", "ppo"])
@retried_on_rank_crash
def test_two_processes_train_save_and_resume(tmp_path, script):
    # 2 steps on 2 ranks (GRPO with its sharded reference moving, T1's EMA): one metrics row a step
    # (rank 0 writes, the others don't), a final checkpoint that plain transformers loads with a
    # trainer state for each rank, then a resume from it on 2 ranks runs the third step. grpo and
    # ppo under the GPU recipe (RECIPE): the checkpoint is bf16, each rank's trainer state holds its
    # shard of the fp32 masters, and after the resumed step they equal a straight 3-step run's, bit
    # for bit, on every rank (ppo's through its critic's values too, saved and resumed beside it).
    flags = [*SMOKE, *EXTRA[script], *RECIPE[script]]
    result = launch([*RUN[script], *flags, "--max_steps", "2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    samples = [s["step"] for s in read_jsonl(run_dir / "samples.jsonl")]  # rank 0's prompts, num_samples = 4 at most
    shown = 4 if RECIPE[script] else 2  # of its 8 (RECIPE's 16 prompts) or 2 (SMOKE's 4)
    assert samples == [1] * shown + [2] * shown if script != "dapo" else set(samples) <= {1, 2} and len(samples) <= 4
    final = run_dir / "final"
    assert (final / TRAINER_STATE).exists() and (final / "trainer_state-rank1.pt").exists()
    assert not list((run_dir / "step-000001").glob("trainer_state*"))  # only the newest keeps it
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    with safe_open(final / "model.safetensors", "pt") as weights:  # the tied head written once, as one process does
        assert "lm_head.weight" not in weights.keys()
    if script == "ppo":
        assert (final / "critic" / "value_head.safetensors").exists()
    resumed = launch([*RUN[script], *flags, "--max_steps", "3", "--resume_from", final], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert (run_dir / "final" / "trainer_state-rank1.pt").exists()
    if script == "dapo":
        return
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    straight = launch(
        [*RUN[script], *flags, "--max_steps", "3", "--save_every", "0", "--output_dir", "a"], cwd=tmp_path
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    (run_a,) = (tmp_path / "a").iterdir()
    for state_file in (TRAINER_STATE, "trainer_state-rank1.pt"):
        a, b = (trainer_state(run / "final" / state_file)["master_weights"] for run in (run_a, run_dir))
        assert a.keys() == b.keys() and {v.dtype for v in a.values()} == {torch.float32}
        assert all(torch.equal(a[k], b[k]) for k in a), state_file
    rewards = [row["reward/mean"] for row in read_jsonl(run_a / "metrics.jsonl")]
    assert sum(rewards[:2]) > 0, rewards  # steps 1-2 had a signal: the masters moved


BUILD_BOTH = """
import sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from common import build_tiny_model
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    dist.barrier()  # rank 1 builds first
build_tiny_model(sys.argv[2])
if dist.get_rank() == 1:
    dist.barrier()
dist.destroy_process_group()
"""


@retried_on_rank_crash
def test_the_tiny_model_built_under_torchrun_is_whole(tmp_path):
    # `torchrun … --model tiny` on a machine that has not built it: every rank builds it into the
    # cache, and the first to finish renames its copy into place. transformers (5.x) writes a
    # model's weights and config on rank 0 alone once torch.distributed is initialised, so rank
    # 1's copy, built first here, held neither, and every later run stopped at "a directory
    # without config.json". Each rank's copy is whole, whichever lands.
    (tmp_path / "build.py").write_text(BUILD_BOTH)
    done = launch([tmp_path / "build.py", ROOT, tmp_path / "cache"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = (tmp_path / "cache").iterdir()
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.config.architectures == ["Qwen2ForCausalLM"] and model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@retried_on_rank_crash
def test_a_batch_that_does_not_split_stops_every_rank_with_one_message(tmp_path):
    # B = 3 prompts over 2 ranks: a group would span ranks. Every rank stops before loading a
    # model; rank 0 alone prints the message; nothing waits, so the launch ends long before its timeout.
    result = launch([ROOT / "grpo.py", *SMOKE, "--batch_size", "3", "--max_steps", "1"], cwd=tmp_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("3 prompts a step do not split over 2 processes") == 1, output[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["grpo", "dapo", "ppo"])
def test_mini_batches_that_do_not_split_a_ranks_rows_stop_before_anything_loads(script, monkeypatch, capsys):
    # Each of K ranks splits its own B·G/K rows into --num_mini_batches. 4 prompts × 2 on 2 ranks:
    # 4 rows a rank. 8 mini-batches left 4 of them empty on each rank, and the first update raised
    # KeyError: 'tokens' after the whole rollout (ppo.py's default, 4, did so at B = 2 on 2 ranks);
    # 3 would split them 2/1/1. 4, 2 and 1 divide 4: they run. Rank 0 alone says why.
    import common

    module = __import__(script)
    monkeypatch.setattr(common, "world_size", lambda: 2)
    args = module.Args(batch_size=4, group_size=2, num_mini_batches=8)
    with pytest.raises(SystemExit) as stop:
        common.check_distributed(args, args.batch_size)
    assert str(stop.value) == (
        "--num_mini_batches 8: each of the 2 processes splits its 4 rows (4 × 2 / 2) into that many "
        "mini-batches, so it must divide 4: e.g. --num_mini_batches 4."
    )
    with pytest.raises(SystemExit, match="e.g. --num_mini_batches 2"):
        common.check_distributed(dataclasses.replace(args, num_mini_batches=3), args.batch_size)
    for fine in (4, 2, 1):
        common.check_distributed(dataclasses.replace(args, num_mini_batches=fine), args.batch_size)
    monkeypatch.setattr(common, "rank", lambda: 1)
    with pytest.raises(SystemExit) as stop:
        common.check_distributed(args, args.batch_size)
    assert stop.value.code == 1  # every rank stops; only rank 0 prints
    monkeypatch.setattr(common, "world_size", lambda: 1)
    common.check_distributed(args, args.batch_size)  # one process: its own check_args has the rule


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shots", "-1"], "--shots must be >= 0"),  # check_args
        (["--maxsteps", "3"], "unrecognized arguments: --maxsteps (did you mean --max_steps?)"),  # argparse
        (["--batch_size", "x"], "invalid int value: 'x'"),  # argparse
    ],
    ids=["check_args", "unknown-flag", "not-a-number"],
)
@retried_on_rank_crash
def test_a_bad_flag_stops_every_rank_with_one_message(flags, message, tmp_path):
    # Checked before the process group is joined, by every process alike: the node's first
    # process alone prints it (it was printed once a rank: 8 times on an 8-GPU node).
    result = launch([ROOT / "grpo.py", *SMOKE, *flags], cwd=tmp_path)
    assert result.returncode != 0
    assert (result.stdout + result.stderr).count(message) == 1, result.stderr[-3000:]


def test_dapo_keeps_as_many_groups_on_every_rank():
    # Rank a kept groups 0 and 2 of round 1 and group 1 of round 2 (3 groups); rank b found 2.
    # Both train on 2, a's first two in order: FSDP pairs each forward pass across ranks.
    from dapo import first_groups, sampling_metrics

    assert first_groups([[0, 2], [1]], 2) == [[0, 2], []]
    assert first_groups([[0, 2], [1]], 1) == [[0], []]
    assert first_groups([[], [3]], 1) == [[], [3]]
    assert first_groups([[0, 2], [1]], 3) == [[0, 2], [1]]  # one process: the groups themselves
    # The counts of 2 ranks, each generating 2 groups of G = 2 and keeping 1: 4 generated, 2 kept.
    batch = SimpleNamespace(rewards=torch.tensor([1.0, 0, 0, 0]), completion_mask=torch.ones(4, 3), scores=[])
    batch.truncated, batch.tool_counts = torch.zeros(4, dtype=torch.bool), None  # as a rollout without tools
    counts = sampling_metrics([batch], groups_kept=1, group_size=2, ranks=2)
    assert counts["sampling/groups_generated"] == 4 and counts["sampling/groups_kept"] == 2


def test_a_finished_run_leaves_the_process_group_in_order(monkeypatch):
    # Under torchrun a finished run waits for every rank, then destroys the process group. The
    # barrier's work is kept to the end (common.LAST_BARRIER): a core dump of a rank that aborted at
    # exit ("terminate called without an active exception") showed gloo's worker thread freeing the
    # barrier's work, and with it the all-reduce before it, whose tensors need the GIL, while the
    # interpreter was exiting. A run that failed leaves it to torchrun (a barrier would wait for
    # ranks that may never come).
    import common

    calls = []

    class Work:
        def wait(self):
            calls.append("wait")

    def barrier(async_op=False):
        calls.append("barrier")
        return Work() if async_op else None

    backend = ["gloo"]
    monkeypatch.setattr(common.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(common.dist, "get_backend", lambda: backend[0])
    monkeypatch.setattr(common.dist, "barrier", barrier)
    monkeypatch.setattr(common.dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(common, "LAST_BARRIER", [])
    run = common.Run.__new__(common.Run)  # the harness's exit alone: no run directory, no model
    run.trackers, run.progress = [], None
    run.__exit__(None, None, None)
    assert calls == ["barrier", "wait", "destroy"]
    assert [type(work) for work in common.LAST_BARRIER] == [Work]  # held, not freed by whichever thread is last
    calls.clear()
    backend[0] = "nccl"  # GPUs: the plain barrier, as measured there
    run.__exit__(None, None, None)
    assert calls == ["barrier", "destroy"] and len(common.LAST_BARRIER) == 1
    calls.clear()
    run.__exit__(RuntimeError, RuntimeError("a step failed"), None)
    assert calls == []
