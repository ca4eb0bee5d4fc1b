"""The study runner (python evaluate.py --study FILE): it trains the arms that have not finished,
resumes an interrupted one from its newest checkpoint, skips what is done, evaluates each arm once,
and reports each finding with numbers that the runs' own files give again; verdicts and the GPU
estimate by hand; bad study files stop before anything trains."""

import json
import math
import shutil

import pytest

import common
import evaluate
import grpo
from common import parse_args, read_jsonl
from conftest import ROOT
from evaluate import Args, Outcome, judge, load_study, run_study, wilson_interval

# One worker runs this file when the suite runs in processes (-n 2 --dist loadgroup): its module
# fixture trains and evaluates a study (~40 s), which every worker would otherwise repeat.
pytestmark = pytest.mark.xdist_group("tiny_study")
TINY = str(ROOT / "recipes" / "study-tiny.yaml")
TWO = "arms: {a: {set: {model: tiny}}, b: {script: grpo.py, recipe: ok.yaml}}\n"  # a base and a trained arm


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    """recipes/study-tiny.yaml run once: two tiny GRPO arms of 10 steps and the base model, ~25 s."""
    output = tmp_path_factory.mktemp("studies")
    return run_study(Args(study=TINY, output_dir=str(output)))


def runs_in(folder):
    """The run directories in an arm's folder (beside them: config.json, the settings it ran with)."""
    return [path for path in folder.iterdir() if path.is_dir()]


def recorded_commands(monkeypatch):
    """Every command the runner starts, run for real."""
    commands, real = [], evaluate.run_command
    monkeypatch.setattr(evaluate, "run_command", lambda command, what: (commands.append(command), real(command, what)))
    return commands


def test_the_runner_trains_evaluates_and_reports(tiny_study):
    for arm in ("g4", "g2"):
        (run,) = runs_in(tiny_study / "arms" / arm / "seed0")
        assert (run / "final").is_dir() and len(read_jsonl(run / "metrics.jsonl")) == 10
    for arm in ("base", "g4", "g2"):
        assert len(list((tiny_study / "evals" / arm / "seed0").glob("*/results.json"))) == 1
    report = (tiny_study / "report.md").read_text()
    assert "#### 1. G = 4 is more stable and more accurate than G = 2" in report
    assert "#### 2. both arms beat the random model, G = 4 best" in report
    assert (tiny_study / "finding-1.png").stat().st_size > 0 and (tiny_study / "finding-2.png").stat().st_size > 0


def test_a_report_only_run_trains_nothing(tiny_study, tmp_path, monkeypatch):
    # A copy without g2's runs: the report says g2 has not run, and nothing starts.
    study = shutil.copytree(tiny_study, tmp_path / tiny_study.name)
    shutil.rmtree(study / "arms" / "g2")
    commands = recorded_commands(monkeypatch)
    run_study(Args(study=TINY, output_dir=str(tmp_path), study_report_only=True))
    report = (study / "report.md").read_text()
    assert commands == [] and "**not run yet: g2**" in report and "| g2 | grpo.py --config" in report


def test_a_finished_study_starts_nothing(tiny_study, monkeypatch):
    commands = recorded_commands(monkeypatch)
    before = (tiny_study / "report.md").read_text()
    run_study(Args(study=TINY, output_dir=str(tiny_study.parent)))
    assert commands == []
    assert (tiny_study / "report.md").read_text() == before


