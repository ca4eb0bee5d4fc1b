"""--config FILE: every Args field from a YAML or JSON file, flags on the command line over it, a
run's own args.json rerunning the run, and a clear stop on a key or value that cannot work."""

import dataclasses
import json
import subprocess
import sys

import pytest

import bench
import dapo
import evaluate
import grpo
import ppo
from common import parse_args, read_jsonl
from conftest import ROOT


def write(path, text):
    path.write_text(text)
    return str(path)


def test_flags_on_the_command_line_override_the_file(tmp_path):
    config = write(tmp_path / "run.yaml", "lr: 2.0e-5\nmax_steps: 7\nbeta: 0.04\n")
    args = parse_args(grpo.Args, ["--config", config, "--max_steps", "9"])
    assert (args.lr, args.max_steps, args.beta) == (2e-5, 9, 0.04)  # the file's, the flag's, the file's
    assert args.group_size == grpo.Args.group_size  # neither: the default
    args = parse_args(grpo.Args, [f"--config={config}", "--beta", "0"])
    assert (args.max_steps, args.beta) == (7, 0.0)


def test_values_take_their_fields_type(tmp_path):
    # YAML reads 2e-5 as a string (it wants 2.0e-5), 2 as an int and 0.5,5 as a string: each becomes
    # what the field holds. JSON's true is a bool.
    config = write(
        tmp_path / "run.yaml", "lr: 2e-5\ncountdown_numbers: 2\nis_mask: 0.5,5\ngradient_checkpointing: yes\n"
    )
    args = parse_args(grpo.Args, ["--config", config])
    assert (args.lr, args.countdown_numbers, args.is_mask, args.gradient_checkpointing) == (2e-5, "2", "0.5,5", True)
    config = write(tmp_path / "run.json", json.dumps({"lr": None, "max_steps": 3.0, "dynamic_sampling": False}))
    args = parse_args(dapo.Args, ["--config", config])
    assert (args.lr, args.max_steps, args.dynamic_sampling) == (None, 3, False)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize(
    "written, meant",
    [("false", False), ("no", False), ("0", False), ("False", False), ("NO", False)]
    + [("true", True), ("yes", True), ("1", True), ("True", True), ("YES", True)],
)
def test_a_quoted_boolean_reads_as_what_it_says(tmp_path, suffix, written, meant):
    # A quoted "false" is a string to YAML and to JSON, not a bool (their bare `no` and `false` are):
    # it must turn the flag off, not on, both for a flag whose default is on (dapo's
    # dynamic_sampling) and one whose default is off (gradient_checkpointing) (issue 42).
    settings = {"dynamic_sampling": written, "gradient_checkpointing": written}
    text = json.dumps(settings) if suffix == ".json" else "".join(f'{k}: "{v}"\n' for k, v in settings.items())
    args = parse_args(dapo.Args, ["--config", write(tmp_path / f"run{suffix}", text)])
    assert (args.dynamic_sampling, args.gradient_checkpointing) == (meant, meant)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_every_field_type_carried_as_a_string(tmp_path, suffix):
    # Each kind of Args field, its value quoted: int, float (YAML's 2e-5 is a string anyway), float | None,
    # str (a quoted "false" stays the text "false": only a bool field reads it as one), bool, list[str].
    settings = {"max_steps": "7", "beta": "2e-5", "lr": "3e-6", "task": "digit", "model": "false", "unbiased_kl": "no"}
    text = json.dumps(settings) if suffix == ".json" else "".join(f'{k}: "{v}"\n' for k, v in settings.items())
    args = parse_args(grpo.Args, ["--config", write(tmp_path / f"run{suffix}", text)])
    assert (args.max_steps, args.beta, args.lr, args.task, args.model, args.unbiased_kl) == (
        7, 2e-5, 3e-6, "digit", "false", False,
    )  # fmt: skip
    listed = json.dumps({"compare": ["runs/a", "7"]}) if suffix == ".json" else 'compare: ["runs/a", "7"]\n'
    assert parse_args(evaluate.Args, ["--config", write(tmp_path / f"list{suffix}", listed)]).compare == ["runs/a", "7"]


@pytest.mark.parametrize(
    "text, message",
    [
        # a string that is no value of the field stops, never a silent default or a flag turned on
        ('gradient_checkpointing: "off"\n', "gradient_checkpointing: needs true or false, not 'off'"),
        ('gradient_checkpointing: ""\n', "gradient_checkpointing: needs true or false, not ''"),
        ('max_steps: "7.5"\n', "max_steps: needs an int, not '7.5'"),
        ('max_steps: "true"\n', "max_steps: needs an int, not 'true'"),
        ('beta: "true"\n', "beta: needs a float, not 'true'"),
        ('lr: "null"\n', "lr: needs a float, not 'null'"),  # a quoted null is text; null unquoted is None
        # NaN compares False with everything, so `beta > 0` would silently drop the KL term: refused
        ('beta: "nan"\n', "beta: needs a float, not 'nan'"),
        ("beta: .nan\n", "beta: needs a float, not nan"),
        ("task: no\n", "task: needs a text, not False"),  # YAML's bare no is a bool, no text
    ],
)
def test_a_string_that_is_no_value_of_its_field_stops(tmp_path, text, message):
    with pytest.raises(SystemExit) as stop:
        parse_args(grpo.Args, ["--config", write(tmp_path / "run.yaml", text)])
    assert message in str(stop.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_step: 7\n", "'max_step' is not a setting (did you mean 'max_steps'?)"),
        ("beta: abc\n", "beta: needs a float, not 'abc'"),
        ("max_steps: 2.5\n", "max_steps: needs an int, not 2.5"),
        ("group_size: true\n", "group_size: needs an int, not True"),
        ("gradient_checkpointing: 3\n", "gradient_checkpointing: needs true or false, not 3"),
        ("max_steps: null\n", "max_steps: needs an int, not null"),
        ("- lr\n- 2\n", "must hold a mapping of settings to values, not a list"),
    ],
)
def test_a_bad_file_stops_with_what_was_wrong(tmp_path, text, message):
    config = write(tmp_path / "run.yaml", text)
    with pytest.raises(SystemExit) as stop:
        parse_args(grpo.Args, ["--config", config])
    assert message in str(stop.value)


