"""Tools at agent scale (issue 59): what a user of tools meets, each with a test that failed before
its fix. dapo.py logs tools/* over every completion it sampled, so a step whose groups are all
filtered still shows its calls; a run prints its directory when it starts."""

import pytest
import torch
from test_cli import no_model_load, tiny_args

import common
import dapo
import grpo
import ppo
from rewards import Score


def rollout_of(completion_mask, tool_mask, tool_counts) -> dapo.Rollout:
    rows, width = completion_mask.shape
    return dapo.Rollout(
        prompt_ids=torch.zeros(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1, dtype=torch.long),
        completion_ids=torch.zeros(rows, width, dtype=torch.long), completion_mask=completion_mask,
        truncated=torch.zeros(rows, dtype=torch.bool), sample_logp=torch.zeros(rows, width),
        rewards=torch.zeros(rows), texts=[""] * rows, scores=[Score(0.0, False, False)] * rows, tool_mask=tool_mask,
        tool_counts=tool_counts,
    )  # fmt: skip


def test_dapo_logs_tools_over_every_completion_it_sampled_even_with_every_group_filtered():
    # Two rounds of G = 2 with different widths, no group kept (every reward 0). Calls, failed, turns:
    # round 1 [1, 0, 1], [0, 0, 0]; round 2 [2, 1, 1], [1, 1, 1]. calls (1 + 0 + 2 + 1)/4 = 1.0 a
    # completion, errors 2 of 4 calls = 0.5, turns 3/4 = 0.75; the tools' tokens 2 + 1 = 3 of
    # 3 + (3 + 2 + 2 + 1) = 11 in all: 3/11.
    first = rollout_of(
        torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]]), torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]]),
        torch.tensor([[1, 0, 1], [0, 0, 0]]),
    )  # fmt: skip
    second = rollout_of(
        torch.tensor([[1, 0, 1], [1, 1, 0]]), torch.tensor([[0, 1, 0], [0, 0, 0]]), torch.tensor([[2, 1, 1], [1, 1, 1]])
    )
    metrics = dapo.sampling_metrics([first, second], groups_kept=0, group_size=2)
    assert metrics["sampling/groups_kept"] == 0
    assert {k: v for k, v in metrics.items() if k.startswith("tools/")} == pytest.approx(
        {"tools/calls": 1.0, "tools/errors": 0.5, "tools/turns": 0.75, "tools/env_share": 3 / 11}
    )
    # without tools: no tools/ keys
    plain = rollout_of(torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), None)
    assert not any(k.startswith("tools/") for k in dapo.sampling_metrics([plain], 0, 2))


def test_a_run_prints_its_directory_when_it_starts(tmp_path, capsys):
    run_dir = grpo.train(tiny_args(grpo, max_steps=1, output_dir=str(tmp_path)))
    assert f"grpo: run directory {run_dir}\n" in capsys.readouterr().out


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=lambda m: m.__name__)
def test_max_turns_0_with_tools_stops_before_any_weight_loads(script, tmp_path, monkeypatch):
    # Tools given and no turn for them: every call would end its completion unanswered. The task's
    # tools are known before the model loads: the run stops there, with no run directory.
    monkeypatch.setattr(common, "load_model", no_model_load)
    with pytest.raises(SystemExit, match=r"--max_turns 0 gives the task's tools \(calculator\) no turn"):
        script.train(tiny_args(script, task="digit", tools="calculator", max_turns=0, output_dir=str(tmp_path)))
    assert not any(tmp_path.iterdir())
