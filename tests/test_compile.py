"""--compile (common.compile_blocks): each MLP and RMSNorm block through torch.compile. On the CPU
the blocks are traced with the "aot_eager" backend: dynamo and AOTAutograd as on a GPU, the same
aten ops run eagerly (no kernels generated: seconds, not the minute TorchInductor takes here). What
is tested is what nanoPO decides: which blocks, one compilation for all layers, the same numbers,
the scripts' models all compiled; TorchInductor's kernels are torch's (the CUDA tier runs them)."""

import copy

import pytest
import torch
import torch._dynamo
from transformers import Qwen2ForCausalLM

import common
import grpo
import ppo
from common import compile_blocks, load_model, read_jsonl
from conftest import sample_batch
from families import family_model, unbuildable


@pytest.fixture
def traced(monkeypatch):
    """compile_blocks with the aot_eager backend, dynamo's caches and counters fresh."""
    monkeypatch.setattr(common, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)  # not eager past it, silently
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def scored(model, batch, vocab_size):
    """log π of the batch's completions and the gradient of their sum (an update's pass)."""
    model.zero_grad(set_to_none=True)
    sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    logp, _ = grpo.sequence_logprobs(model, *sequences, 0.7, vocab_size, 4)
    logp.sum().backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach(), gradient


def test_compiled_blocks_give_the_same_numbers_and_compile_once_for_every_layer(traced):
    # A 12-layer model: its 12 MLPs and 25 RMSNorms run compiled code, and every layer shares the
    # compilations (a block kind's code holds one entry per grad mode and batch of one: 4). An MLP
    # that reads its layer's index (planted) compiles once a layer; so would whole decoder layers,
    # each guarded on its own KV cache. The update's pass (log π and gradient) equals eager's to
    # fp32 rounding, no graph breaks, and greedy decoding gives the same tokens.
    tiny, tokenizer, eos_ids = load_model("tiny", torch.device("cpu"))
    config = copy.deepcopy(tiny.config)
    config.num_hidden_layers, config.layer_types = 12, ["full_attention"] * 12
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).train()
    batch, vocab_size = sample_batch(tiny, tokenizer, eos_ids), len(tokenizer)
    eager = scored(model, batch, vocab_size)
    with torch.no_grad():
        eager_tokens = grpo.generate(model, batch["prompt_ids"], batch["prompt_mask"], 6, eos_ids, 0, vocab_size, 0.0)
    assert compile_blocks(model) is model
    compiled = [name for name, module in model.named_modules() if "forward" in module.__dict__]
    assert len(compiled) == 12 + 25 and all(name.endswith(("mlp", "norm", "layernorm")) for name in compiled)
    mine = scored(model, batch, vocab_size)
    assert (mine[0] - eager[0]).abs().max() <= 1e-6
    assert (mine[1] - eager[1]).abs().max() <= 1e-6 * eager[1].abs().max()
    with torch.no_grad():
        tokens = grpo.generate(model, batch["prompt_ids"], batch["prompt_mask"], 6, eos_ids, 0, vocab_size, 0.0)
    assert torch.equal(tokens[0], eager_tokens[0])
    assert not traced["graph_break"], dict(traced["graph_break"])
    for block in (model.model.layers[0].mlp, model.model.norm):  # 4 each: grad or not, a batch of one or not
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(type(block).forward.__code__)
        assert 1 <= len(entries) <= 6, len(entries)  # a few variants, not one a layer (12)


def test_a_mixture_of_experts_block_stays_eager(traced):
    # gpt-oss's GptOssMLP is its router and experts: routing picks rows by value, so the block stays
    # eager; its RMSNorms compile. A dense model's MLP (Llama's) compiles.
    for family, moe in (("gpt-oss", "GptOssMLP"), ("llama3", None)):
        if unbuildable(family) is not None:
            continue
        model = compile_blocks(family_model(family))
        blocks = {type(m).__name__: "forward" in m.__dict__ for m in model.modules()}
        assert any(compiled for name, compiled in blocks.items() if name.endswith("RMSNorm"))
        if moe:
            assert blocks[moe] is False
        else:
            assert blocks["LlamaMLP"] is True


def test_a_copy_of_a_compiled_model_computes_with_its_own_weights(traced):
    # Each block's forward is its class's compiled forward bound to the block by a partial, which
    # deepcopy binds to the copy (a compiled bound method, copied by reference, ran the original's
    # weights: zeroing them zeroed the copy's MLP output).
    model = compile_blocks(family_model("qwen2"))
    twin = copy.deepcopy(model)
    x = torch.randn(1, 3, model.config.hidden_size)
    expected = twin.model.layers[0].mlp(x)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.zero_()
    assert torch.equal(twin.model.layers[0].mlp(x), expected) and expected.abs().max() > 0


@pytest.mark.parametrize("script", [grpo, ppo], ids=lambda s: s.__name__)
def test_two_steps_with_compile_equal_two_without(traced, script, tmp_path, monkeypatch):
    # --compile true: the policy's, the reference's and (ppo) the critic's blocks compiled, and the
    # steps' metrics those of the run without it, to fp32 rounding. Every variant a run calls a
    # block with (trained and frozen weights, grad or none, grpo's gradient checkpointing, a size of
    # 1) runs compiled: dynamo's recompilation limit is raised for them (at its default of 8,
    # planted, a real run's ninth variant fails here where it would run eager).
    settings = dict(model="tiny", task="digit", max_steps=2, batch_size=2, group_size=4, max_new_tokens=8)
    settings |= dict(save_every=0, lr=3e-3, beta=0.04, gradient_checkpointing=script is grpo)
    rows, compiled = {}, []

    def spy(model, on=True):
        compiled.extend([type(model).__name__] if on else [])
        return compile_blocks(model, on)

    monkeypatch.setattr(common, "compile_blocks", spy)
    monkeypatch.setattr(ppo, "compile_blocks", spy)
    for on in (False, True):
        run_dir = script.train(script.Args(**settings, compile=on, output_dir=str(tmp_path / str(on))))
        rows[on] = read_jsonl(run_dir / "metrics.jsonl")[-1]
    policy_and_reference = ["Qwen2ForCausalLM"] * 2
    assert sorted(compiled) == policy_and_reference + (["Qwen2Model"] if script is ppo else [])  # ppo: the critic's
    assert traced["stats"]["unique_graphs"] >= 2
    for key, value in rows[False].items():
        if isinstance(value, float) and not key.startswith(("time/", "throughput/")):  # not the clock
            assert rows[True][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_bench_times_the_step_after_one_that_compiles(traced, tmp_path, monkeypatch):
    # bench.py --compile true: an unmeasured step first (it compiles; dynamo keeps what it compiled
    # past that step's model), then the measured one, whose phases all ran compiled blocks: the
    # measured step compiles nothing new, and its row is the second step's, not the sum of both.
    import bench

    steps, graphs = [], []
    one_step = bench.one_step

    def counted(*args):
        steps.append(1)
        row = one_step(*args)
        graphs.append(traced["stats"]["unique_graphs"])
        return row

    monkeypatch.setattr(bench, "one_step", counted)
    settings = dict(model="tiny", batch_sizes="", logprob_rows=0, train_steps="grpo", max_new_tokens=4)
    settings |= dict(group_size=2, train_batch_size=1, compile=True, output=str(tmp_path / "bench.json"))
    (row,) = bench.main(bench.Args(**settings))["training_step"]
    assert len(steps) == 2 and graphs[0] >= 2 and graphs[1] == graphs[0], graphs
    assert row["script"] == "grpo" and row["TFLOP/s update"] > 0
