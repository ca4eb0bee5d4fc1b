"""Tests run offline: the tiny model is built into a per-session cache and nothing may reach
the Hugging Face Hub.

Two tiers. The CPU tier (every test not marked `cuda`) runs on the CPU whatever the machine
has: its exact values and bit-identical runs are fp32 CPU arithmetic, and its torchrun tests
use gloo with two processes. On a GPU machine `--device auto` would pick CUDA, so for these
tests torch.cuda.is_available() answers False, and every process they start sees no GPU
(CUDA_VISIBLE_DEVICES=""). The CUDA tier (tests/test_cuda.py, marked `cuda`) runs where a GPU
is, with the CUDA_VISIBLE_DEVICES the session started with, and is skipped elsewhere:
`python -m pytest -m cuda`."""

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NANOPO_CACHE", os.path.join(tempfile.gettempdir(), "nanopo-test-cache"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Asked before CUDA_VISIBLE_DEVICES is cleared: the CUDA driver reads that variable once, at this
# first question, so this process keeps its GPUs. But torch.cuda.device_count() (and with it
# get_device_properties and set_device) reads the variable again, through NVML, at every call until
# CUDA is initialised, and torch up to 2.10 caches what its first call after that reads: a CUDA-tier
# test must run with the variable as the session found it (tier_environment), or it sees 0 GPUs
# ("Invalid device id"), and the count is cached while it is so.
CUDA = torch.cuda.is_available()
GPU_ENV = {k: v for k, v in os.environ.items()}  # the environment a CUDA-tier subprocess gets
HIDDEN = ""  # CUDA_VISIBLE_DEVICES of the CPU tier: the processes it starts (torchrun, smoke runs) see no GPU
os.environ["CUDA_VISIBLE_DEVICES"] = HIDDEN


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config, specs):
    """`pytest -n` (pytest-xdist): the workers are new processes started from this one's environment,
    in which the line above has cleared CUDA_VISIBLE_DEVICES. They get the variable back as the
    session found it, so that each asks torch the question above for itself and keeps its GPUs for
    the CUDA tier; this process only hands out tests."""
    visible = GPU_ENV.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: the CUDA tier, run where a GPU is (python -m pytest -m cuda)")
    config.addinivalue_line(
        "markers", "launches: runs a script in a process of its own, in another directory (mutmut leaves it out)"
    )
    # pytest-xdist's own marker, declared here too for a run without it (the GPU image): the tests of one
    # group share a costly module fixture, and `-n 2 --dist loadgroup` gives them one worker
    config.addinivalue_line("markers", "xdist_group(name): run in one worker under pytest -n --dist loadgroup")


def tier_environment(item) -> str | None:
    """CUDA_VISIBLE_DEVICES for a test: the session's own for the CUDA tier (None: it was unset),
    HIDDEN for the CPU tier."""
    return GPU_ENV.get("CUDA_VISIBLE_DEVICES") if item.get_closest_marker("cuda") else HIDDEN


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test runs with its tier's CUDA_VISIBLE_DEVICES from the set-up of its fixtures
    (module-scoped ones too, which set up before any function-scoped fixture could act) to
    their tear-down; between tests, HIDDEN."""
    visible = tier_environment(item)
    if visible is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        yield
    finally:
        if item.get_closest_marker("cuda") and torch.cuda.is_initialized():
            torch.cuda.device_count()  # cached now, with the GPU in sight, not by a later CPU-tier call
        os.environ["CUDA_VISIBLE_DEVICES"] = HIDDEN


@pytest.fixture(autouse=True)
def device_tier(request, monkeypatch):
    """The CPU tier on the CPU; the CUDA tier skipped without a GPU."""
    if request.node.get_closest_marker("cuda"):
        if not CUDA:
            pytest.skip("the CUDA tier needs a GPU")
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device auto -> cpu


def sample_batch(model, tokenizer, eos_ids) -> dict:
    """3 Countdown prompts × 4 completions of up to 12 tokens from `model` (unequal lengths,
    some truncated), in the layout policy_backward takes, with old, sampler and reference log-probs
    moved away from the model's own (ratios ≠ 1, some tokens clipped, a KL gradient).
    Draws from torch's global RNG: seed it first."""
    from grpo import encode_prompts, generate, sequence_logprobs
    from rewards import load_task

    task = load_task("countdown", seed=0, num_problems=3)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [task.messages(p) for p in task.problems], 4, "cpu")
    ids, mask, truncated, _, _ = generate(
        model, prompt_ids, prompt_mask, 12, eos_ids, tokenizer.pad_token_id, len(tokenizer)
    )
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, len(tokenizer), 4)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": ids,
        "completion_mask": mask,
        "truncated": truncated,
        "old_logp": (logp + 0.3 * torch.randn_like(logp)) * mask,
        "ref_logp": (logp + 0.2 * torch.randn_like(logp)) * mask,
        "advantages": torch.randn(ids.shape[0]),
        "sample_logp": (logp + 0.3 * torch.randn_like(logp)) * mask,  # the sampler's: neither π_θold's nor π_θ's
    }


