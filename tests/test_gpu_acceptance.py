"""tests/gpu_acceptance.py, the CUDA path's one-command acceptance run, end to end with --smoke:
its stages with the tiny model on the CPU, profile tables included, so that the runner and its
report are known to work before a GPU session spends its minutes on them."""

import re
import subprocess
import sys

import pytest

from conftest import ROOT


def test_acceptance_runner_smoke(tmp_path):
    report = tmp_path / "acceptance.md"
    # Stages 1-7; 8, 9 and 10 are stage 4's command with one flag more each (the test below), whose
    # runs on the CPU are bench's own tests: ~25 s of CI saved.
    command = [sys.executable, str(ROOT / "tests" / "gpu_acceptance.py"), "--output", str(report), "--smoke"]
    done = subprocess.run(
        command + ["--stages", "1,2,3,4,5,6,7"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    text = report.read_text()
    assert text.count("\n## ") == 7 and text.count("passed, ") == 7  # seven stages, each passed
    assert "pytest: " in text and "skipped" in text  # the CUDA tier: skipped on the CPU, and said so
    assert "| N | P | mode | lengths | nanopo tok/s | hf tok/s |" in text  # generation against model.generate
    # Stage 3: the decode against the masked step, the sampler and the attention part by part.
    assert "| 4 | " in text and "| sampled | fixed |" in text and "| nanopo/masked |" in text
    assert "| part | N | V | ms a call |" in text and "| argmax | 4 | 151665 |" in text  # the sampler's ops
    assert (
        "| variant | N | width | timed | ms a call |" in text
        and "| sdpa, masked (generate's masked step) | 4 |" in text
    )
    # Stages 4-6, each script's step unprofiled: its time/* metrics, the preflight's time and sizes
    # (on the CPU the rows it falls back to), the work per second of each phase.
    for script in ("grpo", "dapo", "ppo"):
        assert f"\n| {script} | " in text
    assert (
        "| script | time/generate | time/reward | time/logprobs | time/update | time/* summed | preflight s |" in text
    )
    assert "| micro_batch_size | logprob_chunk_size | TFLOP/s generate+reward |" in text
    assert "| TFLOP/s values |" in text and "| TFLOP/s critic update |" in text  # ppo's critic
    # Stage 7, the grpo step's scoring and update profiled: one row per phase, the ten largest CPU
    # ops of each, the busy time by kind; the rollout not profiled.
    assert "| run | phase | calls | wall s | CPU op s | busy/wall | TFLOP | TFLOP/s | MFU | GB | GB/s |" in text
    assert "| run | phase | # | CPU op | ms | calls | of busy |" in text
    assert "| run | phase | kind | ms | calls | µs a call | of busy |" in text
    assert "| grpo | logprobs | 1 |" in text and "| grpo | update | 1 |" in text
    assert "| grpo | generate+reward |" not in text
    steps = re.findall(r"\n\| grpo \| [0-9.e-]+ \|", text)  # a training_step row: its time/generate first
    assert len(steps) == 2  # stage 4's and the profiled step's


def test_the_ab_stages_are_stage_4_with_one_flag_more(tmp_path):
    # Stages 8, 9 and 10, optional: the grpo step of stage 4 again, with bf16 weights, with gradient
    # checkpointing, and with both --compile and gradient checkpointing; each writes its own JSON.
    import gpu_acceptance

    planned = gpu_acceptance.stages(False, tmp_path, tmp_path / "model")
    assert len(planned) == 16 and all(stage.get("optional") for stage in planned[6:])
    step = planned[3]["command"]
    flags = (["--dtype", "bfloat16"], ["--gradient_checkpointing", "true"])
    flags += (["--compile", "true", "--gradient_checkpointing", "true"],)
    for stage, more in zip(planned[7:10], flags, strict=True):
        assert stage["command"] == step + more and stage["json"] != planned[3]["json"]
        assert stage["seconds"] == 0 and "A/B against stage 4" in stage["name"]
    assert len({stage["json"] for stage in planned[7:10]}) == 3
    # Stage 11: steps 4 + 6 alone, shared against unshared, at stage 4's lengths and group size.
    shares = planned[10]["command"]
    assert shares[shares.index("--step_rows") + 1] == "64" and shares[shares.index("--group_size") + 1] == "8"
    # Stage 12: stage 4's step with --compile true (bench runs a step that compiles first).
    assert planned[11]["command"] == step + ["--compile", "true"] and "A/B against stage 4" in planned[11]["name"]
    # Stages 13 and 14: the compiled decode's CUDA test (not in stage 1's tier), then stage 3's decode
    # with --compile's model against without, and against separate products (the merged ones' A/B).
    assert planned[12]["command"][-2:] == ["-k", "compiled_decode"] and "compiled_decode" in planned[0]["command"][-3]
    decode = planned[13]["command"]
    assert decode[decode.index("--contenders") + 1] == "nanopo,compiled,separate" and "--sampler_rows" not in decode
    # Stage 15: stage 4's step with bf16 activations (issue 58's lever 4).
    assert (
        planned[14]["command"] == step + ["--bf16_activations", "true"] and "A/B against stage 4" in planned[14]["name"]
    )
    # Stage 16: stage 4's step with the LM head's GEMMs on bf16 inputs (issue 58's lever 3's precision).
    assert (
        planned[15]["command"] == step + ["--head_precision", "bf16"] and "A/B against stage 4" in planned[15]["name"]
    )


def test_acceptance_runner_runs_the_stages_asked_for(tmp_path, monkeypatch, capsys):
    """--stages 3,1: the CUDA tier and the decode profile alone, in order; a stage number out of
    range is refused before anything runs. The runner in this process, each stage's command
    replaced by a print (the smoke test above runs the real ones)."""
    import gpu_acceptance

    real = gpu_acceptance.stages

    def quick(*args):
        return [{**stage, "command": [sys.executable, "-c", "print('ran')"]} for stage in real(*args)]

    ran = []
    monkeypatch.setattr(gpu_acceptance, "stages", quick)
    monkeypatch.setattr(gpu_acceptance, "versions", lambda: ran.append("versions") or "versions")
    report = tmp_path / "acceptance.md"
    monkeypatch.setattr(sys, "argv", ["gpu_acceptance.py", "--output", str(report), "--smoke", "--stages", "3,1"])
    assert gpu_acceptance.main() == 0
    headings = [line for line in report.read_text().splitlines() if line.startswith("## ")]
    assert headings == [
        "## CUDA tier",
        "## decode, N = 4 × 8 new tokens, sampled, against the masked step; the sampler and the attention part by part",
    ]
    assert report.read_text().count("passed, ") == 2
    ran.clear()
    for wrong in ("17", "2,x"):
        monkeypatch.setattr(sys, "argv", ["gpu_acceptance.py", "--output", str(report), "--smoke", "--stages", wrong])
        with pytest.raises(SystemExit) as refused:
            gpu_acceptance.main()
        assert refused.value.code == 2 and "stages are numbered 1 to 16" in capsys.readouterr().err
    assert ran == []  # before anything ran, the versions' probe included


def test_an_optional_stage_that_fails_does_not_fail_the_run(tmp_path, monkeypatch):
    """Stage 7 (the profiled step, on the time left) is optional: its failure is reported and the
    run still exits 0; a failing stage that is not optional (here the CUDA tier) makes it exit 1."""
    import gpu_acceptance

    real = gpu_acceptance.stages

    def failing(*args):
        return [{**stage, "command": [sys.executable, "-c", "raise SystemExit(3)"]} for stage in real(*args)]

    monkeypatch.setattr(gpu_acceptance, "stages", failing)
    monkeypatch.setattr(gpu_acceptance, "versions", lambda: "versions")
    report = tmp_path / "acceptance.md"
    for stages, code in (("7", 0), ("1,7", 1)):
        monkeypatch.setattr(sys, "argv", ["gpu_acceptance.py", "--output", str(report), "--smoke", "--stages", stages])
        assert gpu_acceptance.main() == code
        assert report.read_text().count("failed (exit 3)") == len(stages.split(","))