def test_prune_deletes_only_what_an_evaluated_run_no_longer_needs(tiny_study, tmp_path, monkeypatch):
    # A copy of the finished study, run again with --study_prune: nothing trains or evaluates, each
    # trained run loses its step-* checkpoint (step 5 of 10 here; step 10 is final/) and final/'s resume
    # state, and keeps final/'s weights, its metrics and samples; the report stays; a rerun starts nothing.
    study = shutil.copytree(tiny_study, tmp_path / tiny_study.name)
    runs = [run for arm in ("g4", "g2") for run in runs_in(study / "arms" / arm / "seed0")]
    assert all([p.name for p in run.glob("step-*")] == ["step-000005"] for run in runs)
    assert all((run / "final" / "trainer_state.pt").is_file() for run in runs)
    kept = {f for run in runs for f in run.rglob("*") if "step-" not in str(f) and "trainer_state" not in f.name}
    commands = recorded_commands(monkeypatch)
    run_study(Args(study=TINY, output_dir=str(tmp_path), study_prune=True))
    assert commands == []
    for run in runs:
        assert not list(run.glob("step-*")) and not list(run.glob("final/trainer_state*"))
        assert (run / "final" / "model.safetensors").is_file()
    assert {f for run in runs for f in run.rglob("*")} == kept
    assert (study / "report.md").read_text() == (tiny_study / "report.md").read_text().replace(
        str(tiny_study.parent), str(tmp_path)
    )
    run_study(Args(study=TINY, output_dir=str(tmp_path), study_prune=True))
    assert commands == []


def test_an_interrupted_arm_resumes_from_its_newest_checkpoint(tiny_study, tmp_path, monkeypatch):
    # A copy of the study whose g4 arm was stopped while writing final/ (its checkpoint of step 5,
    # with the trainer state, is the newest whole one) and never evaluated: the runner resumes it
    # from step 5 and gets the finished run's metrics, step for step.
    study = shutil.copytree(tiny_study, tmp_path / tiny_study.name)
    shutil.rmtree(study / "arms" / "g4")
    shutil.rmtree(study / "evals" / "g4")
    real_save = common.save_checkpoint

    def crash_on_final(path, *rest, **options):
        if path.name == "final":
            raise KeyboardInterrupt("simulated crash")
        real_save(path, *rest, **options)

    monkeypatch.setattr(common, "save_checkpoint", crash_on_final)
    recipe = str(ROOT / "recipes" / "tiny" / "grpo-digit.yaml")
    args = parse_args(
        grpo.Args, ["--config", recipe, "--seed", "0", "--output_dir", str(study / "arms" / "g4" / "seed0")]
    )
    with pytest.raises(SystemExit):
        grpo.train(args)
    monkeypatch.setattr(common, "save_checkpoint", real_save)
    (run,) = runs_in(study / "arms" / "g4" / "seed0")
    assert not (run / "final").exists() and (run / "step-000005").is_dir()
    commands = recorded_commands(monkeypatch)
    run_study(Args(study=TINY, output_dir=str(tmp_path)))
    train, evaluation = commands
    assert train[train.index("--resume_from") + 1] == str(run / "step-000005")
    config = json.loads(open(evaluation[evaluation.index("--config") + 1]).read())
    assert (config["model"], config["seed"], config["benchmarks"]) == (str(run / "final"), 0, "digit")
    (finished,) = runs_in(tiny_study / "arms" / "g4" / "seed0")
    timing = ("time/", "throughput/")
    rows = [
        [{k: v for k, v in row.items() if not k.startswith(timing)} for row in read_jsonl(path / "metrics.jsonl")]
        for path in (run, finished)
    ]
    assert len(rows[0]) == 10 and rows[0] == rows[1]


def test_the_reports_numbers_come_from_the_runs_files(tiny_study):
    report = (tiny_study / "report.md").read_text()
    for arm in ("base", "g4", "g2"):
        (results,) = (tiny_study / "evals" / arm / "seed0").glob("*/results.json")
        digit = json.loads(results.read_text())["results"]["digit"]
        low, high = wilson_interval(digit["strict_accuracy"], digit["n"])
        cell = f"{100 * digit['strict_accuracy']:.1f}% ({100 * low:.1f}–{100 * high:.1f}, n = {digit['n']})"
        assert f"| {arm} | " in report and cell in report
    for arm in ("g4", "g2"):  # the step-to-step spread: the population std of the reward curve's changes
        (run,) = runs_in(tiny_study / "arms" / arm / "seed0")
        rewards = [row["reward/mean"] for row in read_jsonl(run / "metrics.jsonl")]
        changes = [b - a for a, b in zip(rewards, rewards[1:])]
        average = sum(changes) / len(changes)
        spread = math.sqrt(sum((c - average) ** 2 for c in changes) / len(changes))
        assert f"| {arm} | 1 | " in report and f"| {spread:.3f} | nan |" in report
        entropy = [row["policy/entropy"] for row in read_jsonl(run / "metrics.jsonl")]  # first and last step's
        assert f"| {arm} | grpo.py --config" in report and f" | {entropy[0]:.3f} → {entropy[-1]:.3f} | " in report
    assert " as it is | 1 of 1 | " in report and " | — | — |" in report  # the base: no training, entropy, minutes


