"""The family matrix (tests/families.py): for every model family people fine-tune with RL, a tiny
random model built from transformers' own config class, its sliding windows (where it has them)
shorter than the prompts. generate must sample from the model itself: greedy tokens equal the
argmax of the model's own plain forward pass, and the log-probs the sampler records equal
sequence_logprobs' and the plain forward pass's, to 1e-5 in fp32, with left padding, groups, and
rows leaving the batch as they end (compaction). Each of the three scripts trains one step on it
and its checkpoint reloads; LoRA finds its layers; a model the scripts cannot serve stops first."""

import contextlib
import functools

import pytest
import torch
from test_tool_rollouts import sample_with_tools
from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

import common
import dapo
import grpo
import ppo
from common import attention_windows, build_tiny_model, check_servable, load_model, load_policy
from conftest import greedy_by_recomputation
from families import (
    FAMILIES,
    VOCAB,
    WINDOW,
    family_config,
    family_model,
    family_prompts,
    plain_forward_logprobs,
    unbuildable,
)
from grpo import generate, sequence_logprobs

TOLERANCE = 1e-5  # fp32: the same products in another order, ~1e-6 measured (python tests/families.py)
NEW_TOKENS = 14  # with prompts of 12 to 30 tokens and a window of 8: every decode step is past the window


# The families the installed release can build (all of them from transformers 5.17 on; families.unbuildable)
BUILDABLE = [name for name in FAMILIES if unbuildable(name) is None]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    if unbuildable(request.param):
        pytest.skip(unbuildable(request.param))
    return request.param, family_model(request.param)


def test_the_matrix_has_windows_shorter_than_its_prompts():
    # Otherwise a sampler that ignores windows would pass: the families with sliding layers must
    # have them, each of WINDOW tokens, shorter than the shortest prompt (12).
    sliding = {name for name in BUILDABLE if "sliding_attention" in attention_windows(family_model(name))}
    assert sliding == {"qwen2-window", "mistral", "gemma2", "gemma3", "phi3", "gpt-oss", "cohere2"} & set(BUILDABLE)
    assert WINDOW < family_prompts()[1].sum(-1).min()
    mixed = {name for name in sliding if len(attention_windows(family_model(name))) == 2}  # full and sliding layers
    assert mixed == {"qwen2-window", "gemma2", "gemma3", "gpt-oss", "cohere2"} & set(BUILDABLE)


def varlen_serves(model) -> bool:
    """The families whose one-token step runs varlen_decode_attention on a GPU in bf16: every layer
    full attention, computed by sdpa."""
    return attention_windows(model) == {"full_attention": None} and model.config._attn_implementation == "sdpa"


def decode_as(cuda: bool, request) -> list:
    """cuda: the one-token step as on a GPU in bf16 (conftest's varlen: its calls), else as on the CPU."""
    return request.getfixturevalue("varlen") if cuda else []


@pytest.mark.parametrize("cuda_decode", [False, True], ids=["masked", "varlen"])
def test_greedy_tokens_are_the_plain_forward_argmax(family, cuda_decode, request):
    # varlen: each row's cache from column 0, attention over its filled columns by flash attention's
    # variable-length entry (its contract on the CPU), where the family allows it; the mask elsewhere.
    name, model = family
    calls = decode_as(cuda_decode, request)
    prompt_ids, prompt_mask = family_prompts()
    ids, mask, truncated, sample_logp, _ = generate(
        model, prompt_ids, prompt_mask, NEW_TOKENS, [VOCAB + 1], 0, VOCAB, 0.0
    )
    assert bool(calls) == (cuda_decode and varlen_serves(model)), name
    assert truncated.all() and mask.all()  # the EOS id is never drawn: every row runs NEW_TOKENS
    reference = greedy_by_recomputation(model, prompt_ids, prompt_mask, NEW_TOKENS, VOCAB)
    assert torch.equal(ids, reference), name
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask)
    assert (sample_logp - plain).abs().max().item() <= TOLERANCE, name


