"""Step 4 without the policy's no-grad pass. On-policy (one update over one mini-batch) π_θold is
the π_θ of the update's own forward pass, so the scripts skip that pass and take old_logp and the
entropy from the update (old_and_ref_logprobs). The training must not change by a bit: the
loss never read the pass's old_logp on-policy (its ratio is exp(logp − logp.detach()) = 1);
only the metrics did, and they now read log-probs of the same weights from another forward pass."""

import json

import pytest
from safetensors.torch import load_file

import dapo
import grpo
import ppo

# Two steps of the digit task: step 2 samples from the weights step 1 trained, so a difference
# in the update would show in its rollout too. B·G = 128 completions of 2 tokens, so that both
# steps have rewards to learn from (test_train.py's resume test: measured, every step rewarded).
COMMON = dict(model="tiny", task="digit", lr=3e-3, max_new_tokens=2, batch_size=16, group_size=8, save_every=0)
ON_POLICY = {
    grpo: {},
    dapo: {"overlong_buffer": 0, "dynamic_sampling": False},
    ppo: {"num_mini_batches": 1, "beta": 0.0},  # PPO's default β > 0 needs old_logp in step 5's reward
}


def run(script, directory, monkeypatch, force_pass: bool, max_steps=2, **settings):
    """Trains; returns (the score_policy of every step-4 call, metrics rows, final weights).
    force_pass: step 4 scores the policy whatever train asked, as before the pass was skipped."""
    asked, real = [], script.old_and_ref_logprobs

    def recording(*args, score_policy, **options):
        asked.append(score_policy)
        return real(*args, score_policy=score_policy or force_pass, **options)

    monkeypatch.setattr(script, "old_and_ref_logprobs", recording)
    args = script.Args(output_dir=str(directory), max_steps=max_steps, **{**COMMON, **settings})
    run_dir = script.train(args)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return asked, rows, load_file(run_dir / "final" / "model.safetensors")


@pytest.mark.parametrize("script", ON_POLICY, ids=lambda script: script.__name__)
def test_the_update_without_the_pass_equals_the_update_with_it(script, tmp_path, monkeypatch):
    asked, skipped_rows, skipped = run(script, tmp_path / "skipped", monkeypatch, False, **ON_POLICY[script])
    assert asked == [False, False]  # on-policy: no policy pass in step 4
    _, scored_rows, scored = run(script, tmp_path / "scored", monkeypatch, True, **ON_POLICY[script])
    assert all(row["reward/mean"] > 0 for row in scored_rows)  # a policy-gradient signal in both steps
    assert max((skipped[k] - scored[k]).abs().max().item() for k in scored) <= 1e-6  # measured: 0
    for skipped_row, scored_row in zip(skipped_rows, scored_rows):
        for key, value in scored_row.items():
            if key.startswith(("time/", "throughput/", "memory/")):
                continue
            # The entropy and the sampler/scorer difference come from another forward pass of
            # the same weights (micro_batch_size rows at a time, train mode): fp32 noise.
            tolerance = 1e-5 if key.startswith("policy/") else 0.0
            assert skipped_row[key] == pytest.approx(value, abs=tolerance, nan_ok=True), key


@pytest.mark.parametrize(
    "script, settings, expected",
    [(grpo, {"num_iterations": 2}, [True, True]),
     (dapo, {"num_mini_batches": 2, "dynamic_sampling": False, "overlong_buffer": 0}, [True, True]),
     (ppo, {"num_mini_batches": 1}, [True, True]),
     (ppo, {"num_mini_batches": 1, "beta": 0.0, "value_warmup_steps": 1}, [True, False])],
    ids=["grpo-mu2", "dapo-2-mini-batches", "ppo-beta", "ppo-value-warmup"],
)  # fmt: skip
def test_the_pass_runs_where_it_is_needed(script, settings, expected, tmp_path, monkeypatch):
    # μ > 1 or several mini-batches: θ moves between updates, the ratios need θold's log-probs.
    # PPO with β > 0: step 5's per-token reward needs old_logp before the update. A value warm-up
    # step (step 1 here) does not update the policy: no forward pass of it could stand in.
    asked, rows, _ = run(script, tmp_path, monkeypatch, False, **settings)
    assert asked == expected
    assert all(row["policy/sample_logp_diff"] <= 1e-5 for row in rows)
