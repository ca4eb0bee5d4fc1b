"""tests/gpu_acceptance.py, the CUDA path's one-command acceptance run, end to end with --smoke:
the same four stages with the tiny model on the CPU, so that the runner and its report are
known to work before a GPU session spends its minutes on them."""

import subprocess
import sys

from conftest import ROOT


def test_acceptance_runner_smoke(tmp_path):
    report = tmp_path / "acceptance.md"
    command = [sys.executable, str(ROOT / "tests" / "gpu_acceptance.py"), "--output", str(report), "--smoke"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    text = report.read_text()
    assert text.count("\n## ") == 4 and text.count("passed, ") == 4  # four stages, each passed
    assert "pytest: " in text and "skipped" in text  # the CUDA tier: skipped on the CPU, and said so
    for table in ("| N | P | mode | lengths | nanopo tok/s", "| script | time/generate"):
        assert table in text
    assert "| grpo |" in text and "| dapo |" in text and "| ppo |" in text
