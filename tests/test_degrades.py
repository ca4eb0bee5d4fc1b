"""The first GPU run degrades instead of dying, and says why, with nobody watching: a CUDA-graph
capture that raises leaves the decode eager (one warning); out of memory in any phase ends with
one message naming the phase, its shapes, the memory and the flags that lower it, and the newest
checkpoint; a sampler that does not sample from the model it trains is reported once. Each
simulated on the CPU."""

import sys
import warnings

import pytest
import torch

import common
import dapo
import grpo
import ppo

RUN = dict(model="tiny", task="digit", batch_size=2, group_size=2, max_new_tokens=4, sample_every=0, beta=0.0)


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


# ----------------------------------------------------------------------------------------
# CUDA-graph capture


def test_a_failed_capture_warns_once_and_decodes_eagerly(monkeypatch):
    monkeypatch.setattr(common, "CAPTURE_FAILED", [])

    def refuses(step, pool):
        raise RuntimeError("operation not permitted when stream is capturing (simulated)")

    monkeypatch.setattr(common, "cuda_graph", refuses)
    with pytest.warns(RuntimeWarning, match=r"capture of the decode step failed \(RuntimeError: operation not"):
        assert common.captured_or_none(lambda: None, pool=None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second width, the next call: eager, and no second warning
        assert common.captured_or_none(lambda: None, pool=None) is None
    assert len(common.CAPTURE_FAILED) == 1


def test_a_capture_that_works_is_used_and_out_of_memory_is_not_a_capture_failure(monkeypatch):
    monkeypatch.setattr(common, "CAPTURE_FAILED", [])
    monkeypatch.setattr(common, "cuda_graph", lambda step, pool: "the graph")
    assert common.captured_or_none(lambda: None, pool=None) == "the graph"
    monkeypatch.setattr(common, "cuda_graph", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        common.captured_or_none(lambda: None, pool=None)
    assert common.CAPTURE_FAILED == []


def test_a_compilation_that_fails_is_not_a_capture_failure(monkeypatch):
    # --compile: the step compiles in cuda_graph's warm-up. A compilation's failure stops with
    # torch.compile's message; taken for the capture's, it turned the graphs off for the run, and the
    # eager step then failed to compile again.
    import torch._dynamo

    def fails_to_compile(step, pool):
        raise torch._dynamo.exc.Unsupported("a graph break torch.compile cannot take (simulated)")

    monkeypatch.setattr(common, "CAPTURE_FAILED", [])
    monkeypatch.setattr(common, "cuda_graph", fails_to_compile)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        common.captured_or_none(lambda: None, pool=None)
    assert common.CAPTURE_FAILED == []


# ----------------------------------------------------------------------------------------
# Out of memory: one message


def run_out_of_memory(script, tmp_path, capsys, **settings) -> str:
    """Trains until the simulated error; returns what the run printed on stderr."""
    args = script.Args(output_dir=str(tmp_path), **{**RUN, **settings})
    with pytest.raises(SystemExit) as stopped:
        script.train(args)
    assert stopped.value.code == 1
    return capsys.readouterr().err


def fails_on_call(function, when):
    """function, raising out of memory on the calls for which when(*args, **kwargs) is true."""

    def wrapped(*args, **kwargs):
        if when(*args, **kwargs):
            out_of_memory()
        return function(*args, **kwargs)

    return wrapped


def test_out_of_memory_in_generation_names_it_and_the_newest_checkpoint(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(
        grpo, "generate", fails_on_call(grpo.generate, lambda *a, **k: calls.append(1) or len(calls) == 3)
    )
    err = run_out_of_memory(grpo, tmp_path, capsys, max_steps=5, save_every=1)
    message = err.strip().splitlines()[-2]  # the message, then torch's own first line
    assert message.startswith("Out of GPU memory in generation (steps 1-3) on prompt_ids [4, ")  # N = B·G = 4 rows
    assert "in rollout()" in message and "GPU: no CUDA device" in message
    assert "--batch_size or --group_size" in message and "--max_new_tokens" in message
    checkpoint = next(tmp_path.glob("grpo-*")) / "step-000002"  # steps 1 and 2 done, the third generation failed
    assert f"Newest checkpoint: {checkpoint}. Continue with: python " in message
    assert message.endswith(f"--resume_from {checkpoint}")
    assert err.strip().splitlines()[-1] == "(torch: CUDA out of memory. Tried to allocate 2.00 GiB (simulated))"
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "script, phase, flag",
    [
        (grpo, "scoring (step 4)", "--logprob_chunk_size"),
        (grpo, "the policy update (step 6)", "--micro_batch_size"),
        (ppo, "the policy update (step 6)", "--gradient_checkpointing true"),
        (dapo, "scoring (step 4)", "--logprob_chunk_size"),
    ],
    ids=["grpo-scoring", "grpo-update", "ppo-update", "dapo-scoring"],
)
def test_out_of_memory_in_scoring_and_update_names_the_phase(script, phase, flag, tmp_path, capsys, monkeypatch):
    # Raised inside sequence_logprobs' forward pass (where it enters fp32_lm_head), which runs in
    # both phases: with grad in the update, without in step 4. generate enters it too, and passes.
    in_update = phase.startswith("the policy update")
    fp32_lm_head = common.fp32_lm_head

    def failing_head(model, weight=None):
        if sys._getframe(1).f_code.co_name == "sequence_logprobs" and torch.is_grad_enabled() == in_update:
            out_of_memory()
        return fp32_lm_head(model, weight)

    monkeypatch.setattr(common, "fp32_lm_head", failing_head)
    extra = dict(overlong_buffer=2) if script is dapo else {}
    err = run_out_of_memory(script, tmp_path, capsys, max_steps=1, save_every=0, beta=0.01, **extra)
    message = err.strip().splitlines()[-2]
    assert message.startswith(f"Out of GPU memory in {phase} on prompt_ids [")  # the rows and columns it held
    assert "completion_ids [" in message and "(rows, tokens) in sequence_logprobs()" in message and flag in message
    assert "No checkpoint was written yet (--save_every sets how often)." in message


def test_out_of_memory_in_the_held_out_evaluation_names_it(tmp_path, capsys, monkeypatch):
    greedy = lambda *args, **kwargs: kwargs["temperature"] == 0.0  # noqa: E731  (temperature 0: evaluation)
    monkeypatch.setattr(grpo, "generate", fails_on_call(grpo.generate, greedy))
    err = run_out_of_memory(grpo, tmp_path, capsys, max_steps=1, save_every=0, eval_every=1, eval_problems=2)
    assert err.strip().splitlines()[-2].startswith("Out of GPU memory in held-out evaluation on prompt_ids [2, ")
    assert "--eval_batch_size" in err


# ----------------------------------------------------------------------------------------
# The sampler/trainer gap


def test_a_sampler_off_the_model_is_reported_once(tmp_path, monkeypatch):
    # Every sampled log-prob 0.01 off the model's: 10x the fp32 bound (1e-3), 10^4 x a correct run.
    def off(*args, **kwargs):
        ids, mask, truncated, sample_logp, tool_mask = generate(*args, **kwargs)
        return ids, mask, truncated, sample_logp + 0.01 * mask, tool_mask

    generate = grpo.generate
    monkeypatch.setattr(grpo, "generate", off)
    with pytest.warns(
        RuntimeWarning, match=r"policy/sample_logp_diff = 0.01 at step 1: .* than any correct fp32 run"
    ) as seen:
        grpo.train(grpo.Args(output_dir=str(tmp_path), max_steps=3, save_every=0, **RUN))
    assert len([w for w in seen if "sample_logp_diff" in str(w.message)]) == 1  # steps 2 and 3: no more


def test_a_correct_run_is_not_reported(tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="policy/sample_logp_diff")
        grpo.train(grpo.Args(output_dir=str(tmp_path), max_steps=2, save_every=0, **RUN))
