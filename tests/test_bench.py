"""bench.py runs end to end on the tiny model with tiny settings and writes its tables."""

import json
import subprocess
import sys

from conftest import ROOT


def test_bench_smoke(tmp_path):
    output = tmp_path / "bench.json"
    command = [sys.executable, "bench.py", "--model", "tiny", "--batch_sizes", "1,4", "--max_new_tokens", "4"]
    command += ["--repeats", "1", "--group_size", "2", "--train_batch_size", "1", "--logprob_rows", "2"]
    command += ["--output", str(output)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(output.read_text())
    assert [(row["N"], row["mode"]) for row in report["generation"]] == [
        (1, "greedy"),
        (1, "sampled"),
        (4, "greedy"),
        (4, "sampled"),
    ]
    assert all(
        row["nanopo tok/s"] > 0 and row["hf tok/s"] > 0 and row["loop tok/s"] > 0 for row in report["generation"]
    )
    assert [row["script"] for row in report["training_step"]] == ["grpo", "dapo", "ppo"]
    assert all(row["time/generate"] > 0 and row["time/update"] > 0 for row in report["training_step"])
    assert "| N | P | mode |" in done.stdout