@pytest.mark.parametrize("cuda_decode", [False, True], ids=["masked", "varlen"])
def test_sampled_logprobs_equal_scoring_and_the_plain_forward(family, cuda_decode, monkeypatch, request):
    # Two completions per prompt (one prefill per prompt, copied), and a broad set of stop ids so
    # that rows end at different steps and leave the batch (compact_below 0.5, checked every token
    # on the CPU): each layer's mask must follow its rows, window included; varlen: each row's
    # own columns too.
    name, model = family
    if cuda_decode and not varlen_serves(model):  # the masked step: the masked case ran it (CI's minutes)
        pytest.skip(f"{name} keeps the masked step")
    calls = decode_as(cuda_decode, request)
    prompt_ids, prompt_mask = family_prompts()
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0)  # (6, P)
    stop = list(range(3, 60))  # ~13% of the vocabulary: a row ends after ~8 tokens on average
    kept = []  # the rows each compaction kept
    keep_rows = grpo.KVCache.keep_rows
    monkeypatch.setattr(grpo.KVCache, "keep_rows", lambda cache, rows: (kept.append(len(rows)), keep_rows(cache, rows)))
    torch.manual_seed(3)
    ids, mask, truncated, sample_logp, _ = generate(model, prompt_ids, prompt_mask, NEW_TOKENS, stop, 0, VOCAB, 1.0)
    assert kept and mask.sum(-1).max() > WINDOW, f"{name}: rows must leave the batch, and one outlive the window"
    assert bool(calls) == (cuda_decode and varlen_serves(model)), name
    with torch.no_grad():
        scored, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, VOCAB, chunk_size=4)
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask)
    assert (sample_logp - scored).abs().max().item() <= TOLERANCE, name
    assert (sample_logp - plain).abs().max().item() <= TOLERANCE, name


@pytest.mark.parametrize("one_pass", [False, True], ids=["shared-prompt", "one-pass"])
@pytest.mark.parametrize("script", [grpo, ppo], ids=["grpo", "ppo"])  # two copies: ppo's also runs its critic
def test_cuda_columns_score_as_the_plain_forward(family, script, one_pass, monkeypatch):
    # forward_completions with its chunks' columns rounded as on CUDA (shape_multiple, 8 here): more
    # padding on both sides of every row. Three prompts of 30, 12 and 21 tokens, two rows each,
    # chunks of 4 rows (so one chunk holds two prompts of unequal length): the log-probs equal the
    # plain forward pass's, the prompt shared, and in one_pass: the pass over prompt + completion a
    # row (G = 1, gradient checkpointing).
    name, model = family
    monkeypatch.setattr(common, "shape_multiple", lambda device: 8)
    if one_pass:
        monkeypatch.setattr(common, "forward_completions", functools.partial(common.forward_completions, share=False))
    prompt_ids, prompt_mask = (t.repeat_interleave(2, 0) for t in family_prompts())  # (6, 30)
    generator = torch.Generator().manual_seed(1)
    completion_ids = torch.randint(3, VOCAB, (6, 10), generator=generator)
    completion_mask = (torch.arange(10)[None, :] < torch.tensor([10, 4, 7, 9, 2, 10])[:, None]).long()
    with torch.no_grad():
        scored, _ = script.sequence_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0, VOCAB, 4
        )
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert (scored - plain).abs().max().item() <= TOLERANCE, name


@pytest.mark.parametrize("late", [False, True], ids=["at-once", "late"])
@pytest.mark.parametrize("cuda_decode", [False, True], ids=["masked", "varlen"])
def test_tool_turns_keep_sampled_logprobs_equal_to_scoring(family, cuda_decode, late, request):
    # Multi-turn rollouts (tests/test_tool_rollouts.py): each ended turn gets a scripted answer of
    # forced tokens; the sampler conditioned on them, so the scorer must attend to them, window
    # included, and score the model's tokens alone. Late: answers land 1-7 steps after their call
    # (a slow tool); the row waits in place (a windowed family's decode waits for it instead).
    name, model = family
    if cuda_decode and not varlen_serves(model):  # the masked step: the masked case ran it (CI's minutes)
        pytest.skip(f"{name} keeps the masked step")
    decode_as(cuda_decode, request)
    delay = (lambda row, turn: 1 + (3 * row + 5 * turn) % 7) if late else None
    prompt_ids, prompt_mask, (ids, mask, _, sample_logp, tool_mask), _ = sample_with_tools(model, delay=delay)
    assert tool_mask.any(), name
    with torch.no_grad():
        scored, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, VOCAB, 4, tool_mask=tool_mask)
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask + tool_mask) * mask
    assert (sample_logp - scored).abs().max().item() <= TOLERANCE, name
    assert (sample_logp - plain).abs().max().item() <= TOLERANCE, name


