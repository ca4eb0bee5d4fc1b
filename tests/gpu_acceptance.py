"""The CUDA path's acceptance run: one command, one GPU machine, at most 9 minutes, one report.

    python tests/gpu_acceptance.py --output acceptance.md          # on a GPU machine
    python tests/gpu_acceptance.py --output /tmp/a.md --smoke      # the same stages, tiny, on the CPU

It runs on the GPU image as it is (torch, transformers, peft; nothing downloaded: the models are
random-initialised at real shapes, the tokenizer is bench.py's 151,665-id one), in this order:
  1. the CUDA tier, tests/test_cuda.py (python -m pytest -m cuda);
  2. bench.py on the Qwen2.5-1.5B shape: generation at N = 1, 64, 256 with 128 new tokens,
     against model.generate and the old loop, with the fraction of the bandwidth bound, and
     sequence_logprobs' memory;
  3. bench.py, the same shape: N = 256 with 1024 new tokens, sampled, against model.generate;
  4. one seed-study step of grpo.py, dapo.py and ppo.py on that shape (B = 32, G = 8, 1024 new
     tokens, the 151,665-id vocabulary): seconds and peak GPU memory per phase.
Each stage is a subprocess under its share of the deadline; a stage that fails or runs out of
time is reported as such (with the end of its output), and the stages after it still run.
bench.py saves its JSON after every section, so a stage cut short keeps what it measured.
The report (Markdown) gathers the versions, every command, its status and time, and the tables.
"""

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import markdown  # noqa: E402  (after the path: bench.py lives in the repository's root)

SHAPE = "qwen2.5-1.5b-shape"


def stages(smoke: bool, directory: Path) -> list[dict]:
    """The four stages as commands; `smoke`: the tiny model, a few tokens, on the CPU."""
    bench = [sys.executable, str(ROOT / "bench.py")]
    if smoke:
        model = ["--model", "tiny", "--device", "cpu", "--repeats", "1"]
        sizes = dict(short="1,4", short_tokens="4", long="4", long_tokens="8", batch="2", group="2")
    else:
        model = ["--model", SHAPE]
        sizes = dict(short="1,64,256", short_tokens="128", long="256", long_tokens="1024", batch="32", group="8")
    return [
        dict(
            name="CUDA tier",
            seconds=100,
            command=[sys.executable, "-m", "pytest", "-m", "cuda", str(ROOT / "tests" / "test_cuda.py"), "-s"],
        ),
        dict(
            name=f"generation, {sizes['short_tokens']} new tokens",
            seconds=110,
            json=directory / "generation_short.json",
            command=[
                *bench,
                *model,
                "--batch_sizes",
                sizes["short"],
                "--max_new_tokens",
                sizes["short_tokens"],
                "--train_steps",
                "",
                "--logprob_rows",
                "16",
            ],
        ),  # fmt: skip
        dict(
            name=f"generation, {sizes['long_tokens']} new tokens",
            seconds=110,
            json=directory / "generation_long.json",
            command=[
                *bench,
                *model,
                "--batch_sizes",
                sizes["long"],
                "--max_new_tokens",
                sizes["long_tokens"],
                "--modes",
                "sampled",
                "--contenders",
                "nanopo,hf",
                "--repeats",
                "1",
                "--train_steps",
                "",
                "--logprob_rows",
                "0",
            ],
        ),  # fmt: skip
        dict(
            name=f"seed-study step: B = {sizes['batch']}, G = {sizes['group']}, {sizes['long_tokens']} new tokens",
            seconds=200,
            json=directory / "training_step.json",
            command=[
                *bench,
                *model,
                "--batch_sizes",
                "",
                "--max_new_tokens",
                sizes["long_tokens"],
                "--train_batch_size",
                sizes["batch"],
                "--group_size",
                sizes["group"],
                "--train_steps",
                "grpo,dapo,ppo",
                "--logprob_rows",
                "0",
            ],
        ),  # fmt: skip
    ]


def versions() -> str:
    probe = (
        "import torch, transformers; import importlib.util as u; "
        "print(f'torch {torch.__version__}, transformers {transformers.__version__}, '"
        'f\'peft {"yes" if u.find_spec("peft") else "no"}, CUDA {torch.version.cuda}, \''
        "f'GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else \"none\"}')"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    return done.stdout.strip() or done.stderr.strip()[-500:]


def run_stage(stage: dict, deadline: float) -> dict:
    """Runs one stage under min(its seconds, the time left); returns status, seconds, output tail."""
    if "json" in stage:
        stage["command"] += ["--output", str(stage["json"])]
    limit = max(1.0, min(stage["seconds"], deadline - time.monotonic()))
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(stage["command"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        status = f"stopped at its {limit:.0f} s limit"
        output = (stopped.stdout or b"").decode(errors="replace") + (stopped.stderr or b"").decode(errors="replace")
    return {"status": status, "seconds": time.monotonic() - start, "output": output}


def report_stage(stage: dict, result: dict) -> str:
    shown = shlex.join(str(part).replace(str(ROOT) + "/", "") for part in stage["command"])
    lines = [f"## {stage['name']}", "", f"    {shown}", "", f"{result['status']}, {result['seconds']:.0f} s", ""]
    if stage["name"] == "CUDA tier":
        summary = [line for line in result["output"].splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
        gap = [line for line in result["output"].splitlines() if "sampler vs trainer" in line]
        lines += [f"pytest: {summary[-1].strip('= ') if summary else 'no summary line'}", *gap, ""]
    if "json" in stage and stage["json"].exists():
        tables = json.loads(stage["json"].read_text())
        for section in ("generation", "logprob_memory", "training_step"):
            if tables.get(section):
                lines += [f"### {section}", "", markdown(tables[section]), ""]
        lines += [
            f"- bound: {row['bound arithmetic']}" for row in tables.get("generation", []) if "bound arithmetic" in row
        ]
        lines += [""]
    if not result["status"].startswith("passed"):
        lines += ["The end of its output:", "", "```", result["output"][-3000:], "```", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="the Markdown report; bench's JSON files go beside it")
    parser.add_argument("--smoke", action="store_true", help="the same stages with the tiny model on the CPU")
    parser.add_argument("--deadline", type=float, default=530, help="seconds for every stage together")
    options = parser.parse_args()
    output = Path(options.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + options.deadline
    sections = [
        "# nanoPO: the CUDA path's acceptance run",
        "",
        f"{versions()}; Python {platform.python_version()}; {'smoke (tiny, CPU)' if options.smoke else SHAPE}",
        "",
    ]
    failed = 0
    for stage in stages(options.smoke, output.parent):
        result = run_stage(stage, deadline)
        failed += not result["status"].startswith("passed")
        sections.append(report_stage(stage, result))
        output.write_text("\n".join(sections) + "\n")  # after every stage: a cut-off run keeps its report
        print(f"{stage['name']}: {result['status']}, {result['seconds']:.0f} s", flush=True)
    print(f"report: {output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
