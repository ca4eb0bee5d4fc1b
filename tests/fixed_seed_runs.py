"""A refactor changes no number: fixed-seed tiny runs of the three scripts, recorded before a
change and compared after it, bit for bit.

    python tests/fixed_seed_runs.py record /tmp/before     # on the commit before the change
    python tests/fixed_seed_runs.py record /tmp/after      # on the change
    python tests/fixed_seed_runs.py compare /tmp/before /tmp/after

Each run covers a set of branches (loss types, issue 33's objectives, off-policy updates, dual-clip, truncated and
masked IS, the entropy bonus, the moving reference, dynamic sampling, the overlong penalty and
filter, PPO's VAPO options, held-out evaluation). compare checks every metric of every step except
wall times, and the bytes of every saved weight file; it prints each difference and exits 1 on
any. About 2 minutes on 2 CPU cores."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = "--model tiny --task digit --lr 3e-3 --max_new_tokens 8 --batch_size 4 --group_size 4 --max_steps 3"
RUNS = {
    "grpo": f"grpo.py {TINY} --eval_every 2 --eval_problems 8",
    "grpo-dr-offpolicy": f"grpo.py {TINY} --loss_type dr_grpo --num_iterations 2 --num_mini_batches 2 --dual_clip 3"
    " --tis_cap 2 --entropy_coef 0.01 --ref_ema_decay 0.9 --micro_batch_size 3",
    "grpo-gspo": f"grpo.py {TINY} --loss_type gspo --num_iterations 2 --micro_batch_size 5",
    "grpo-cispo-mask": f"grpo.py {TINY} --loss_type cispo --is_mask 0.5,5 --is_mask_level sequence",
    "grpo-gpg": f"grpo.py {TINY} --loss_type gpg --beta 0",
    "grpo-dppo-offpolicy": f"grpo.py {TINY} --loss_type dppo --num_mini_batches 2 --scale_rewards batch"
    " --off_policy_mask_threshold 1e-4 --unbiased_kl",
    "grpo-sapo-offpolicy": f"grpo.py {TINY} --loss_type sapo --num_iterations 2 --top_entropy_quantile 0.5",
    "dapo-covariance": f"dapo.py {TINY} --overlong_buffer 4 --loss_type kl_cov --kl_cov_ratio 0.2 --num_iterations 2"
    " --scale_rewards mean",
    "dapo": f"dapo.py {TINY} --overlong_buffer 4 --eval_every 3 --eval_problems 8",
    "dapo-cispo-offpolicy": f"dapo.py {TINY} --overlong_buffer 4 --loss_type cispo --overlong_filter --beta 0.01"
    " --num_iterations 2 --tis_cap 2 --entropy_coef 0.01",
    "dapo-clip-mask": f"dapo.py {TINY} --overlong_buffer 4 --dynamic_sampling false --is_mask 0.5,5 --dual_clip 3"
    " --num_mini_batches 2",
    "ppo": f"ppo.py {TINY} --eval_every 3 --eval_problems 8",
    "ppo-vapo": f"ppo.py {TINY} --entropy_coef 0.01 --length_adaptive_lam --pos_lm_coef 0.1 --value_warmup_steps 1"
    " --dual_clip 3 --tis_cap 2 --is_mask 0.5,5 --whiten_advantages false --lam_critic 1.0 --ppo_epochs 2",
}
WALL_TIMES = ("seconds/", "throughput/", "eval/seconds", "time")


def record(directory: Path) -> None:
    for name, command in RUNS.items():
        out = directory / name
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        argv = [sys.executable, *command.split(), "--output_dir", str(out), "--save_every", "0"]
        subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)
        run_dir = next(out.iterdir())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [{k: v for k, v in row.items() if not k.startswith(WALL_TIMES)} for row in rows]
        weights = {
            str(path.relative_to(run_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(run_dir.rglob("*.safetensors"))
        }
        (directory / f"{name}.json").write_text(json.dumps({"metrics": rows, "weights": weights}, indent=1))
        print(f"{name}: {len(rows)} rows, {len(weights)} weight files")


def compare(before: Path, after: Path) -> int:
    differences = 0
    for name in RUNS:
        old, new = (json.loads((d / f"{name}.json").read_text()) for d in (before, after))
        for step, (a, b) in enumerate(zip(old["metrics"], new["metrics"], strict=True)):
            for key in sorted(a.keys() | b.keys()):
                if json.dumps(a.get(key)) != json.dumps(b.get(key)):  # NaN equals NaN here
                    differences += 1
                    print(f"{name} row {step} {key}: {a.get(key)} -> {b.get(key)}")
        if old["weights"] != new["weights"]:
            differences += 1
            print(f"{name}: the saved weights differ")
        print(f"{name}: {len(old['metrics'])} rows compared")
    print("identical" if not differences else f"{differences} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    if command == "record" and len(paths) == 1:
        record(Path(paths[0]))
    elif command == "compare" and len(paths) == 2:
        raise SystemExit(compare(Path(paths[0]), Path(paths[1])))
    else:
        raise SystemExit(__doc__)