def test_a_sampler_without_windows_fails_this_matrix(monkeypatch):
    # The bug this matrix exists for, planted: every layer attending over every earlier token.
    # On a family with sliding layers the sampler's log-probs then leave the model's by far more
    # than the tolerance (0.07-0.13 nats on average, python tests/families.py before the fix).
    model = family_model("gemma3")
    prompt_ids, prompt_mask = family_prompts()
    monkeypatch.setattr(common, "attention_windows", lambda model: {"full_attention": None})
    ids, mask, _, sample_logp, _ = generate(model, prompt_ids, prompt_mask, NEW_TOKENS, [VOCAB + 1], 0, VOCAB, 0.0)
    plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask)
    assert (sample_logp - plain).abs().max().item() > 100 * TOLERANCE


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Each family's tiny model saved with the tiny tokenizer (its 448 embedding rows fit it), as
    --model takes a local directory. family -> path."""
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    paths = {}
    for name in BUILDABLE:
        path = tmp_path_factory.mktemp(name)
        model = family_model(name, **ids)
        model.generation_config.update(**ids)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


STEP = dict(task="digit", batch_size=2, group_size=2, max_new_tokens=4, max_steps=1, save_every=0, sample_every=0)


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=["grpo", "dapo", "ppo"])
def test_one_step_of_each_script_and_its_checkpoint_reloads(family_dirs, script, tmp_path):
    # Every family through every script: generate, score, update, save; the saved model is the trained one.
    extra = dict(overlong_buffer=2) if script is dapo else {}
    for name, path in family_dirs.items():
        # A random model earns no reward: the entropy bonus gives the step a gradient all the same.
        settings = dict(model=str(path), output_dir=str(tmp_path / name), beta=0.01, lr=1e-3, entropy_coef=0.01)
        args = script.Args(**settings, **STEP, **extra)
        run_dir = script.train(args)
        trained, _, _ = load_model(str(run_dir / "final"), torch.device("cpu"))
        before, _, _ = load_model(str(path), torch.device("cpu"))
        assert type(trained) is type(before), name
        moved = [not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), before.state_dict().values())]
        assert any(moved), f"{name}: the checkpoint holds the weights before the step"
        prompt_ids, prompt_mask = family_prompts()
        with torch.no_grad():  # and it runs: the reloaded model scores as any model of its family
            logits = trained(input_ids=prompt_ids, attention_mask=prompt_mask).logits
        assert torch.isfinite(logits).all(), name


def test_lora_finds_the_layers_of_every_family(family_dirs):
    # --lora_targets all-linear puts adapters on every attention projection of every layer.
    for name, path in family_dirs.items():
        args = grpo.Args(model=str(path), lora_rank=4)
        policy, _, _ = load_policy(args, torch.device("cpu"), torch.float32)
        adapted = {module_name.removesuffix(".lora_A") for module_name, _ in policy.named_modules()}
        linear = {
            module_name
            for module_name, module in policy.named_modules()
            if type(module) is torch.nn.Linear
            and module_name.rsplit(".", 1)[-1] not in ("lm_head", "base_layer")
            and ".lora_" not in module_name
        }
        assert linear == set(), f"{name}: Linear layers without adapters: {sorted(linear)[:4]}"
        for layer in range(family_config(name).num_hidden_layers):  # the attention of every layer (Phi-3: qkv_proj)
            assert any(f"layers.{layer}.self_attn." in m for m in adapted), f"{name}: layer {layer}'s attention"
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        assert 0 < trainable < sum(p.numel() for p in policy.parameters()) / 2, name


def test_an_encoder_decoder_stops_before_any_step(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0
    )
    T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match=r"cannot be trained here: .*T5Config.*decoder-only causal language models"):
        load_model(str(tmp_path), torch.device("cpu"))
    with pytest.raises(SystemExit, match="cannot be trained here"):  # through a script, before the run directory
        grpo.train(grpo.Args(model=str(tmp_path), output_dir=str(tmp_path / "runs"), **STEP))
    assert not (tmp_path / "runs").exists()


def test_layers_that_are_not_a_window_stop_with_their_type():
    # Qwen3-Next's linear-attention layers keep a recurrent state, not keys and values in a window.
    model = family_model("qwen2", layer_types=["linear_attention", "full_attention"] * 2)
    with pytest.raises(SystemExit, match=r"qwen2 has layers of type linear_attention"):
        check_servable(model, "qwen3-next-like")
    with pytest.raises(ValueError, match=r"linear_attention"):
        attention_windows(model)


# ----------------------------------------------------------------------------------------
# The captured decode step: nothing in it may cross between host and device

# Ops a CUDA graph cannot hold: each reads a value back to the host (so the GPU must finish first)
# or copies host data to the device mid-step. On the CPU they run like any other op, so the test
# finds them by name in the ops of generate's one-token steps.
HOST_CROSSING = {
    "aten._local_scalar_dense": "a value read to the host: .item(), int(), bool(), .tolist()",
    "aten.nonzero": "a shape that depends on values",
    "aten.masked_select": "a shape that depends on values",
    "aten._unique2": "a shape that depends on values",
    "aten.unique_consecutive": "a shape that depends on values",
    "aten.unique_dim": "a shape that depends on values",
    "aten.lift_fresh": "torch.tensor(data) inside the step: host data copied to the device",
    "aten.equal": "torch.equal: a comparison read to the host",
    "transformers.grouped_mm_fallback": "transformers' loop over experts: offsets.tolist()",
}


def crosses_the_host(func, args) -> str | None:
    """Why op `func` on `args` would leave a CUDA graph, or None."""
    name = func._schema.name.replace("::", ".")
    if name in HOST_CROSSING:
        return HOST_CROSSING[name]
    if name == "aten._grouped_mm" and args[0].dtype != torch.bfloat16:  # torch's kernel is bf16 only (Hopper)
        return "torch's grouped GEMM off bf16: a loop over groups that first copies the offsets to the host"
    if name == "aten.repeat_interleave" and len(args) == 1:  # repeats without output_size: their sum read back
        return "repeat_interleave without output_size"
    if name == "aten.index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
        return "a boolean mask as an index: a shape that depends on values"
    return None


class DecodeStepOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops of generate's one-token steps (a forward of one token a row; the prefill is not in
    the graph), each with the reason it would leave a CUDA graph, and the kinds of the step's inputs."""

    def __init__(self, model):
        super().__init__()
        self.inside, self.crossing, self.inputs = False, [], set()
        self.hooks = [
            model.register_forward_pre_hook(self.enter, with_kwargs=True),
            model.register_forward_hook(lambda *unused: setattr(self, "inside", False), with_kwargs=True),
        ]

    def enter(self, module, args, kwargs):
        self.inside = kwargs["input_ids"].shape[1] == 1
        if self.inside:  # tensors, masks (one or one per layer type), the cache, flags: nothing made from host data
            for value in kwargs.values():
                values = value.values() if isinstance(value, dict) else [value]
                self.inputs |= {type(v).__name__ if not isinstance(v, torch.Tensor) else "Tensor" for v in values}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside and (reason := crosses_the_host(func, args)):
            self.crossing.append((func._schema.name, reason))
        return func(*args, **(kwargs or {}))

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def decode_ops(model, captured: bool, monkeypatch):
    """Greedy generate on the family prompts with every one-token step run as the captured step
    runs (captured_experts on: the CPU has no graphs, so the step is entered as a graph would hold
    it) or as the eager one; returns the ops that cross the host, the step's input kinds, and the
    output of generate."""
    if captured:
        real = common.grouped_attention

        @contextlib.contextmanager
        def as_captured(model):
            with real(model), common.captured_experts(model):
                yield

        monkeypatch.setattr(common, "grouped_attention", as_captured)
    prompt_ids, prompt_mask = family_prompts()
    recorder = DecodeStepOps(model)
    try:
        with recorder:
            out = generate(model, prompt_ids, prompt_mask, NEW_TOKENS, [VOCAB + 1], 0, VOCAB, 0.0)
    finally:
        recorder.remove()
    return recorder.crossing, recorder.inputs, out