def outcome(arm, correct, n=100, rows=(), run_dir=None):
    return Outcome(arm, 0, run_dir, list(rows), correct, n, 30.0)


def test_accuracy_verdicts_by_hand():
    # Wilson 95% intervals, n = 100: 60% -> (50.2, 69.1), 30% -> (21.9, 39.6): apart; 45% -> (35.6,
    # 54.8) and 40% -> (30.9, 49.8): they overlap.
    finding = {"metric": "accuracy", "arms": ["a", "b"]}
    assert wilson_interval(0.6, 100)[0] == pytest.approx(0.502, abs=1e-3)
    assert judge(finding, {"a": [outcome("a", 60)], "b": [outcome("b", 30)]})[1].startswith("holds")
    assert judge(finding, {"a": [outcome("a", 45)], "b": [outcome("b", 40)]})[1].startswith("not shown")
    assert judge(finding, {"a": [outcome("a", 30)], "b": [outcome("b", 60)]})[1].startswith("does not hold")
    # Seeds: the mean of 20% and 40% is 30%, with one evaluation's interval (21.9, 39.6): the seeds answer
    # the same 100 problems, so 200 answers would overstate the certainty; each seed's beside it.
    rows, _ = judge(finding, {"a": [outcome("a", 20), outcome("a", 40)], "b": [outcome("b", 60)]})
    assert rows[0]["held-out accuracy"] == "30.0% (21.9–39.6, n = 100); seeds 20.0, 40.0"
    assert judge(finding, {"a": [], "b": [outcome("b", 60)]})[1] == "not run yet: a"
    # Seeds that disagree show nothing: a's 25% and 0% (mean 12.5%, one evaluation's interval 8.6–17.8
    # at n = 200) against b's 0% and 0% (0.0–1.9): the intervals lie apart, but a's seed at 0% is no
    # better than b's. With seeds 30%, 40% against 10%, 20% (n = 100: 26.4–44.7 against 9.3–23.3) every
    # seed of a lies above every seed of b: it holds.
    split = {"a": [outcome("a", 50, n=200), outcome("a", 0, n=200)], "b": [outcome("b", 0, n=200)] * 2}
    assert judge(finding, split)[1] == (
        "not shown: the intervals lie apart but the seeds overlap (a 0.0–25.0%, b 0.0–0.0%)"
    )
    apart = {"a": [outcome("a", 30), outcome("a", 40)], "b": [outcome("b", 10), outcome("b", 20)]}
    assert judge(finding, apart)[1] == "holds: a's interval lies above b's"


