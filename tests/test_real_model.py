"""Opt-in: a few steps of each script on a real model, with what must hold for any model.

    NANOPO_REAL_MODEL=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf python -m pytest tests/test_real_model.py

NANOPO_REAL_MODEL is a model directory or a GGUF file (or a directory holding one); without it
every test here is skipped (CI's default run has no real model). Each script trains 2 steps of
2 Countdown prompts x 2 completions (2 numbers, one worked example, 16 new tokens) on the CPU
in fp32, and then: the log-probs recorded while sampling equal a fresh scoring pass, every
loss is finite, and the final checkpoint reloads and evaluate.py scores it."""

import json
import math
import os

import pytest

import dapo
import evaluate
import grpo
import ppo

REAL_MODEL = os.environ.get("NANOPO_REAL_MODEL", "")
pytestmark = pytest.mark.skipif(not REAL_MODEL, reason="set NANOPO_REAL_MODEL=<model dir or .gguf> to run")


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=lambda m: m.__name__)
def test_a_real_model_trains_saves_and_evaluates(script, tmp_path):
    settings = dict(model=REAL_MODEL, task="countdown", countdown_numbers="2", shots=1, max_new_tokens=16)
    settings |= dict(batch_size=2, group_size=2, max_steps=2, lr=1e-5, device="cpu", output_dir=str(tmp_path))
    if script is dapo:
        settings |= dict(dynamic_sampling=False, overlong_buffer=4)
    run_dir = script.train(script.Args(**settings))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["policy/sample_logp_diff"] < 1e-4, row  # sampler = scorer (fp32 on the CPU)
        losses = {k: v for k, v in row.items() if "loss" in k}
        assert losses and all(math.isfinite(v) for v in losses.values()), losses
    final = run_dir / "final"
    assert (final / "model.safetensors").exists()
    eval_args = evaluate.Args(
        model=str(final), benchmarks="countdown", countdown_problems=4, countdown_numbers="2", shots=1,
        max_new_tokens=16, batch_size=4, device="cpu", output_dir=str(tmp_path / "eval"),
    )  # fmt: skip
    eval_dir = evaluate.main(eval_args)
    results = json.loads((eval_dir / "results.json").read_text())
    assert results["results"]["countdown"]["n"] == 4