def test_the_captured_step_crosses_no_host_boundary(family, monkeypatch):
    # The first H100 run: gpt-oss's capture failed ("Cannot copy between CPU and CUDA tensors during
    # CUDA graph capture"): its experts' grouped GEMM in fp32 copies the group ends to the host. As
    # captured, every family's step holds no op that leaves the graph, takes only tensors (and the
    # cache) made before it, and still samples the model itself: greedy tokens are the plain
    # forward's argmax, log-probs equal the plain forward's to TOLERANCE.
    name, model = family
    crossing, inputs, (ids, mask, _, logp, _) = decode_ops(model, True, monkeypatch)
    assert crossing == []
    assert inputs <= {"Tensor", "KVCache", "bool"}, inputs
    prompt_ids, prompt_mask = family_prompts()
    assert torch.equal(ids, greedy_by_recomputation(model, prompt_ids, prompt_mask, NEW_TOKENS, VOCAB))
    assert (logp - plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask)).abs().max() <= TOLERANCE


@pytest.mark.parametrize("name", ["gpt-oss", "qwen3-moe"])
def test_a_moe_step_left_as_it_is_would_leave_the_graph(name, monkeypatch):
    # The check above sees the bug it guards against: the eager step (the model's own experts) of
    # the MoE families runs the fp32 grouped GEMM, or transformers' loop, that a graph cannot hold.
    if unbuildable(name):
        pytest.skip(unbuildable(name))
    crossing, _, _ = decode_ops(family_model(name), False, monkeypatch)
    assert crossing and all("grouped" in op or "grouped" in reason for op, reason in crossing)
