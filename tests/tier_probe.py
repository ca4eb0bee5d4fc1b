"""Not collected (no test_ prefix): tests/test_tiers.py runs it with pytest in a process where
torch.cuda.is_available() answers True and CUDA_VISIBLE_DEVICES names a GPU, as on a GPU
machine. Each test writes what it sees of its environment to the JSON-lines file
$NANOPO_TIER_PROBE: CUDA_VISIBLE_DEVICES, which torch.cuda.device_count() reads through NVML
at every call until CUDA is initialised, and the devices torch parses from it."""

import json
import os

import pytest
import torch


def record(test: str) -> None:
    parse = getattr(torch.cuda, "_parse_visible_devices", None)  # what NVML's device count starts from
    seen = {
        "test": test,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "parsed": [str(d) for d in parse()] if parse else None,
        "is_available": torch.cuda.is_available(),
    }
    with open(os.environ["NANOPO_TIER_PROBE"], "a") as log:
        log.write(json.dumps(seen) + "\n")


@pytest.fixture(scope="module")
def built_on_the_gpu():
    """A module-scoped fixture of the CUDA tier (as test_cuda.py's models): it sets up before any
    function-scoped fixture of the test that first asks for it."""
    record("cuda fixture")


def test_cpu_first():
    record("cpu first")


@pytest.mark.cuda
def test_cuda_first(built_on_the_gpu):
    record("cuda first")


def test_cpu_between():
    record("cpu between")


@pytest.mark.cuda
def test_cuda_second(built_on_the_gpu):
    record("cuda second")