@torch.no_grad()
def greedy_by_recomputation(model, prompt_ids, prompt_mask, steps: int, vocab_size: int) -> torch.Tensor:
    """Greedy tokens with no cache at all: the whole sequence (prompt + tokens so far) through
    the model at every step, the reference a cached generate must match. (N, steps)"""
    ids, attention, tokens = prompt_ids, prompt_mask, []
    for _ in range(steps):
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
        token = logits[:, -1, :vocab_size].argmax(-1)
        tokens.append(token)
        ids = torch.cat([ids, token[:, None]], dim=1)
        attention = torch.cat([attention, torch.ones_like(token)[:, None]], dim=1)
    return torch.stack(tokens, dim=1)


@pytest.fixture(scope="module")
def sampled():
    """A real batch from the tiny model for the loss and gradient tests of grpo.py and dapo.py
    (sample_batch). Returns (model, tokenizer, batch)."""
    from common import load_model

    torch.manual_seed(0)
    model, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    return model, tokenizer, sample_batch(model, tokenizer, eos_ids)


def crash_and_resume(script, tmp_path, monkeypatch, **settings):
    """The resume test of a training script (grpo, dapo or ppo, the module): run A goes
    straight through max_steps; run B checkpoints every 2 steps and crashes while writing
    its final checkpoint, after the last step was logged; B is then resumed from step-000002.
    Returns (A's run dir, B's run dir after resuming) for the caller to compare bit for bit.
    Checks on the way that B kept one log row per step: the rows of the steps run again after
    the checkpoint were dropped, not duplicated."""
    import common

    straight = script.train(script.Args(output_dir=str(tmp_path / "a"), save_every=0, **settings))
    real_save = common.save_checkpoint  # what Run.save writes with

    def crash_on_final(path, *rest, **options):
        if path.name == "final":
            raise KeyboardInterrupt("simulated crash")
        real_save(path, *rest, **options)

    monkeypatch.setattr(common, "save_checkpoint", crash_on_final)
    with pytest.raises(SystemExit) as stop:  # train() turns Ctrl-C into a message and exit status 130
        script.train(script.Args(output_dir=str(tmp_path / "b"), save_every=2, **settings))
    assert stop.value.code == 130
    monkeypatch.setattr(common, "save_checkpoint", real_save)
    (crashed,) = (tmp_path / "b").iterdir()
    resumed = script.train(
        script.Args(output_dir=str(tmp_path / "b"), resume_from=str(crashed / "step-000002"), **settings)
    )
    assert resumed == crashed
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, settings["max_steps"] + 1))
    return straight, resumed


def gradients_and_totals(script, model, batch, args, vocab_size, backward="policy_backward"):
    """The gradient (flattened) and the summed statistics of one policy_backward (or critic_backward),
    with what policy_backward recorded (on-policy: old_logp and entropy, (n, T))."""
    model.zero_grad(set_to_none=True)
    if backward == "critic_backward":
        totals = script.critic_backward(model, batch, args)
    else:
        totals, recorded = script.policy_backward(model, batch, args, vocab_size)
        totals = totals | recorded  # on-policy: the log-probs and entropy it recorded, compared too
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return gradient, totals