def test_a_list_setting_takes_a_list(tmp_path):
    config = write(tmp_path / "run.yaml", "compare: [runs/eval-a, runs/eval-b]\n")
    assert parse_args(evaluate.Args, ["--config", config]).compare == ["runs/eval-a", "runs/eval-b"]
    with pytest.raises(SystemExit, match="compare: needs a list, not 'runs/eval-a'"):
        parse_args(evaluate.Args, ["--config", write(tmp_path / "bad.yaml", "compare: runs/eval-a\n")])


def test_a_missing_or_unknown_kind_of_file_stops(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        parse_args(grpo.Args, ["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(SystemExit, match="must end in .yaml, .yml or .json"):
        parse_args(grpo.Args, ["--config", write(tmp_path / "run.toml", "lr = 1")])
    with pytest.raises(SystemExit, match="--config needs a file"):
        parse_args(grpo.Args, ["--config"])


@pytest.mark.parametrize("module", [grpo, dapo, ppo, evaluate, bench])
def test_every_entry_point_takes_a_config(tmp_path, module):
    config = write(tmp_path / "run.yaml", "model: tiny-llama\ndevice: cpu\n")
    args = parse_args(module.Args, ["--config", config])
    assert (args.model, args.device) == ("tiny-llama", "cpu")


def test_a_runs_args_json_reruns_it(tmp_path):
    # The same metrics, step for step, from the first run's args.json with only --output_dir changed.
    first = grpo.train(
        grpo.Args(
            model="tiny", task="digit", lr=3e-3, batch_size=4, group_size=4, max_new_tokens=8, max_steps=3,
            save_every=0, seed=5, output_dir=str(tmp_path / "a"),
        )
    )  # fmt: skip
    args = parse_args(grpo.Args, ["--config", str(first / "args.json"), "--output_dir", str(tmp_path / "b")])
    second = grpo.train(args)
    timing = ("time/", "throughput/")
    rows = [
        [{k: v for k, v in row.items() if not k.startswith(timing)} for row in read_jsonl(run / "metrics.jsonl")]
        for run in (first, second)
    ]
    assert len(rows[0]) == 3 and rows[0] == rows[1]


def test_the_command_line_takes_a_config(tmp_path):
    config = write(tmp_path / "run.yaml", "model: tiny\ntask: digit\nmax_new_tokens: 4\nbatch_size: 2\ngroup_size: 2\n")
    command = [sys.executable, "grpo.py", "--config", config, "--max_steps", "1", "--save_every", "0"]
    done = subprocess.run([*command, "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (run,) = tmp_path.glob("grpo-digit-*")
    recorded = json.loads((run / "args.json").read_text())
    assert (recorded["max_new_tokens"], recorded["max_steps"], recorded["batch_size"]) == (4, 1, 2)
    assert (
        "--config FILE"
        in subprocess.run([sys.executable, "grpo.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    )


def test_a_file_that_does_not_parse_says_where(tmp_path):
    # The parser's message with its line, not its traceback; a byte-order mark (Windows editors)
    # is read past; bytes that are not UTF-8 are named as such. The study file reads the same way.
    cases = [
        ("run.yaml", b"lr: 1e-6\nbeta: [0.1\n", "--config {}: not valid YAML: "),
        ("run.json", b'{"lr": 1e-6,}', "--config {}: not valid JSON: Expecting property name"),
        ("run.yaml", b"lr: \xff\n", "--config {}: not UTF-8 text"),
    ]
    for name, content, message in cases:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(SystemExit) as stop:
            parse_args(grpo.Args, ["--config", str(tmp_path / name)])
        assert str(stop.value).startswith(message.format(tmp_path / name)), stop.value
    (tmp_path / "bom.yaml").write_bytes("\ufefflr: 2.0e-6\n".encode())
    assert parse_args(grpo.Args, ["--config", str(tmp_path / "bom.yaml")]).lr == 2e-6
    (tmp_path / "study.yaml").write_bytes(b"name: x\narms: {a: [\n")
    with pytest.raises(SystemExit, match=r"(?s)--study .*study.yaml: not valid YAML: .*line 3"):
        evaluate.load_study(str(tmp_path / "study.yaml"))


def test_another_script_s_arguments_are_named_as_such(tmp_path):
    # A run's args.json is a --config for its own script; given to another, one line says whose it
    # is, where a line a setting the other lacks would follow.
    for theirs, ours in ((ppo, grpo), (dapo, ppo), (grpo, dapo)):
        config = tmp_path / f"{theirs.__name__}.json"
        config.write_text(json.dumps(dataclasses.asdict(theirs.Args())))
        with pytest.raises(SystemExit, match=rf"these are {theirs.__name__}.py's arguments .*run {theirs.__name__}.py"):
            parse_args(ours.Args, ["--config", str(config)])
