"""Every range a flag is checked against, at its boundary, in every script that has the flag (issue 57):
the last value accepted runs the script's check_args without a word, and the first value past it stops
with a message naming the flag. The table is the checks' own: a limit added to a check_args belongs
here; a flag a script has but does not check fails the refused case in that script."""

import pytest
from test_cli import tiny_args

import dapo
import grpo
import ppo

TINY_FLOAT = 1e-9  # "> 0": the smallest step past 0 a user could mean
# (flag, last accepted, first refused, other settings the values need); a flag absent from a script's Args is skipped there
BOUNDARIES = [
    ("lr", TINY_FLOAT, 0.0, {}),
    ("lora_rank", 0, -1, {}),
    ("lora_alpha", TINY_FLOAT, 0.0, {"lora_rank": 1}),
    ("adam_beta2", 0.0, -TINY_FLOAT, {}),
    ("adam_beta2", 1 - TINY_FLOAT, 1.0, {}),
    ("max_grad_norm", TINY_FLOAT, 0.0, {}),
    ("weight_decay", 0.0, -TINY_FLOAT, {}),
    *[(name, 0, -1, {}) for name in ("warmup_steps", "save_every", "sample_every", "num_samples", "seed", "shots")],
    ("max_steps", 1, 0, {}),
    ("eval_every", 0, -1, {}),
    ("eval_problems", 1, 0, {"eval_every": 1}),
    ("eval_batch_size", 1, 0, {"eval_every": 1}),
    *[(name, 0, -1, {}) for name in ("micro_batch_size", "micro_batch_tokens", "logprob_chunk_size")],
    ("logprob_chunk_tokens", 0, -1, {}),
    ("max_turns", 0, -1, {}),
    ("max_tool_tokens", 1, 0, {}),
    ("tool_workers", 1, 0, {}),
    *[(name, TINY_FLOAT, 0.0, {}) for name in ("reward_fn_timeout", "tool_timeout")],
    *[(name, 1e300, float("inf"), {}) for name in ("reward_fn_timeout", "tool_timeout")],
    ("batch_size", 1, 0, {"num_mini_batches": 1}),  # ppo.py's default 4 divides no 1 × 2 rows
    ("max_new_tokens", 1, 0, {"overlong_buffer": 0}),
    ("num_mini_batches", 1, 0, {}),
    ("temperature", TINY_FLOAT, 0.0, {}),
    ("top_p", TINY_FLOAT, 0.0, {}),
    ("top_p", 1.0, 1 + TINY_FLOAT, {}),
    ("dual_clip", 0.0, -TINY_FLOAT, {}),
    ("dual_clip", 1 + TINY_FLOAT, 1.0, {}),
    ("tis_cap", 0.0, -TINY_FLOAT, {}),
    ("tis_cap", 1.0, 1 - TINY_FLOAT, {}),
    ("is_mask", "0,1.001", "0,1", {}),
    ("is_mask", "0.999,2", "1,2", {}),
    ("is_mask", "0,2", "-0.001,2", {}),
    ("beta", 0.0, -TINY_FLOAT, {}),
    ("entropy_coef", 0.0, -TINY_FLOAT, {}),
    # grpo.py and dapo.py
    ("adv_eps", 0.0, -TINY_FLOAT, {}),
    ("num_iterations", 1, 0, {}),
    *[(name, TINY_FLOAT, 0.0, {}) for name in ("sapo_tau_pos", "sapo_tau_neg", "dppo_delta", "dppo_kl_delta")],
    ("dppo_ratio_cap", 1.0, 1 - TINY_FLOAT, {}),
    ("kl_tau", 0.0, -TINY_FLOAT, {}),
    *[(name, 1.0, 1 + TINY_FLOAT, {}) for name in ("clip_cov_ratio", "kl_cov_ratio", "top_entropy_quantile")],
    *[(name, TINY_FLOAT, 0.0, {}) for name in ("clip_cov_ratio", "kl_cov_ratio", "top_entropy_quantile")],
    ("kl_cov_coef", 0.0, -TINY_FLOAT, {}),
    ("off_policy_mask_threshold", 0.0, -TINY_FLOAT, {}),
    ("ref_ema_decay", 0.0, -TINY_FLOAT, {}),
    ("ref_ema_decay", 1 - 1e-6, 1.0, {"beta": 0.01}),
    ("cispo_eps_low", 0.0, -TINY_FLOAT, {}),
    ("cispo_eps_high", TINY_FLOAT, 0.0, {}),
    # grpo.py
    *[(name, TINY_FLOAT, 0.0, {}) for name in ("eps", "gspo_eps_low", "gspo_eps_high")],
    # dapo.py and ppo.py
    ("eps_low", 0.0, -TINY_FLOAT, {}),
    ("eps_low", 1 - TINY_FLOAT, 1.0, {}),
    ("eps_high", 0.0, -TINY_FLOAT, {}),
    # dapo.py
    ("overlong_buffer", 0, -1, {}),
    ("overlong_buffer", 4, 5, {"max_new_tokens": 4}),
    ("gen_batch_size", 0, -1, {}),
    ("max_gen_rounds", 1, 0, {}),
    # ppo.py
    ("critic_lr", TINY_FLOAT, 0.0, {}),
    *[(name, 0.0, -TINY_FLOAT, {}) for name in ("gamma", "lam_actor", "lam_critic")],
    *[(name, 1.0, 1 + TINY_FLOAT, {}) for name in ("gamma", "lam_actor", "lam_critic")],
    ("pos_lm_coef", 0.0, -TINY_FLOAT, {}),
    *[(name, TINY_FLOAT, 0.0, {}) for name in ("eps_value", "lam_alpha", "whiten_eps")],
    ("value_warmup_steps", 0, -1, {}),
    ("value_warmup_steps", 2, 3, {"max_steps": 3}),
    ("ppo_epochs", 1, 0, {}),
]
# (flag, script) pairs where the boundary is another one: group_size, a group of one in GRPO and DAPO
GROUP_SIZE = [(grpo, 2, 1), (dapo, 2, 1), (ppo, 1, 0)]


def cases():
    for script in (grpo, dapo, ppo):
        fields = script.Args.__dataclass_fields__
        for flag, accepted, refused, settings in BOUNDARIES:
            if flag in fields and all(name in fields for name in settings):
                yield pytest.param(script, flag, accepted, refused, settings, id=f"{script.__name__}-{flag}-{refused}")
        for group_script, accepted, refused in GROUP_SIZE:
            if group_script is script:
                settings = {"num_mini_batches": 1}
                yield pytest.param(
                    script, "group_size", accepted, refused, settings, id=f"{script.__name__}-group_size"
                )


@pytest.mark.parametrize("script, flag, accepted, refused, settings", cases())
def test_each_limit_holds_at_its_boundary_in_every_script(script, flag, accepted, refused, settings):
    script.check_args(tiny_args(script, **settings, **{flag: accepted}))  # no SystemExit
    with pytest.raises(SystemExit) as stop:
        script.check_args(tiny_args(script, **settings, **{flag: refused}))
    assert f"--{flag}" in str(stop.value), str(stop.value)


def test_the_table_covers_every_script():
    # each script checks at least these many of the flags above (a renamed flag drops out silently)
    counted = {script: sum(1 for case in cases() if case.values[0] is script) for script in (grpo, dapo, ppo)}
    assert counted[grpo] >= 60 and counted[dapo] >= 60 and counted[ppo] >= 50, counted