def assert_same_update(first, second):
    """Two fp32 computations of one update (gradients_and_totals) that differ only in kernel shapes and
    summation order, compared within fp32's reassociation error (eps = 1.19e-7) for their size, N the
    mini-batch's valid tokens (66 in these tests). Measured on 2 CPUs (AMD EPYC), worst of
    tests/test_padding.py and tests/test_shared_prompt.py: the gradient 6.1 eps of its largest entry,
    a summed statistic 1.14e-6 relative (the summed KL of 42 tokens; it failed the old 1e-6), a log-prob
    1 ulp (9.5e-7 at |log π| in [8, 16), against the old 1e-6 absolute)."""
    eps = torch.finfo(torch.float32).eps
    (gradient, totals), (reference, reference_totals) = first, second
    tokens = max(reference_totals.get("tokens", 0), 1)
    assert reference.abs().max() > 0
    # Each gradient entry sums the N tokens' contributions (then the micro-batches'): a sum of N terms
    # is exact to (N − 1)·eps of the terms' absolute sum, here taken at the gradient's largest entry.
    assert (gradient - reference).abs().max() <= tokens * eps * reference.abs().max()
    for key, value in reference_totals.items():
        if isinstance(value, torch.Tensor):  # on-policy: step 4's log-probs and entropy, in the rows given
            # One log-softmax (or entropy) a token, from kernels of other shapes: a few roundings at the
            # value's size, 8 ulps of the largest (1 measured).
            assert (totals[key] - value).abs().max() <= 8 * eps * value.abs().max(), key
        else:
            # A sum over the N tokens: within N·eps of the sum of its terms' sizes, which is |value| for
            # terms of one sign (KL, counts, weights, NLL) and at most N·eps absolute for the loss, whose
            # terms (Â·r, β·KL, a token's share of its normaliser) are O(1) and partly cancel.
            assert totals[key] == pytest.approx(value, rel=tokens * eps, abs=tokens * eps), key


def flash_varlen_by_the_book(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p, is_causal, debug, **options
):
    """flash attention's variable-length entry as its contract reads, for the CPU, where PyTorch has
    no kernel for it: sequence i's queries query[cu_seq_q[i]:cu_seq_q[i+1]] attend to the first
    seqused_k[i] keys from cu_seq_k[i] (all up to cu_seq_k[i+1] without it), query head h to KV
    head h // (heads / kv heads), scores times `scale`, no mask. -> (output, and four unused)."""
    assert dropout_p == 0 and not is_causal and not debug and max_q == 1
    used, out = options.get("seqused_k"), []
    for i in range(len(cu_seq_q) - 1):
        end = cu_seq_k[i] + used[i] if used is not None else cu_seq_k[i + 1]
        q, k, v = query[cu_seq_q[i] : cu_seq_q[i + 1]], key[cu_seq_k[i] : end], value[cu_seq_k[i] : end]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (s, heads, d)
        scale = options.get("scale") or q.shape[-1] ** -0.5  # None: flash attention's default
        weights = (torch.einsum("qhd,shd->hqs", q, k) * scale).softmax(-1)
        out.append(torch.einsum("hqs,shd->qhd", weights, v))
    return torch.cat(out), None, None, None, None


@pytest.fixture
def varlen(monkeypatch):
    """generate's one-token step as on a GPU in bf16, on the CPU: varlen_decode_attention over a
    left-aligned cache wherever the model allows it (common.flash_varlen_serves answers yes), flash
    attention's variable-length entry computed by its contract. -> the list of its calls."""
    import common

    calls = []

    def counted(*args, **options):
        calls.append(args[0].shape[0])  # the rows of the call
        return flash_varlen_by_the_book(*args, **options)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", counted)
    monkeypatch.setattr(common, "flash_varlen_serves", lambda values: True)
    return calls


def trainer_state(path) -> dict:
    """A trainer state as a resume reads it: as data only (common.read_trainer_state), so that a test
    that reads one also proves that every state the scripts write loads without running code."""
    import common

    return common.read_trainer_state(Path(path).parent, Path(path))
