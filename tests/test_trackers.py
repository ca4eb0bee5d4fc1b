"""--report_to: every metrics row, the samples and the arguments reach TensorBoard and Weights &
Biases (offline), read back from what each wrote to disk; rank 0 alone reports under torchrun;
a missing library or an unknown tracker stops with a message before a model loads."""

import importlib.util
import json
import struct
import sys
import time

import pytest
from test_distributed import SMOKE, launch, retried_on_rank_crash

import common
import dapo
import grpo
from common import read_jsonl
from conftest import ROOT, crash_and_resume

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util.tensor_util import make_ndarray  # noqa: E402

SETTINGS = dict(model="tiny", task="digit", lr=3e-3, max_new_tokens=4, batch_size=4, group_size=4, save_every=0)


def tensorboard_events(run_dir):
    """The run's TensorBoard events: scalars {tag: [(step, value)]}, texts {tag: [(step, text)]}."""
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    texts = {
        tag.removesuffix("/text_summary"): [
            (e.step, make_ndarray(e.tensor_proto).item().decode()) for e in events.Tensors(tag)
        ]
        for tag in events.Tags()["tensors"]
    }
    return scalars, texts


def wandb_records(run_dir) -> list:
    """wandb_log's records once W&B's service process has written the run's last one (`exit`):
    run.finish() returns before that file is flushed."""
    deadline = time.monotonic() + 60
    while True:
        records = wandb_log(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_log(run_dir) -> list:
    """The records of the run's offline W&B log (<run dir>/wandb/offline-run-*/run-*.wandb): a
    7-byte file header, then 32 KiB blocks of chunks, each a 7-byte header (CRC, length, kind:
    1 whole record, 2 first, 3 middle, 4 last piece) and its bytes; a block's tail shorter than
    a header is padding. Each record is a wandb_internal Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    raw, position, block, records, pieces = path.read_bytes(), 7, 32768, [], b""
    while position + 7 <= len(raw):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        if left < 7 or (length == 0 and kind == 0):  # padding to the end of the block
            position += left
            continue
        pieces += raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def test_tensorboard_gets_every_metric_the_samples_and_the_arguments(tmp_path):
    run_dir = grpo.train(
        grpo.Args(**SETTINGS, max_steps=3, sample_every=2, report_to="tensorboard", output_dir=str(tmp_path))
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")  # metrics.jsonl stays the record
    scalars, texts = tensorboard_events(run_dir)
    assert set(scalars) == set().union(*rows) - {"step"}
    for key, logged in scalars.items():  # every row at its step; TensorBoard stores float32
        assert [step for step, _ in logged] == [row["step"] for row in rows if key in row]
        expected = [row[key] for row in rows if key in row]
        assert [value for _, value in logged] == pytest.approx(expected, rel=1e-6, abs=1e-6, nan_ok=True)
    # The samples as a Markdown table after steps 1 and 3 (sample_every 2), a row per samples.jsonl record.
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert [step for step, _ in texts["samples"]] == [1, 3]
    step_1 = texts["samples"][0][1].split("\n")  # a line a row: line breaks in a cell are <br>
    assert step_1[0] == "| step | prompt | completion | reward |"
    assert len(step_1) == 2 + sum(s["step"] == 1 for s in samples)
    # The arguments as the run's config: a table of --name | value.
    ((_, arguments),) = texts["args"]
    assert "| --model | tiny |" in arguments and "| --report_to | tensorboard |" in arguments


def test_wandb_offline_gets_every_metric_the_samples_and_the_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = dapo.train(
        dapo.Args(
            **SETTINGS, max_steps=2, sample_every=1, overlong_buffer=0, dynamic_sampling=False, report_to="wandb",
            output_dir=str(tmp_path),
        )
    )  # fmt: skip
    rows = read_jsonl(run_dir / "metrics.jsonl")
    records = wandb_records(run_dir)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == run_dir.name
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"] == "tiny" and config["lr"] == 3e-3 and config["algo"] == "dapo"
    history = [
        {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [row["step"] for row in rows]
    for logged, row in zip(history, rows):
        for key, value in row.items():
            if key != "step":
                assert logged[key] == pytest.approx(value, nan_ok=True), key
    # The samples: a wandb.Table a step, written beside the run as JSON, the rows of samples.jsonl.
    tables = sorted((run_dir / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward"]
    first = [s for s in read_jsonl(run_dir / "samples.jsonl") if s["step"] == 1]
    assert [row[2] for row in table["data"]] == [s["completion"] for s in first]


def test_a_resumed_run_reports_each_step_once(tmp_path, monkeypatch):
    # TensorBoard purges the events after the checkpoint's step, which run again: steps 1, 2, 3 once each,
    # the values of the resumed run's metrics.jsonl.
    _, resumed = crash_and_resume(
        grpo,
        tmp_path,
        monkeypatch,
        **{k: v for k, v in SETTINGS.items() if k != "save_every"},
        max_steps=3,
        report_to="tensorboard",
    )
    scalars, _ = tensorboard_events(resumed)
    rows = read_jsonl(resumed / "metrics.jsonl")
    assert [step for step, _ in scalars["reward/mean"]] == [1, 2, 3]
    assert [value for _, value in scalars["reward/mean"]] == pytest.approx([row["reward/mean"] for row in rows])


@retried_on_rank_crash
def test_rank_0_alone_reports_under_torchrun(tmp_path):
    # 2 processes: one TensorBoard event file and one W&B run, every step in each.
    env_args = [*SMOKE, "--max_steps", "2", "--save_every", "0", "--report_to", "tensorboard,wandb"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.delenv("WANDB_SERVICE", raising=False)  # the service an earlier test started here: not theirs
        result = launch([ROOT / "grpo.py", *env_args], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert len(list((run_dir / "tensorboard").iterdir())) == 1
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    scalars, _ = tensorboard_events(run_dir)
    assert [step for step, _ in scalars["reward/mean"]] == [1, 2]
    history = [r for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "history"]
    assert len(history) == 2


@pytest.mark.parametrize(
    "report_to, message",
    [
        ("mlflow", "--report_to 'mlflow': mlflow is not a tracker. Use none, tensorboard, wandb, or several"),
        ("tensorboard,comet", "comet is not a tracker"),
        (",", "--report_to ',': nothing is not a tracker"),
    ],
)
def test_unknown_tracker_stops_with_a_message(report_to, message):
    with pytest.raises(SystemExit) as stop:
        grpo.check_args(grpo.Args(model="tiny", report_to=report_to))
    assert message in str(stop.value)


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_missing_library_stops_with_a_message(name, monkeypatch, tmp_path):
    # Before a model loads: check_args looks for the package without importing it.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *a: None if module == name else real(module, *a))
    with pytest.raises(SystemExit) as stop:
        grpo.check_args(grpo.Args(model="tiny", report_to="tensorboard,wandb"))
    assert f"--report_to {name} needs the {name} package, which is not installed: pip install {name}" in str(stop.value)
    # And where the tracker imports it (a package that is there but cannot import): the same message.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard" if name == "tensorboard" else "wandb", None)
    with pytest.raises(SystemExit, match=f"--report_to {name} needs the {name} package"):
        common.open_trackers(grpo.Args(report_to=name), tmp_path, "grpo")


def test_none_opens_no_tracker_and_imports_nothing(tmp_path):
    assert common.trackers_named("none") == [] and common.open_trackers(grpo.Args(), tmp_path, "grpo") == []
    assert common.trackers_named("wandb, tensorboard,wandb") == ["wandb", "tensorboard"]
    # The training scripts never import a tracker library themselves.
    for script in ("grpo.py", "dapo.py", "ppo.py", "common.py"):
        text = (ROOT / script).read_text()
        assert "\nimport wandb" not in text and "\nfrom torch.utils.tensorboard" not in text


def test_a_wandb_that_does_not_start_stops_with_the_ways_out_and_leaves_no_run(tmp_path, monkeypatch):
    # W&B without a login (online mode) raises its own UsageError from wandb.init, after the model
    # loaded: the run stops with W&B's words and what to do, and its new directory is gone.
    import wandb

    def no_login(**settings):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", no_login)
    with pytest.raises(SystemExit) as stop:
        grpo.train(grpo.Args(**SETTINGS, max_steps=1, report_to="wandb", output_dir=str(tmp_path)))
    assert "W&B did not start a run (UsageError: api_key not configured" in str(stop.value)
    assert "WANDB_MODE=offline" in str(stop.value) and not any(tmp_path.iterdir())
