"""A trainer state is read as data only (issue 57): torch.load(weights_only=True) with numpy's RNG
state allowed (common.trainer_state_globals), so that a trainer_state.pt from elsewhere (a shared
run directory, a downloaded checkpoint) cannot run code as --resume_from reads it, while the
checkpoints nanoPO writes resume as before."""

import json
import pathlib
import shutil

import pytest
import torch

import common
import grpo

TINY = dict(model="tiny", task="digit", max_new_tokens=4, batch_size=2, group_size=2)
MESSAGE = "holds something other than a trainer state"


class OpensAFile:
    """Unpickled, it calls open(path, "w"): the file appears, the proof that the pickle's code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class WritesAFile:
    """Unpickled, it calls pathlib.Path.write_text(path, ...): another way to the same proof."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return (pathlib.Path.write_text, (self.path, "the pickle's code ran"))


def outcome(call):
    """What `call` raised (SystemExit included), or None."""
    try:
        call()
    except BaseException as error:
        return error
    return None


def no_model_load(*args, **kwargs):
    raise AssertionError("a model was loaded")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One grpo.py run of 1 step (final/ holds its trainer state), shared by the tests: each copies it."""
    out = tmp_path_factory.mktemp("runs")
    return grpo.train(grpo.Args(**TINY, max_steps=1, output_dir=str(out)))


@pytest.fixture
def run_dir(tiny_run, tmp_path):
    """A copy of tiny_run's directory, this test's to change."""
    return pathlib.Path(shutil.copytree(tiny_run, tmp_path / tiny_run.name))


@pytest.mark.parametrize("payload", [OpensAFile, WritesAFile], ids=lambda c: c.__name__)
def test_a_planted_trainer_state_is_refused_and_its_code_never_runs(payload, run_dir, tmp_path, monkeypatch):
    # A trainer_state.pt that looks like a real one (step, algo, args) but hides, where the RNG states
    # go, an object whose unpickling writes a file. Expected: the --resume_from check (before any model
    # loads) and the resume itself (load_trainer_state, what Run reads) both stop with a one-line
    # message naming the file and saying it holds something other than a trainer state; the file
    # the pickle would write is never written.
    proof = tmp_path / "pwned.txt"
    state_file = run_dir / "final" / common.TRAINER_STATE
    real = common.load_trainer_state(str(run_dir / "final"))
    torch.save(real | {"rng": {"python": payload(proof)}}, state_file)

    monkeypatch.setattr(common, "load_policy", no_model_load)
    resume_from = str(run_dir / "final")
    check = outcome(  # the --resume_from check, before the model loads
        lambda: grpo.train(grpo.Args(**TINY, max_steps=2, output_dir=str(tmp_path), resume_from=resume_from))
    )
    resume = outcome(lambda: common.load_trainer_state(resume_from))  # the resume itself, what Run reads
    assert not proof.exists(), "the pickle's code ran"
    for stop in (check, resume):
        assert isinstance(stop, SystemExit), repr(stop)
        # one line (the check lists it under "Invalid arguments:", with any other problem of the flags)
        (line,) = [line for line in str(stop).splitlines() if MESSAGE in line]
        assert line.strip().startswith(f"--resume_from {resume_from}: {state_file} {MESSAGE}"), line
        assert "so it was not loaded" in line, line
    assert str(resume).startswith("--resume_from"), str(resume)  # the resume itself: the message alone


def test_a_checkpoint_nanopo_wrote_still_resumes(run_dir, tmp_path):
    # The trainer state a run writes (optimizer, scheduler, step, args and the python, numpy and torch
    # RNG states) loads under the allow-list. Expected: the 1-step run resumed to --max_steps 2 trains
    # step 2 in its own directory, and its new final/ holds a trainer state at step 2 that reads again.
    resumed = grpo.train(grpo.Args(**TINY, max_steps=2, output_dir=str(tmp_path), resume_from=str(run_dir / "final")))
    assert resumed == run_dir
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert common.load_trainer_state(str(run_dir / "final"))["step"] == 2
