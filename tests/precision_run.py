"""A training run with the GPU recipe's precision forced on the CPU: fp32 master weights, bf16
autocast (CPU autocast supports it), and so under torchrun FSDP2's bf16 mixed precision.
tests/test_distributed.py launches it with the script's own flags:

    torchrun --nproc_per_node 2 tests/precision_run.py SCRIPT [--flag value …]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402  (after the path)
import dapo  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402
from common import parse_args  # noqa: E402

if __name__ == "__main__":
    name, *flags = sys.argv[1:]
    script = {"grpo": grpo, "dapo": dapo, "ppo": ppo}[name]
    common.resolve_precision = lambda dtype, device: (torch.float32, torch.bfloat16)
    script.train(parse_args(script.Args, flags))
