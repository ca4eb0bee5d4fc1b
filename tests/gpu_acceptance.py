"""The CUDA path's acceptance run: one command, one GPU machine, at most 9.5 minutes, one report.

    python tests/gpu_acceptance.py --output acceptance.md          # on a GPU machine
    python tests/gpu_acceptance.py --output /tmp/a.md --smoke      # the same stages, tiny, on the CPU
    python tests/gpu_acceptance.py --output a.md --stages 1,3,4     # some stages, their shares kept

It runs on the GPU image as it is (torch, transformers, peft; nothing downloaded: the models are
random-initialised at Qwen2.5-1.5B's shape, the tokenizer is bench.py's 151,665-id one). Each stage
is a subprocess under its share of the 560 s; a stage that fails or runs out of time is reported
as such, with the end of its output and what it measured (bench.py saves its JSON after every
section and every profiled phase), and the stages after it still run. The shares come from the
first GPU run (one H100 80GB HBM3, torch 2.11, transformers 5.17), where every stage of the
acceptance as it was then ran out of time:

  1. the CUDA tier, tests/test_cuda.py and test_profile.py's CUDA test of the profiler, without
     the tier's two slowest tests (-k): 100 s. Measured: the whole tier 150 s, of which the
     torchrun NCCL save-and-resume test 74.5 s and the bench smoke on CUDA 55.4 s; the other tests
     together ~20 s (13 s of it the first fixture's set-up) while 18 of them failed early; on the
     third GPU run (50caaf9) the rest took under 60 s, two of them failing at an import. Since then
     the tier has grown: those two now train, the sync count runs six ways: 100 s; the fourth GPU run
     (H200) measured 64 s for its 47 tests, an SDPA probe since removed the slowest (14.9 s); the
     fifth (H200) 67 s for 54. --durations prints the slowest. The two run on their own (130 s),
     and the compiled decode's test in stage 13:
     python -m pytest -m cuda tests/test_cuda.py -k "torchrun_one_process or bench_smoke_on_cuda"
  2. generation, N = 16 × 64 new tokens, greedy: nanopo against model.generate, and nanopo with
     tool turns on and none called (bench.py's `tools`: the cost of their per-token check): 55 s. The first
     bench stage also builds the 1.5B model on the GPU and writes it (bf16) to --model_dir, which
     every later stage and the training scripts load instead of initialising it again (measured:
     the random 1.5B model built on the CPU in each stage, nothing printed within 110 s).
     model.generate ran 457 tok/s at N = 64 × 128 (140 ms a step): 64 steps take ~9 s.
  3. the decode, N = 256 × 1024 new tokens, sampled, no profiler: generate (its share of the
     bandwidth bound, issue 40's target; in bf16 on a GPU its one-token step runs flash attention's
     variable-length entry over a left-aligned cache) against itself with the masked step (bench.py's
     contender masked), each once after a warm-up; before it the sampler's ops outside the captured
     step timed one by one, and whole, eager and as --compile compiles it (--sampler_rows), and the step's attention alone, per variant and width
     (--attention_rows): 80 s. Measured: that decode 12.2 s on the H200 under the profiler (14-16 s
     on the H100), whose kernels are in docs/speed.md (bench.py --profile decode runs it again); on
     the fourth GPU run the stage took 77 s with three contenders, two of them (matmul, widths) since
     rejected.
  4. the seed-study step of grpo.py (B = 32, G = 8, 1024 new tokens), no profiler: the issue's
     targets are this step's own time, peak memory and MFU. The preflight sizes its micro-batches
     and scoring chunks first; bench reports the preflight's seconds and sizes, each phase's
     time/* metric, TFLOP/s and MFU (FLOPs computed as --profile computes them), and peak GB:
     90 s. Measured: 69.7 s a step on the H100 (generate 15.6, reward 0.27, logprobs 9.4,
     update 44.4), 41.1 s on the H200 with 4-row micro-batches; with the preflight, not yet.
  5. the same step of dapo.py (no reference, on-policy: no scoring pass): 80 s. Measured: 32.0 s
     on the H200 with 4-row micro-batches.
  6. the same step of ppo.py with --gradient_checkpointing true (the README's flags for one 80 GB
     GPU): 115 s, and what the stages before it leave (they left 146 s of their shares on the
     third GPU run). Measured there: 69.4 s a step after 17.6 s of preflight.
  7. optional, on the time the stages before it left (no share of its own; its failure or time-out
     does not fail the run): a grpo step at B = 8 (micro-batches sized by the same preflight),
     its scoring and update under the profiler (bench.py --profile grpo --profile_phases
     logprobs,update; the rollout unprofiled: its 1024-token decode recorded >700k kernels, and the
     decode's own profile is in docs/speed.md): its largest kernels, busy time by kind, busy/wall,
     host syncs, the host's wait in them and its launches. On the H200 the profiled B = 32 step
     with 4-row micro-batches ran out of 161 s in the update (recording 64 micro-batches costs
     more than the step), so the unprofiled steps come first. On the H100 (2026-11-26) stages 1-6
     took 374 s, and stage 7, every phase profiled, 90 s.
  8., 9. and 10., optional, on the time left: the grpo step of stage 4 again, with --dtype bfloat16
     (bf16 weights and AdamW state, no fp32 masters: what bf16 activations would buy, issue 58), with
     --gradient_checkpointing true (fewer, larger micro-batches: the H100's update paid ~0.3 s a pass
     whatever its rows, docs/speed.md), and with both --compile true and --gradient_checkpointing
     true. Stages 1-7 took 464 s of the 560 on the H100: run them with `--stages 4,8,9,10` in a call
     of their own. (Until issue 56 stages 8 and 10 were --aligned_prompts off and --sdpa_backend
     efficient, both measured no faster and removed: docs/speed.md, tried and removed.)
  11. optional: bench.py's steps 4 + 6 (scoring and update) of 64 rows in 7-row micro-batches,
     the preflight's at this shape, each prompt forwarded once per group (two model calls a pass,
     more than twice the host's ops a layer, docs/speed.md) against once per row (one call, 16-19%
     more token positions) and one packed pass a micro-batch (bench.py's version packed:
     common.packed_completions, FlexAttention over a BlockMask, no padding; issue 58's second lever,
     exact on the CPU, never run on a GPU): which the scripts keep.
  12. optional: the grpo step of stage 4 with --compile true (the MLP and RMSNorm blocks through
     TorchInductor: the update's elementwise traffic fused), measured after an unmeasured step that
     compiles them (bench.py --compile; its row carries that step's times, `compiling …`), and,
     since the fifth run, its decode step compiled whole (compiled_decode), and since issue 58's third
     lever the LM head's log-prob math (logprob_head: the formula and logit_gradient fused); run it
     with stage 4 in a call of its own, `--stages 4,12`.
  13. and 14., optional: the compiled decode (--compile: the one-token step's backbone one
     TorchInductor graph, compiled_decode), first its CUDA test (captured, no graph break, the
     sampler's log-probs against the scorer's; left out of stage 1's tier for its compilations),
     then stage 3's decode with --compile's model against without (bench.py's contender compiled,
     timed after a call that compiles it) and against separate products (contender separate: the A/B
     of the merged q, k, v and gate, up), and the step's kernels a layer, eager against compiled
     (--decode_layers 4). Neither has run on a GPU yet: `--stages 13,14`.
  15. optional: stage 4's step with bench.py --bf16_activations (common.bf16_activations, issue 58's lever 4,
     a contender: adopted if it pays here and stage 1's test_bf16_activations_keep_sampler_and_trainer
     within their bounds passes). Not run yet: `--stages 4,15`.
  16. optional: stage 4's step with bench.py --head_precision bf16 (common.HEAD_PRECISION's contender,
     the LM head's GEMMs with bf16 inputs and fp32 sums, issue 58's lever 3: adopted if it pays here and
     stage 1's test_the_bf16_head_keeps_sampler_and_trainer_within_their_bounds passes). Not run yet:
     `--stages 4,16`.
The profiler's overhead on these steps has not been measured. A stage gets its own share and
the time the stages before it left (never the share of a stage after it). The report (Markdown)
gathers the versions, every command with its status and time, and the tables; every stage's
whole output goes to the .log beside it.
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

from bench import default_model_dir, markdown  # noqa: E402  (after the path: bench.py lives in the root)

SHAPE = "qwen2.5-1.5b-shape"
SLOW_CUDA_TESTS = "not torchrun_one_process_with_nccl and not bench_smoke_on_cuda and not compiled_decode"
SECTIONS = (
    "generation",
    "decode_kernels",
    "sampler",
    "attention",
    "profile",
    "profile_top",
    "profile_kinds",
    "training_step",
    "steps_4_and_6",
)


def stages(smoke: bool, directory: Path, model_dir: Path) -> list[dict]:
    """The stages as commands; `smoke`: the tiny model, a few tokens, on the CPU."""
    bench = [sys.executable, str(ROOT / "bench.py")]
    if smoke:
        model = ["--model", "tiny", "--device", "cpu"]
        sizes = dict(rows="4", tokens="8", decode_rows="4", decode_tokens="8", batch="2", group="2", profile_batch="2")
    else:
        model = ["--model", SHAPE, "--model_dir", str(model_dir)]
        sizes = dict(rows="16", tokens="64", decode_rows="256", decode_tokens="1024", batch="32", group="8")
        sizes["profile_batch"] = "8"  # the profiled step: the same micro-batches (the preflight's), a quarter of them
    step = ["--max_new_tokens", sizes["decode_tokens"], "--train_batch_size", sizes["batch"]]
    step += ["--group_size", sizes["group"]]
    tier = [sys.executable, "-m", "pytest", "-m", "cuda", str(ROOT / "tests" / "test_cuda.py")]
    tier += [str(ROOT / "tests" / "test_profile.py"), "-s"]  # and the profiler's own CUDA test

    def against_step_4(name: str, flags: str, what: str = "") -> dict:
        """An optional stage: stage 4's grpo step again with `flags`, on the time the stages before leave."""
        return dict(
            name=f"A/B against stage 4: one grpo.py step with {flags}{what} (optional: on the time left)",
            seconds=0,
            optional=True,
            json=directory / f"step_grpo_{name}.json",
            command=[*bench, *model, "--train_steps", "grpo", *step, "--batch_sizes", ""] + flags.split(),
        )

    return [
        dict(name="CUDA tier", seconds=100, command=[*tier, "-k", SLOW_CUDA_TESTS, "--durations", "15"]),
        dict(
            name=f"generation, N = {sizes['rows']} × {sizes['tokens']} new tokens, against model.generate and tools on",
            seconds=55,
            json=directory / "generation.json",
            command=[*bench, *model, "--batch_sizes", sizes["rows"], "--max_new_tokens", sizes["tokens"]]
            + ["--modes", "greedy", "--contenders", "nanopo,hf,tools", "--repeats", "1", "--train_steps", ""],
        ),
        dict(
            name=f"decode, N = {sizes['decode_rows']} × {sizes['decode_tokens']} new tokens, sampled, against "
            "the masked step; the sampler and the attention part by part",
            seconds=80,
            json=directory / "decode.json",
            command=[*bench, *model, "--batch_sizes", sizes["decode_rows"], "--max_new_tokens", sizes["decode_tokens"]]
            + ["--modes", "sampled", "--contenders", "nanopo,masked", "--repeats", "1", "--train_steps", ""]
            + ["--sampler_rows", sizes["decode_rows"], "--attention_rows", sizes["decode_rows"]],
        ),
        *[
            dict(
                name=f"one {script}.py step, B = {sizes['batch']}, G = {sizes['group']}, {sizes['decode_tokens']} new "
                "tokens, sized by the preflight" + (", gradient checkpointing" if script == "ppo" else ""),
                seconds=seconds,
                json=directory / f"step_{script}.json",
                command=[*bench, *model, "--train_steps", script, *step, "--batch_sizes", ""]
                + (["--gradient_checkpointing", "true"] if script == "ppo" else []),
            )
            for script, seconds in (("grpo", 90), ("dapo", 80), ("ppo", 115))
        ],
        dict(
            name=f"profile: one grpo.py step, B = {sizes['profile_batch']}, G = {sizes['group']}, "
            f"{sizes['decode_tokens']} new tokens, its scoring and update (optional: on the time left)",
            seconds=0,
            optional=True,
            json=directory / "profile_grpo.json",
            command=[*bench, *model, "--profile", "grpo", *step[:2], "--train_batch_size", sizes["profile_batch"]]
            + ["--group_size", sizes["group"], "--profile_phases", "logprobs,update"],
        ),
        *[
            against_step_4(name, flags)
            for name, flags in (  # the first gets what stages 1-7 leave of a whole run (~95 s on the H100)
                ("bf16_weights", "--dtype bfloat16"),
                ("checkpointed", "--gradient_checkpointing true"),
                ("compiled_checkpointed", "--compile true --gradient_checkpointing true"),
            )
        ],
        dict(
            name=f"steps 4 + 6 of grpo.py, {sizes['profile_batch']} groups of {sizes['group']}, each prompt once per "
            "group (shared) against once per row and one packed pass (FlexAttention) a micro-batch (optional: on the "
            "time left)",
            seconds=0,
            optional=True,
            json=directory / "steps_4_and_6.json",
            command=[*bench, *model, "--step_rows", str(int(sizes["profile_batch"]) * int(sizes["group"]))]
            + ["--group_size", sizes["group"], "--max_new_tokens", sizes["decode_tokens"], "--micro_batch_size", "7"]
            + ["--logprob_chunk_size", "64", "--batch_sizes", "", "--train_steps", ""]
            + ["--repeats", "1"],
        ),
        against_step_4("compiled", "--compile true", ", after one that compiles"),
        dict(
            name="the compiled decode step, captured, against the scorer (optional: on the time left)",
            seconds=0,
            optional=True,
            command=[sys.executable, "-m", "pytest", "-m", "cuda", str(ROOT / "tests" / "test_cuda.py"), "-s"]
            + ["-k", "compiled_decode"],
        ),
        dict(
            name=f"decode, N = {sizes['decode_rows']} × {sizes['decode_tokens']} new tokens, sampled, with --compile's "
            "model (its one-token step one compiled graph) against without, after a call that compiles, and "
            "against separate products (optional: on the time left)",
            seconds=0,
            optional=True,
            json=directory / "decode_compiled.json",
            command=[*bench, *model, "--batch_sizes", sizes["decode_rows"], "--max_new_tokens", sizes["decode_tokens"]]
            + ["--modes", "sampled", "--contenders", "nanopo,compiled,separate", "--repeats", "1", "--train_steps", ""]
            + ["--decode_layers", "4"],
        ),
        against_step_4("bf16_activations", "--bf16_activations true", " (issue 58's lever 4)"),
        against_step_4(
            "bf16_head", "--head_precision bf16", " (the LM head's GEMMs on bf16 inputs, issue 58's lever 3)"
        ),
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


def run_stage(stage: dict, limit: float) -> dict:
    """Runs one stage under `limit` seconds; returns status, seconds, output. A JSON of an earlier
    run is removed first: what the report shows was measured by this one."""
    if "json" in stage:
        stage["json"].unlink(missing_ok=True)
        stage["command"] += ["--output", str(stage["json"])]
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(stage["command"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        status = f"stopped at its {limit:.0f} s limit"
        output = (stopped.stdout or b"").decode(errors="replace") + (stopped.stderr or b"").decode(errors="replace")
    return {"status": status, "seconds": time.monotonic() - start, "output": output, "limit": limit}


def report_stage(stage: dict, result: dict) -> str:
    shown = shlex.join(str(part).replace(str(ROOT) + "/", "") for part in stage["command"])
    lines = [f"## {stage['name']}", "", f"    {shown}", ""]
    lines += [
        f"{result['status']}, {result['seconds']:.0f} s (share {stage['seconds']} s, limit {result['limit']:.0f} s)"
    ]
    lines += [""]
    if stage["name"] == "CUDA tier":
        summary = [line for line in result["output"].splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
        gap = [line for line in result["output"].splitlines() if "sampler vs trainer" in line]
        lines += [f"pytest: {summary[-1].strip('= ') if summary else 'no summary line'}", *gap, ""]
        lines += [
            "Not run here (-k): the torchrun NCCL test and the bench smoke on CUDA; the compiled decode's test is"
            f' stage 13 (`-k "{SLOW_CUDA_TESTS}"`).',
            "",
        ]
    if "json" in stage and stage["json"].exists():
        tables = json.loads(stage["json"].read_text())
        if tables.get("profile"):
            lines += [f"Copy bandwidth {tables['copy bandwidth GB/s']:.0f} GB/s; MFU against {tables['peak']}.", ""]
        for section in SECTIONS:
            if tables.get(section):
                lines += [f"### {section}", "", markdown(tables[section]), ""]
        lines += [
            f"- bound: {row['bound arithmetic']}" for row in tables.get("generation", []) if "bound arithmetic" in row
        ]
        lines += [""]
    warned = dict.fromkeys(line.strip() for line in result["output"].splitlines() if "Warning: " in line)
    if warned:  # e.g. a CUDA-graph capture that fell back to eager decoding: the times are not the graph's
        lines += ["Warnings:", "", *[f"- `{line[:300]}`" for line in list(warned)[:8]], ""]
    if not result["status"].startswith("passed"):
        lines += ["The end of its output:", "", "```", result["output"][-3000:], "```", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="the Markdown report; bench's JSON files go beside it")
    parser.add_argument("--smoke", action="store_true", help="the same stages with the tiny model on the CPU")
    parser.add_argument("--deadline", type=float, default=560, help="seconds for every stage together")
    parser.add_argument(
        "--stages", default="", help="the stages to run, by number (1-16, as above), comma-separated; default all"
    )
    parser.add_argument("--model_dir", default=str(default_model_dir(SHAPE)), help="the 1.5B shape, written once")
    options = parser.parse_args()
    output = Path(options.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + options.deadline
    planned = stages(options.smoke, output.parent, Path(options.model_dir))
    if options.stages:  # checked before anything runs
        chosen = [int(n) if n.strip().isdigit() else 0 for n in options.stages.split(",")]
        if not all(1 <= n <= len(planned) for n in chosen):
            parser.error(f"--stages {options.stages}: stages are numbered 1 to {len(planned)}")
        planned = [planned[n - 1] for n in sorted(set(chosen))]
    sections = [
        "# nanoPO: the CUDA path's acceptance run",
        "",
        f"{versions()}; Python {platform.python_version()}; {'smoke (tiny, CPU)' if options.smoke else SHAPE}",
        "",
    ]
    log = output.with_suffix(".log")
    log.unlink(missing_ok=True)
    failed = 0
    for i, stage in enumerate(planned):
        later = sum(s["seconds"] for s in planned[i + 1 :])  # what the stages after it keep
        result = run_stage(stage, max(1.0, deadline - time.monotonic() - later))  # its share, and time left over
        failed += not result["status"].startswith("passed") and not stage.get("optional")
        sections.append(report_stage(stage, result))
        output.write_text("\n".join(sections) + "\n")  # after every stage: a cut-off run keeps its report
        with log.open("a") as whole:  # every stage's whole output, where the report keeps the end of a failure's
            whole.write(f"===== {stage['name']}: {result['status']}, {result['seconds']:.0f} s\n{result['output']}\n")
        print(f"{stage['name']}: {result['status']}, {result['seconds']:.0f} s", flush=True)
    print(f"report: {output}; every stage's output: {log}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
