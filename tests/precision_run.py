"""A training run with the GPU recipe's precision forced on the CPU: fp32 master weights, bf16
autocast (CPU autocast supports it), and so under torchrun FSDP2's bf16 mixed precision.
tests/test_distributed.py launches it with the script's own flags:

    torchrun --nproc_per_node 2 tests/precision_run.py SCRIPT [--flag value …]

--bf16_activations: the run's models with common.bf16_activations (issue 58's lever 4, bench.with_bf16_activations); its
sampler–trainer gap (policy/sample_logp_diff) against the run without, on one process too; --bf16_head: the
LM head's GEMMs on bf16 inputs (common.HEAD_PRECISION's contender, its CPU emulation) in sampler and trainer:

    python tests/precision_run.py grpo --model SmolLM2-135M-Instruct.Q4_1.gguf [--bf16_activations] [--bf16_head] …
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench  # noqa: E402  (after the path)
import common  # noqa: E402
import dapo  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402
from common import parse_args  # noqa: E402

if __name__ == "__main__":
    name, *flags = sys.argv[1:]
    script = {"grpo": grpo, "dapo": dapo, "ppo": ppo}[name]
    common.resolve_precision = lambda dtype, device: (torch.float32, torch.bfloat16)
    lever = "--bf16_activations" in flags
    if "--bf16_head" in flags:  # the head's GEMMs on bf16 inputs, as HEAD_PRECISION "bf16" on a GPU (emulated)
        common.head_precision = lambda hidden: "bf16"
    with bench.with_bf16_activations(lever):
        script.train(
            parse_args(script.Args, [flag for flag in flags if flag not in ("--bf16_activations", "--bf16_head")])
        )
