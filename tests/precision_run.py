"""A training run with the GPU recipe's precision forced on the CPU: fp32 master weights, bf16
autocast (CPU autocast supports it), and so under torchrun FSDP2's bf16 mixed precision.
tests/test_distributed.py launches it:

    torchrun --nproc_per_node 2 tests/precision_run.py SCRIPT OUTPUT_DIR MAX_STEPS SAVE_EVERY [RESUME_FROM]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dapo  # noqa: E402  (after the path)
import grpo  # noqa: E402
import ppo  # noqa: E402

if __name__ == "__main__":
    name, output_dir, max_steps, save_every, *resume = sys.argv[1:]
    script = {"grpo": grpo, "dapo": dapo, "ppo": ppo}[name]
    script.resolve_precision = lambda dtype, device: (torch.float32, torch.bfloat16)
    settings = dict(model="tiny", task="digit", lr=3e-3, max_new_tokens=2, batch_size=16, group_size=8)
    settings |= {"critic_lr": 3e-3} if script is ppo else {}
    script.train(
        script.Args(
            output_dir=output_dir, max_steps=int(max_steps), save_every=int(save_every),
            resume_from=resume[0] if resume else "", **settings,
        )
    )  # fmt: skip
