"""The command line as a user meets it, in all three training scripts: typos, negative
numbers, out-of-range values and wrong tasks stop with a message before any model loads;
Ctrl-C names the newest checkpoint and the command that resumes it; a resumed run records
the arguments it went on with."""

import functools
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import common
import dapo
import grpo
import ppo
from common import load_model, parse_args, resolve_model_name

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [grpo, dapo, ppo]
TINY = dict(model="tiny", task="digit", max_new_tokens=4, batch_size=2, group_size=2)


def tiny_args(script, **settings):
    """script.Args for a tiny run; dapo's overlong buffer (L_cache) must fit in 4 new tokens."""
    extra = {"overlong_buffer": 2} if script is dapo else {}
    return script.Args(**{**TINY, **extra, **settings})


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_negative_numbers_parse_in_every_spelling(script):
    # argparse reads '-1e-6' as a flag ('expected one argument'); parse_args attaches it.
    assert parse_args(script.Args, ["--lr", "-1e-6"]).lr == -1e-6
    assert parse_args(script.Args, ["--lr=-1e-6"]).lr == -1e-6
    assert parse_args(script.Args, ["--seed", "-3", "--max_steps", "7"]).seed == -3
    assert parse_args(script.Args, ["--model", "tiny", "--lr", "2e-6"]).model == "tiny"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_a_mistyped_flag_names_the_closest_one(script, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(script.Args, ["--maxsteps", "3"])
    assert stop.value.code == 2  # argparse's status for a usage error
    assert "unrecognized arguments: --maxsteps (did you mean --max_steps?)" in capsys.readouterr().err


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_help_lists_the_algorithm_first_then_each_shared_group(script, capsys):
    # --help: the script's own Args fields (its algorithm's hyperparameters) under the first title,
    # then common.RunArgs' and rewards.TaskArgs' fields, each under its class's title; every field
    # once. A flag moved into the wrong group (or the groups left as argparse's one list) fails.
    import dataclasses

    from common import RunArgs
    from rewards import TaskArgs

    with pytest.raises(SystemExit):
        parse_args(script.Args, ["--help"])
    text = capsys.readouterr().out
    titles = ["the algorithm's hyperparameters:", "The flags every training script has", "The flags of the task"]
    at = [text.index(title) for title in titles]
    assert at == sorted(at), at
    own = [name for name in script.Args.__annotations__]
    for name, group in (
        [(n, 0) for n in own]
        + [(f.name, 1) for f in dataclasses.fields(RunArgs)]
        + [(f.name, 2) for f in dataclasses.fields(TaskArgs)]
    ):
        where = text.index(f"\n  --{name} ")
        end = at[group + 1] if group < 2 else len(text)
        assert at[group] < where < end, (name, group)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_a_removed_flag_says_what_replaced_it(script, tmp_path):
    # --lm_head_precision (removed: one head, TF32 on a GPU) on the command line, in either spelling,
    # and with any value, stops with the one line; in a --config file, an older run's args.json, the
    # value that did what every run now does (tf32) is accepted, another stops with the same line.
    line = "--lm_head_precision was removed: the LM head runs on TF32 tensor cores on a GPU, fp32 on the CPU"
    for argv in (["--lm_head_precision", "tf32"], ["--lm_head_precision=fp32"]):
        with pytest.raises(SystemExit, match=line):
            parse_args(script.Args, argv)
    config = tmp_path / "args.json"
    config.write_text(json.dumps({"lm_head_precision": "tf32", "max_steps": 7}))
    assert parse_args(script.Args, ["--config", str(config)]).max_steps == 7
    config.write_text(json.dumps({"lm_head_precision": "fp32", "max_steps": 7}))
    with pytest.raises(SystemExit, match=line):
        parse_args(script.Args, ["--config", str(config)])


def no_model_load(*args, **kwargs):
    raise AssertionError("a model was loaded before the arguments were checked")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(lr=-1e-6), "--lr must be > 0 (got -1e-06)"),
        (dict(max_steps=0), "--max_steps must be at least 1 (got 0)"),
        (dict(max_grad_norm=0.0), "--max_grad_norm must be > 0"),
        (dict(adam_beta2=1.0), "--adam_beta2 must be in [0, 1)"),
        (dict(warmup_steps=-1), "--warmup_steps must be >= 0"),
        (dict(dtype="fp16"), "--dtype 'fp16' is not one of"),
        (dict(beta=float("nan")), "--beta is NaN: give it a number"),
        (dict(lr=float("inf")), "--lr is inf: give it a finite number"),
        (dict(beta=float("inf")), "--beta is inf: give it a finite number"),
        # seconds for a SIGALRM: an infinite one cannot be set (OverflowError), so every reward call
        # failed and scored 0; a negative one set no limit at all
        (dict(reward_fn_timeout=float("inf")), "--reward_fn_timeout must be a finite number of seconds > 0 (got inf)"),
        (dict(reward_fn_timeout=-1.0), "--reward_fn_timeout must be a finite number of seconds > 0 (got -1.0)"),
        (dict(tool_timeout=float("inf")), "--tool_timeout must be a finite number of seconds > 0 (got inf)"),
        (dict(max_turns=-1), "--max_turns must be >= 0 (got -1)"),  # issue 59: the flag and its value
        (dict(max_tool_tokens=0), "--max_tool_tokens must be >= 1 (got 0)"),
        (dict(tool_workers=0), "--tool_workers must be >= 1 (got 0)"),  # 1 (the default) runs: every script's run
        (dict(num_mini_batches=3), "divide batch_size * group_size (2 × 2 = 4 rows; got 3)"),
        (dict(resume_from="nowhere"), "--resume_from nowhere: no such directory"),
        (dict(lora_targets="q_proj"), "--lora_targets q_proj: these shape LoRA adapters, and LoRA is off"),
        (dict(lora_alpha=16.0), "add --lora_rank (e.g. 32), or drop them"),
        (dict(resume_from="."), "--resume_from .: no trainer_state.pt there"),
        (dict(task="chess"), "--task 'chess' is not one of: countdown, digit, secret, gsm8k"),
        (dict(task="gsm8k", data_dir="no/such/dir"), "gsm8k/train.jsonl is missing"),
        (dict(task="digit", data_dir="no/such/dir"), "--data_dir is for --task gsm8k"),
        (dict(prompt_format="text"), "--prompt_format 'text' is not one of: auto, chat, plain"),
        (dict(shots=-1), "--shots must be >= 0"),
        (dict(task="countdown", countdown_numbers="1"), "--countdown_numbers '1': give how many numbers"),
        (dict(task="countdown", countdown_numbers="4-3"), "--countdown_numbers '4-3'"),
        (dict(task="digit", countdown_numbers="2"), "--countdown_numbers is for the offline Countdown generator"),
        (dict(task="digit", shots=2), "--shots is for countdown and gsm8k"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_bad_values_stop_before_any_model_loads(script, bad, message, monkeypatch, tmp_path):
    monkeypatch.setattr(common, "load_policy", no_model_load)
    monkeypatch.setattr(common, "load_reference", no_model_load)
    with pytest.raises(SystemExit) as stop:
        script.train(tiny_args(script, **bad, output_dir=str(tmp_path)))
    assert message in str(stop.value)
    assert not any(tmp_path.iterdir())  # no run directory either


@pytest.mark.parametrize("script", [*SCRIPTS, "evaluate"], ids=lambda m: getattr(m, "__name__", m))
def test_an_output_dir_where_a_file_is_stops_before_any_model_loads(script, monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("kept")
    for given in (tmp_path / "a-file", tmp_path / "a-file" / "runs"):
        if script == "evaluate":
            import evaluate

            monkeypatch.setattr(evaluate, "load_model", no_model_load)
            run = functools.partial(
                evaluate.main, evaluate.Args(model="tiny", benchmarks="digit", output_dir=str(given))
            )
        else:
            monkeypatch.setattr(common, "load_policy", no_model_load)
            run = functools.partial(script.train, tiny_args(script, output_dir=str(given)))
        with pytest.raises(SystemExit, match=f"{tmp_path / 'a-file'} is a file, not a directory"):
            run()
    assert (tmp_path / "a-file").read_text() == "kept"


def test_ppo_checks_the_critic_learning_rate(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "load_policy", no_model_load)
    with pytest.raises(SystemExit, match=r"--critic_lr must be > 0 \(got -1e-05\)"):
        ppo.train(tiny_args(ppo, critic_lr=-1e-5, output_dir=str(tmp_path)))


def test_a_model_directory_without_tokenizer_files_says_so(tmp_path):
    # A checkpoint copied without its tokenizer: transformers' own error talks about
    # sentencepiece and tiktoken; ours names the missing files and the fix.
    model_dir = tmp_path / "weights-only"
    shutil.copytree(resolve_model_name("tiny"), model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model_dir / name).unlink(missing_ok=True)
    with pytest.raises(SystemExit, match="no tokenizer files") as stop:
        load_model(str(model_dir), torch.device("cpu"))
    assert "save_pretrained(<this directory>)" in str(stop.value)


def files_of(directory: Path) -> dict:
    return {path: path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_a_resumed_run_records_the_arguments_it_went_on_with(script, tmp_path, monkeypatch):
    first = script.train(tiny_args(script, max_steps=2, sample_every=1, output_dir=str(tmp_path)))
    # Resuming that checkpoint (step 2) with --max_steps 2 would train nothing and rewrite final/ and
    # args.json; with another script, overwrite the run's files (ppo's critic/ dropped) or fail
    # reading them. Each stops before a model loads, every file of the run as it was.
    kept = files_of(first)
    for other in SCRIPTS:
        monkeypatch.setattr(common, "load_policy", no_model_load)
        settings = dict(output_dir=str(tmp_path), resume_from=str(first / "final"))
        if other is script:
            with pytest.raises(
                SystemExit, match="is at step 2 .*--max_steps 2 leaves nothing to train: give --max_steps above 2"
            ):
                other.train(tiny_args(other, max_steps=2, **settings))
        else:
            with pytest.raises(
                SystemExit, match=f"was written by {script.__name__}.py: resume it with {script.__name__}.py"
            ):
                other.train(tiny_args(other, max_steps=3, **settings))
    assert files_of(first) == kept
    monkeypatch.undo()
    resumed = script.train(
        tiny_args(script, max_steps=3, sample_every=2, output_dir=str(tmp_path), resume_from=str(first / "final"))
    )
    assert resumed == first
    now = json.loads((first / "args.json").read_text())
    # resume_from stays empty, so that args.json as a --config reruns the run from its start; the
    # resume is recorded by the earlier arguments' file, named by the step it resumed from.
    assert (now["max_steps"], now["sample_every"], now["resume_from"]) == (3, 2, "")
    before = json.loads((first / "args.before-step-000002.json").read_text())
    assert (before["max_steps"], before["sample_every"], before["resume_from"]) == (2, 1, "")


def test_a_final_checkpoint_without_its_trainer_state_says_it_cannot_resume(tmp_path, monkeypatch):
    # evaluate.py --study_prune deletes a finished run's resume state: "point it at the newest
    # checkpoint" would send the user in a circle; final/ is that one.
    (tmp_path / "final").mkdir()
    monkeypatch.setattr(common, "load_policy", no_model_load)
    with pytest.raises(SystemExit, match=r"so it cannot resume\. Start a new run from its weights: --model .*final"):
        grpo.train(tiny_args(grpo, resume_from=str(tmp_path / "final"), output_dir=str(tmp_path)))


def test_a_checkpoint_saved_before_the_script_s_name_is_known_by_its_arguments(tmp_path, monkeypatch):
    # Trainer states written before they named their script ("algo"): ppo.py's arguments alone hold
    # --critic_lr, dapo.py's --dynamic_sampling.
    (tmp_path / "critic").mkdir()
    (tmp_path / "critic" / "value_head.safetensors").touch()  # what ppo.py's own check looks for
    for name, saved in (("ppo", ppo.Args()), ("dapo", dapo.Args()), ("grpo", grpo.Args())):
        torch.save({"step": 1, "args": vars(saved)}, tmp_path / "trainer_state.pt")
        for script in SCRIPTS:
            monkeypatch.setattr(common, "load_policy", no_model_load)
            settings = tiny_args(script, max_steps=3, resume_from=str(tmp_path), output_dir=str(tmp_path / "runs"))
            if script.__name__ == name:  # past the check: the model loads
                with pytest.raises(AssertionError, match="a model was loaded"):
                    script.train(settings)
            else:
                with pytest.raises(SystemExit, match=f"written by {name}.py"):
                    script.train(settings)


@pytest.mark.parametrize("script", ["grpo.py", "dapo.py", "ppo.py"])
@pytest.mark.launches
def test_ctrl_c_names_the_newest_checkpoint_and_the_resume_command(script, tmp_path):
    # A long run checkpointing every step; SIGINT (what Ctrl-C sends) once step-000002 exists.
    command = [
        sys.executable, str(ROOT / script), "--model", "tiny", "--task", "digit", "--max_new_tokens", "4",
        "--batch_size", "2", "--group_size", "2", "--max_steps", "10000", "--save_every", "1", "--output_dir", "out",
    ] + (["--overlong_buffer", "2"] if script == "dapo.py" else [])  # fmt: skip
    # stderr to a file, not a pipe: nothing reads a pipe while the run trains, and a child whose
    # progress bars and warnings filled one would block on its next write, never reach step 2.
    with open(tmp_path / "stderr.txt", "w") as log:
        # SIGINT as an interactive shell leaves it: a pytest started in the background inherits it ignored
        restore_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
        process = subprocess.Popen(command, cwd=tmp_path, stderr=log, text=True, preexec_fn=restore_sigint)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("out/*/step-000002")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    stderr = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    (run_dir,) = (tmp_path / "out").iterdir()
    newest = max(run_dir.glob("step-*"))  # the checkpoint that keeps the trainer state
    assert (newest / "trainer_state.pt").exists()
    assert last.startswith("Interrupted after ") and f"Newest checkpoint: out/{run_dir.name}/{newest.name}." in last
    assert last.endswith(
        f"Continue with: python {ROOT / script} {' '.join(command[2:])} --resume_from {newest.relative_to(tmp_path)}"
    )


def test_a_checkpoint_saved_by_other_processes_stops_every_rank_with_the_counts(monkeypatch, tmp_path):
    # Read from rank 0's trainer state before the group is joined (torchrun's WORLD_SIZE): rank 1
    # used to look for its own trainer_state-rank1.pt in a one-process checkpoint first, and say
    # that its trainer state had been deleted (evaluate.py --study_prune).
    import common

    saved = {"algo": "grpo", "step": 2, "args": {"max_steps": 4}, "world_size": 1}
    torch.save(saved, tmp_path / common.TRAINER_STATE)
    args = grpo.Args(resume_from=str(tmp_path), max_steps=6)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert common.resume_problems(args, "grpo") == [
        f"--resume_from {tmp_path} was saved by 1 process: resume with as many (now 2)."
    ]
    torch.save(saved | {"world_size": 2}, tmp_path / common.TRAINER_STATE)
    assert common.resume_problems(args, "grpo") == []
    monkeypatch.delenv("WORLD_SIZE")
    assert common.resume_problems(args, "grpo") == [
        f"--resume_from {tmp_path} was saved by 2 processes: resume with as many (now 1)."
    ]


def test_the_resume_command_under_torchrun_launches_as_many_processes(monkeypatch):
    # A checkpoint resumes on as many processes as saved it: under torchrun the command Ctrl-C and
    # an out-of-memory error print is torchrun's, with the launch's processes (it was `python …`,
    # which stopped at "saved by 2 processes: resume with as many (now 1)").
    import common

    monkeypatch.setattr(sys, "argv", ["grpo.py", "--model", "tiny", "--resume_from", "old", "--max_steps", "9"])
    assert common.resume_command("grpo.py", Path("runs/r/step-000004")) == (
        "python grpo.py --model tiny --max_steps 9 --resume_from runs/r/step-000004"
    )
    monkeypatch.setattr(common, "world_size", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert common.resume_command("grpo.py", Path("runs/r/step-000004")) == (
        "torchrun --nproc_per_node=8 --nnodes=2 grpo.py --model tiny --max_steps 9 --resume_from runs/r/step-000004"
        " (on every node, with the launch's own rendezvous options)"
    )
    monkeypatch.setattr(common, "world_size", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert common.resume_command("grpo.py", Path("c")).startswith("torchrun --nproc_per_node=2 grpo.py --model tiny")


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llama-nosystem"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_every_script_trains_a_llama_model_with_its_own_template(script, model, tmp_path):
    # Countdown's prompt has a system message: tiny-llama's template keeps it, the nosystem
    # template raises on it and render_chat folds it into the user turn. Two steps, a
    # checkpoint, and the final model loads back with its template.
    settings = dict(model=model, task="countdown", max_new_tokens=8, batch_size=2, group_size=2, max_steps=2)
    if script is dapo:  # the random model solves nothing: without this, DAPO keeps no group and skips
        settings["dynamic_sampling"] = False
    run_dir = script.train(tiny_args(script, **settings, save_every=1, output_dir=str(tmp_path)))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["policy/sample_logp_diff"] < 1e-5 for r in rows)  # sampler and scorer agree (fp32)
    loaded, tokenizer, _ = load_model(str(run_dir / "final"), torch.device("cpu"))
    assert loaded.config.model_type == "llama"
    assert tokenizer.chat_template == load_model(model, torch.device("cpu"))[1].chat_template
