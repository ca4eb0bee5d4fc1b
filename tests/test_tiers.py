"""conftest's two tiers on a GPU machine, simulated on any machine: a pytest process in which
torch.cuda.is_available() answers True and CUDA_VISIBLE_DEVICES names GPU 3 runs
tests/tier_probe.py, whose tests record the environment they see."""

import json
import os
import subprocess
import sys

from conftest import ROOT

# A GPU machine as conftest meets it: is_available() True before conftest asks, the variable set.
AS_ON_A_GPU = (
    "import sys, torch, pytest; torch.cuda.is_available = lambda: True; "
    "sys.exit(pytest.main(['-p', 'no:cacheprovider', '-q', sys.argv[1]]))"
)


def test_the_cuda_tier_sees_the_gpu_and_the_cpu_tier_does_not(tmp_path):
    # The bug this guards: conftest cleared CUDA_VISIBLE_DEVICES for the whole session, so every
    # CUDA-tier test after the first saw 0 GPUs (torch.cuda.device_count reads the variable
    # again) and failed with "Invalid device id": 18 of 25 on the first H100 run.
    log = tmp_path / "seen.jsonl"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3", "NANOPO_TIER_PROBE": str(log)}
    command = [sys.executable, "-c", AS_ON_A_GPU, str(ROOT / "tests" / "tier_probe.py")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = {row["test"]: row for row in map(json.loads, log.read_text().splitlines())}
    assert list(seen) == ["cpu first", "cuda fixture", "cuda first", "cpu between", "cuda second"]
    for name in ("cuda fixture", "cuda first", "cuda second"):  # every one, the module fixture too
        assert seen[name]["CUDA_VISIBLE_DEVICES"] == "3", name
        assert seen[name]["parsed"] in (None, ["3"]), name
        assert seen[name]["is_available"], name
    for name in ("cpu first", "cpu between"):  # what a CPU-tier test and the processes it starts see
        assert seen[name]["CUDA_VISIBLE_DEVICES"] == "", name
        assert seen[name]["parsed"] in (None, []), name
        assert not seen[name]["is_available"], name  # --device auto picks the CPU