def test_length_cost_and_sweep_verdicts_by_hand(tmp_path):
    # length: the second half of each curve, [30, 32] against [20, 22]: means 31 and 21, each spread
    # 1 over 2 values, standard error √(1/2 + 1/2) = 1: a difference of 10 > 2: holds.
    rows = lambda lengths: [{"completion/length_mean": v, "reward/mean": 0.0} for v in lengths]  # noqa: E731
    longer, shorter = outcome("a", 50, rows=rows([0, 0, 30, 32])), outcome("b", 50, rows=rows([0, 0, 20, 22]))
    _, verdict = judge({"metric": "length", "arms": ["a", "b"]}, {"a": [longer], "b": [shorter]})
    assert verdict == "holds: +10.0 tokens, standard error 1.0 over steps of one seed"
    # With two seeds each, the samples are the seeds' means: [31, 33] against [21, 21]: 11 ± √(1/2) = 0.71
    two = [outcome("a", 50, rows=rows([0, 0, 32, 34])), longer], [shorter, outcome("b", 50, rows=rows([0, 0, 20, 22]))]
    _, verdict = judge({"metric": "length", "arms": ["a", "b"]}, {"a": two[0], "b": two[1]})
    assert verdict == "holds: +11.0 tokens, standard error 0.7 over seeds"
    # cost: DAPO logs the groups it generated (12 and 20 a step: 16); the other arm's a step is its B (4).
    for name, batch in (("a", 4), ("b", 4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "args.json").write_text(
            json.dumps({"batch_size": batch, "beta": {"a": 0.0, "b": 0.01}[name]})
        )
    costly = outcome(
        "a", 45, rows=[{"sampling/groups_generated": 12}, {"sampling/groups_generated": 20}], run_dir=tmp_path / "a"
    )
    cheap = outcome("b", 40, rows=[{"time/generate": 1.0}], run_dir=tmp_path / "b")
    _, verdict = judge({"metric": "cost", "arms": ["a", "b"]}, {"a": [costly], "b": [cheap]})
    assert verdict == "holds: 4.00× the groups generated, and no accuracy shown gained"
    # sweep over beta: 0 -> 30%, 0.01 -> 60%, 0.04 -> 20%: the middle is best and clear of both ends.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "args.json").write_text(json.dumps({"batch_size": 4, "beta": 0.04}))
    sweep = {"metric": "sweep", "setting": "beta", "arms": ["a", "b", "c"], "best": "b"}
    points = {"a": [outcome("a", 30, run_dir=tmp_path / "a")], "b": [outcome("b", 60, run_dir=tmp_path / "b")]}
    points["c"] = [outcome("c", 20, run_dir=tmp_path / "c")]
    rows, verdict = judge(sweep, points)
    assert [row["beta"] for row in rows] == [0.0, 0.01, 0.04]
    assert verdict == "holds: b lies above both ends of the sweep"
    points["a"] = [outcome("a", 70, run_dir=tmp_path / "a")]  # (60.4, 78.1): above b's 60, not clearly
    assert judge(sweep, points)[1] == "not shown: b overlaps an end of the sweep"
    points["a"] = [outcome("a", 85, run_dir=tmp_path / "a")]  # (76.7, 90.7): clearly above b's (50.2, 69.1)
    assert judge(sweep, points)[1] == "does not hold: a lies above b"


def test_the_gpu_estimate_by_hand(capsys, tmp_path):
    # grpo at the paper's scale (P = 1.54e9, N = 32·8 = 256, T = 1024, 200 + 1024 = 1224 tokens a
    # sequence, β > 0, μ = 1), a step:
    #   generation 2·P·N·T = 8.074e14; scoring 2·P·N·1224 × 2 (policy and reference) = 1.930e15;
    #   update 6·P·N·1224 = 2.895e15; 5.632e15 a step, × 500 steps = 2.816e18 FLOPs,
    #   / 4e14 FLOP/s = 7040 s = 1.956 H100-hours.
    study = load_study(str(ROOT / "recipes" / "study-paper.yaml"))
    assert evaluate.gpu_hours([(study["arms"]["grpo"], 0, "new")]) == pytest.approx(1.956, abs=1e-3)
    assert evaluate.gpu_hours([(study["arms"]["grpo"], 0, "finished")]) == 0
    run_study(Args(study=str(ROOT / "recipes" / "study-paper.yaml"), study_dry_run=True, output_dir=str(tmp_path)))
    printed = capsys.readouterr().out
    assert printed.count(" new ") == 27 and "an estimate, not a measurement" in printed and "H100-hours" in printed
    assert not (tmp_path / "study-paper").exists()  # a dry run trains nothing


@pytest.mark.parametrize(
    "text, message",
    [
        ("arms: {}\n", "arms: a mapping of arm names"),
        ("arms: {a: {script: sft.py, recipe: x.yaml}}\n", "arm a: needs a script, one of grpo.py, dapo.py, ppo.py"),
        ("arms: {a: {script: grpo.py}}\n", "arm a: needs a script, one of grpo.py, dapo.py, ppo.py, and a recipe"),
        ("arms: {a: {script: grpo.py, recipe: r.yaml}}\n", "arm a: --config"),  # the recipe's typo
        ("arms: {a: {script: grpo.py, recipe: ok.yaml, set: {max_step: 3}}}\n", "'max_step' is not a setting"),
        ("arms: {a: {script: grpo.py, recipe: ok.yaml, sets: {}}}\n", "arm a: unknown keys ['sets']"),
        ("arms: {a: {script: grpo.py, recipe: ok.yaml, seeds: []}}\n", "arm a: seeds must be a non-empty list"),
        ("arms: {a: {}}\n", "arm a: an arm without a script is a model evaluated as it is: set its model alone"),
        ("arms: {a: {set: {model: tiny}}}\nevaluate: {model: x}\n", "evaluate: the runner sets ['model'] itself"),
        ("arms: {a: {set: {model: tiny}}}\nevaluate: {benchmark: digit}\n", "'benchmark' is not a setting"),
        (TWO + "findings: [{claim: c, metric: speed, arms: [a, b]}]\n", "metric 'speed' is not one of"),
        (TWO + "findings: [{claim: c, metric: accuracy, arms: [a, c]}]\n", "(unknown: ['c'])"),
        (TWO + "findings: [{metric: accuracy, arms: [a, b]}]\n", "with a claim"),
        (TWO + "findings: [{claim: c, metric: cost, arms: [a, b]}]\n", "a cost finding reads training curves"),
        (TWO + "findings: [{claim: c, metric: sweep, arms: [b, b], best: b, setting: betta}]\n", "a number every arm"),
        ("arms: {a: {set: {model: tiny}}}\nseed: 1\n", "unknown keys ['seed']"),
    ],
)
def test_a_bad_study_file_stops_before_anything_trains(tmp_path, text, message):
    # Each mistake stops load_study, before any arm trains, with what was wrong.
    (tmp_path / "r.yaml").write_text("max_step: 3\n")  # a recipe with a typo
    (tmp_path / "ok.yaml").write_text("model: tiny\ntask: digit\n")
    (tmp_path / "study.yaml").write_text(text)
    with pytest.raises(SystemExit) as stop:
        load_study(str(tmp_path / "study.yaml"))
    assert message in str(stop.value)


def test_the_report_goes_into_a_document(tiny_study, tmp_path):
    document = tmp_path / "learning.md"
    document.write_text("# Before\n\n<!-- study:tiny -->\nOLD REPORT\n<!-- /study:tiny -->\n\nAfter\n")
    study = load_study(TINY)
    evaluate.write_into(document, study, tiny_study, (tiny_study / "report.md").read_text())
    text = document.read_text()
    assert "OLD REPORT" not in text and text.startswith("# Before") and text.endswith("After\n")
    assert "![finding 1](study-tiny-finding-1.png)" in text and (tmp_path / "study-tiny-finding-1.png").is_file()
    document.write_text("no markers\n")
    with pytest.raises(SystemExit, match="add the lines <!-- study:tiny --> and <!-- /study:tiny -->"):
        evaluate.write_into(document, study, tiny_study, "report")


def test_a_run_made_with_other_settings_stops_the_study(tiny_study):
    # The recipe changed after the arm trained (lr 3e-3 -> 1e-2): the finished run is not this arm's.
    study = load_study(TINY)
    arm = study["arms"]["g4"]
    arm.settings = {"lr": 0.01}
    with pytest.raises(SystemExit, match=r"trained with other settings than arm g4's now: lr 0\.003 -> 0\.01"):
        evaluate.arm_state(arm, 0, tiny_study)
    # A run whose args.json records a setting this runner's grpo.Args lacks (the code gained one while
    # the study ran): not "other settings", but code newer than the runner's, which a restart loads.
    arm.settings = {}
    (run,) = runs_in(tiny_study / "arms" / "g4" / "seed0")
    recorded = (run / "args.json").read_text()
    try:
        (run / "args.json").write_text(json.dumps({**json.loads(recorded), "new_setting": 1}))
        with pytest.raises(
            SystemExit, match=r"newer grpo\.py than this study runner loaded \(it records new_setting\)"
        ):
            evaluate.arm_state(arm, 0, tiny_study)
    finally:
        (run / "args.json").write_text(recorded)
    assert evaluate.arm_state(arm, 0, tiny_study) == ("finished", run)
    with pytest.raises(SystemExit, match="evaluated with other settings than the study's now: max_new_tokens"):
        evaluate.eval_results(
            {**study, "evaluate": {**study["evaluate"], "max_new_tokens": 9}},
            "tiny",
            0,
            tiny_study / "evals" / "base" / "seed0",
        )


def test_ctrl_c_waits_for_the_run_to_stop(monkeypatch):
    # The first Ctrl-C reaches the child as well; the runner waits for it (a checkpoint being written
    # is finished) and stops with one line; it kills the child only on a second Ctrl-C.
    class Child:
        def __init__(self, interrupts):
            self.interrupts, self.killed = interrupts, False

        def wait(self):
            if self.interrupts:
                self.interrupts -= 1
                raise KeyboardInterrupt
            return 130

        def kill(self):
            self.killed = True

    for interrupts, killed in ((1, False), (2, True)):
        child = Child(interrupts)
        monkeypatch.setattr(evaluate.subprocess, "Popen", lambda command, child=child: child)
        with pytest.raises(SystemExit, match="Interrupted during g4 seed 0. Run the same --study command again"):
            evaluate.run_command(["grpo.py"], "g4 seed 0")
        assert child.killed == killed


def test_stability_verdicts_by_hand():
    # Reward curves [0, 0.1, 0.2, 0.3] (changes 0.1, 0.1, 0.1: spread 0) and [0, 0.3, 0, 0.3] (changes
    # 0.3, −0.3, 0.3: mean 0.1, spread √((0.04 + 0.16 + 0.04)/3) = 0.282843). The claim favours a.
    steady = [{"reward/mean": v} for v in (0.0, 0.1, 0.2, 0.3)]
    jumpy = [{"reward/mean": v} for v in (0.0, 0.3, 0.0, 0.3)]
    finding = {"metric": "stability", "arms": ["a", "b"]}
    _, verdict = judge(finding, {"a": [outcome("a", 60, rows=steady)], "b": [outcome("b", 30, rows=jumpy)]})
    assert (
        verdict
        == "holds: a steadier step to step (0.000 against 0.283); held-out accuracy: a's interval lies above b's"
    )
    # Steadier, but clearly less accurate: the claim's second half fails.
    _, verdict = judge(finding, {"a": [outcome("a", 30, rows=steady)], "b": [outcome("b", 60, rows=jumpy)]})
    assert verdict.startswith("does not hold: a steadier step to step")
    _, verdict = judge(finding, {"a": [outcome("a", 45, rows=steady)], "b": [outcome("b", 40, rows=jumpy)]})
    assert verdict.startswith("not shown: a steadier") and verdict.endswith("the intervals overlap")


def test_where_the_report_goes_and_a_local_model_are_checked_before_anything_trains(tmp_path, monkeypatch):
    # --study_into's file and its lines, and a --study_model that is a path: a mistake in either
    # stops the study at its start, not after every arm has trained.
    commands = recorded_commands(monkeypatch)
    document = tmp_path / "learning.md"
    for settings, message in [
        (dict(study_into=str(document)), r"--study_into .*learning.md: no such file"),
        (
            dict(study_model=str(tmp_path / "no-such-model")),
            r"--study_model .*no-such-model: no such file or directory",
        ),
        (dict(study_model="weights.gguf"), r"--study_model weights.gguf: no such file"),
    ]:
        with pytest.raises(SystemExit, match=message):
            run_study(Args(study=TINY, output_dir=str(tmp_path), **settings))
    document.write_text("no markers\n")
    with pytest.raises(SystemExit, match="add the lines <!-- study:tiny --> and <!-- /study:tiny -->"):
        run_study(Args(study=TINY, output_dir=str(tmp_path), study_into=str(document)))
    assert commands == []
