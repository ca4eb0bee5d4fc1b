"""conftest's two tiers on a GPU machine, simulated on any machine: a pytest run in which
torch.cuda.is_available() answers True and CUDA_VISIBLE_DEVICES names GPU 3 runs
tests/tier_probe.py, in one process and in two pytest-xdist workers; its tests record the
environment they see."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# A GPU machine as conftest meets it: is_available() True before conftest asks (a plugin loaded
# with -p, before conftest, in every process pytest runs tests in), the variable set.
GPU_SIMULATION = "import torch\n\ntorch.cuda.is_available = lambda: True\n"


XDIST = importlib.util.find_spec("xdist") is not None  # pytest-xdist (requirements.txt), for -n


@pytest.mark.parametrize(
    "workers",
    [[], pytest.param(["-n", "2", "--dist", "loadgroup"], marks=pytest.mark.skipif(not XDIST, reason="no xdist"))],
    ids=["one process", "two workers"],
)
def test_the_cuda_tier_sees_the_gpu_and_the_cpu_tier_does_not(tmp_path, workers):
    # The bug this guards: conftest cleared CUDA_VISIBLE_DEVICES for the whole session, so every
    # CUDA-tier test after the first saw 0 GPUs (torch.cuda.device_count reads the variable
    # again) and failed with "Invalid device id": 18 of 25 on the first H100 run. Under
    # pytest-xdist (CI's -n 2) a worker started with the variable the controller's conftest had
    # cleared, and skipped the whole tier: the workers get it back (pytest_xdist_setupnodes).
    log = tmp_path / "seen.jsonl"
    (tmp_path / "gpu_simulation.py").write_text(GPU_SIMULATION)
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "3",
        "NANOPO_TIER_PROBE": str(log),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-p", "gpu_simulation", "-p", "no:cacheprovider", *workers]
    done = subprocess.run(
        [*command, str(ROOT / "tests" / "tier_probe.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = {row["test"]: row for row in map(json.loads, log.read_text().splitlines())}
    order = ["cpu first", "cuda fixture", "cuda first", "cpu between", "cuda second"]
    if workers:  # two workers run the tests in any order
        assert sorted(seen) == sorted(order)
    else:
        assert list(seen) == order
    for name in ("cuda fixture", "cuda first", "cuda second"):  # every one, the module fixture too
        assert seen[name]["CUDA_VISIBLE_DEVICES"] == "3", name
        assert seen[name]["parsed"] in (None, ["3"]), name
        assert seen[name]["is_available"], name
    for name in ("cpu first", "cpu between"):  # what a CPU-tier test and the processes it starts see
        assert seen[name]["CUDA_VISIBLE_DEVICES"] == "", name
        assert seen[name]["parsed"] in (None, []), name
        assert not seen[name]["is_available"], name  # --device auto picks the CPU
