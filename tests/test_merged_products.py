"""The decode step's merged products (common.MergedProducts, issue 58's lever 1): q, k and v as one
product, gate and up as one, built once a generate call from the weights of that call. The scripts
merge on a GPU only (common.merges); here every test but the one of merges itself merges on the CPU
(the fixture as_on_a_gpu). Each output column is the same dot product as the separate Linear's, so on
the CPU generate's tokens and log-probs are the unmerged step's bit for bit, and every family of the
matrix decodes as its plain forward pass."""

import pytest
import torch
from test_compile import traced  # noqa: F401  the aot_eager fixture
from test_families import TOLERANCE

import common
from common import MergedProducts, compile_blocks, load_model
from conftest import greedy_by_recomputation
from families import (
    FAMILIES,
    VOCAB,
    family_model,
    family_prompts,
    plain_forward_logprobs,
    sample_with_tools,
    unbuildable,
)
from grpo import encode_prompts, generate, sequence_logprobs

PROMPTS = [[{"role": "user", "content": "Reply with a digit."}], [{"role": "user", "content": "Hi"}]]
MERGES = common.merges  # the scripts' choice, before the fixture replaces it


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch):
    """The decode step merges its products on the CPU too, as it does on a GPU."""
    monkeypatch.setattr(common, "merges", lambda device: True)


def test_the_decode_step_merges_on_a_gpu_alone():
    # On a GPU each product of a decode step is a launch; the CPU pays no launch, and there the merged
    # step decoded 2-9% slower (docs/speed.md). Under torchrun each rank would hold the joined weights.
    assert MERGES(torch.device("cuda")) and not MERGES(torch.device("cpu"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.distributed, "is_initialized", lambda: True)
        assert not MERGES(torch.device("cuda"))
    assert MergedProducts(Attention(), on=False).groups == []


class Attention(torch.nn.Module):
    """A block's three products of one input, by hand: q (2 -> 2), k and v (2 -> 1)."""

    def __init__(self, bias: tuple = (True, True, True)):
        super().__init__()
        self.q_proj = torch.nn.Linear(2, 2, bias=bias[0])
        self.k_proj = torch.nn.Linear(2, 1, bias=bias[1])
        self.v_proj = torch.nn.Linear(2, 1, bias=bias[2])
        with torch.no_grad():
            self.q_proj.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
            self.k_proj.weight.copy_(torch.tensor([[1.0, 1.0]]))
            self.v_proj.weight.copy_(torch.tensor([[2.0, -1.0]]))
            for linear, value in zip((self.q_proj, self.k_proj, self.v_proj), ([0.5, 0.0], [1.0], [0.0])):
                if linear.bias is not None:
                    linear.bias.copy_(torch.tensor(value))


def test_one_product_gives_each_linear_its_columns_and_an_input_of_its_own_its_own_product(monkeypatch):
    # x = (1, 2): q = (1·1 + 0.5, 2) = (1.5, 2), k = 1 + 2 + 1 = 4, v = 2 - 2 = 0, from one product;
    # y = (0, 1) given to k and v alone (not q's input): k = 0 + 1 + 1 = 2, v = -1, each its own.
    block = Attention()
    merged = MergedProducts(block)
    assert [group["sizes"] for _, group in merged.groups] == [[2, 1, 1]] and merged.groups[0][1]["weight"].shape == (
        4,
        2,
    )
    products = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: (products.append(a[1].shape), linear(*a))[1])
    x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 1.0]])
    with torch.no_grad(), merged.within():
        assert block.k_proj(x).tolist() == [[4.0]] and products == [(1, 2)]  # before q's call: k's own
        products.clear()
        q, k, v = block.q_proj(x), block.k_proj(x), block.v_proj(x)
        assert products == [(4, 2)]  # one product for the three
        assert q.tolist() == [[1.5, 2.0]] and k.tolist() == [[4.0]] and v.tolist() == [[0.0]]
        assert block.k_proj(y).tolist() == [[2.0]] and block.v_proj(y).tolist() == [[-1.0]]
        assert products == [(4, 2), (1, 2), (1, 2)]  # k's and v's rows alone
    assert all(type(linear) is torch.nn.Linear and not hasattr(linear, "merged") for linear in block.children())
    assert block.k_proj(x).tolist() == [[4.0]]  # the Linear's own forward again


@pytest.mark.parametrize("bias", [True, False])
def test_under_autocast_the_merged_weight_is_the_cast_one_and_the_products_are_the_separate_ones(bias):
    # CPU bf16 autocast casts each fp32 weight (and bias) to bf16 at every product; the merged ones are
    # cast once, when they are joined, and give the products autocast gives, bit for bit: the group's
    # own, and those of k and v given an input of their own (y).
    torch.manual_seed(0)
    block = Attention(bias=(bias,) * 3)
    for linear in (block.q_proj, block.k_proj, block.v_proj):
        torch.nn.init.normal_(linear.weight)
    x, y = torch.randn(5, 1, 2), torch.randn(5, 1, 2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        separate = [block.q_proj(x), block.k_proj(x), block.v_proj(x), block.k_proj(y), block.v_proj(y)]
        merged = MergedProducts(block)
        group = merged.groups[0][1]
        assert group["weight"].dtype == torch.bfloat16 and (
            group["bias"] is None or group["bias"].dtype == torch.bfloat16
        )
        assert (group["bias"] is None) is not bias
        with merged.within():
            ours = [block.q_proj(x), block.k_proj(x), block.v_proj(x), block.k_proj(y), block.v_proj(y)]
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(ours, separate))


@pytest.mark.parametrize(
    "change",
    [
        "bias on two of three",
        "a bf16 weight",
        "another input width",
        "another device",
        "a replaced forward",
        "a subclass of Parameter",
        "none",
    ],
)
def test_only_plain_linears_of_one_input_width_dtype_and_bias_merge(change):
    # At the boundary of each condition: every Linear with a bias or none; one dtype, input width and
    # device; the Linear's own forward (not a hook library's); a plain Parameter (an FSDP2 shard or a
    # quantised weight is a subclass).
    block = Attention(bias=(True, True, False) if change == "bias on two of three" else (True, True, True))
    if change == "a bf16 weight":
        block.v_proj.to(torch.bfloat16)
    if change == "another input width":
        block.v_proj = torch.nn.Linear(3, 1)
    if change == "another device":
        block.v_proj.to("meta")
    if change == "a replaced forward":
        block.k_proj.forward = block.k_proj.forward
    if change == "a subclass of Parameter":

        class Shard(torch.nn.Parameter):
            pass

        block.q_proj.weight = Shard(block.q_proj.weight.detach())
    assert len(MergedProducts(block).groups) == (change == "none")


def test_a_linear_shared_by_two_blocks_merges_once_and_a_failed_step_puts_every_linear_back(monkeypatch):
    # A Linear in two groups (here one k shared by the first and the last of three blocks) joins the
    # first only; whatever stops a step (an error, an interrupt), every Linear leaves as a plain Linear
    # with its own product.
    first, middle, last = Attention(), Attention(), Attention()
    last.k_proj = first.k_proj
    model = torch.nn.Sequential(first, middle, last)
    merged = MergedProducts(model)
    assert [linears for linears, _ in merged.groups] == [list(first.children()), list(middle.children())]
    with pytest.raises(RuntimeError, match="stopped"), merged.within():
        assert type(first.k_proj) is common.MergedLinear
        raise RuntimeError("stopped")
    assert all(type(linear) is torch.nn.Linear and "merged" not in linear.__dict__ for linear in model.modules()
               if isinstance(linear, torch.nn.Linear))  # fmt: skip
    assert first.k_proj(torch.tensor([[1.0, 2.0]])).tolist() == [[4.0]]


def test_under_autocast_the_prefill_s_cached_casts_are_let_go(monkeypatch):
    # Autocast keeps a bf16 copy of every fp32 weight the prefill cast till its block ends; the joined
    # weights would be a second copy of q, k, v, gate and up. The step lets the cache go before it joins
    # them (the first decode step casts o and down again, once); autocast's own exit clears it last.
    events = []
    clear, joined = torch.clear_autocast_cache, common.joined_weights
    monkeypatch.setattr(torch, "clear_autocast_cache", lambda: (events.append("clear"), clear())[1])
    monkeypatch.setattr(common, "joined_weights", lambda linears: (events.append("join"), joined(linears))[1])
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sampled(model, tokenizer)
    layers = 2 * model.config.num_hidden_layers
    assert events == ["clear"] + ["join"] * layers + ["clear"], events


def test_the_families_merge_every_dense_block():
    # Each layer's attention merges q, k and v, and a dense MLP gate and up; Phi-3's are one product
    # already (qkv_proj, gate_up_proj), and a mixture of experts' experts are not Linears.
    expected = {name: 8 for name in FAMILIES} | {"phi3": 0, "qwen3-moe": 4, "gpt-oss": 4}  # 4 layers
    for name in (name for name in FAMILIES if unbuildable(name) is None):
        groups = MergedProducts(family_model(name)).groups
        assert len(groups) == expected[name], name
        assert {len(linears) for linears, _ in groups} == ({3} if expected[name] == 4 else {2, 3} if groups else set())


@pytest.mark.parametrize("cuda_decode", [False, True], ids=["masked", "varlen"])
@pytest.mark.parametrize("name", [name for name in FAMILIES if unbuildable(name) is None])
def test_every_family_decodes_merged_as_its_plain_forward(name, cuda_decode, request):
    # tests/test_families.py's check, on the merged step (the scripts merge on a GPU alone): greedy
    # tokens the plain forward pass's argmax, log-probs within 1e-5 of its own, past every window;
    # varlen: as a GPU decodes in bf16 (conftest's varlen), where the family's attention allows it.
    model = family_model(name)
    calls = request.getfixturevalue("varlen") if cuda_decode else []
    prompt_ids, prompt_mask = family_prompts()
    ids, mask, _, sample_logp, _ = generate(model, prompt_ids, prompt_mask, 14, [VOCAB + 1], 0, VOCAB, 0.0)
    full_sdpa = (
        common.attention_windows(model) == {"full_attention": None} and model.config._attn_implementation == "sdpa"
    )
    assert bool(calls) == (cuda_decode and full_sdpa), name
    assert torch.equal(ids, greedy_by_recomputation(model, prompt_ids, prompt_mask, 14, VOCAB)), name
    assert (sample_logp - plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask)).abs().max() <= TOLERANCE


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_tool_turns_late_answers_and_compaction_decode_merged_as_the_scorer_scores(name):
    # Rows held for their tools' late answers, forced tokens, the cache grown and rows leaving the batch:
    # the merged step's log-probs are the scorer's (1e-5), a full-attention family and a windowed one.
    model = family_model(name)
    delay = lambda row, turn: 1 + (3 * row + 5 * turn) % 7  # noqa: E731
    prompt_ids, prompt_mask, (ids, mask, _, sample_logp, tool_mask), _ = sample_with_tools(model, delay=delay)
    assert tool_mask.any()
    with torch.no_grad():
        scored, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, 1.0, VOCAB, 4, tool_mask=tool_mask)
    assert (sample_logp - scored).abs().max().item() <= TOLERANCE, name


def test_a_lora_layer_keeps_its_own_product():
    # An adapter adds its product to the base's: joined weights would leave it out. With adapters on q
    # and v, each layer merges only its MLP's gate and up.
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(family_model("qwen2"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    groups = MergedProducts(model).groups
    assert len(groups) == 4 and all(len(linears) == 2 for linears, _ in groups)


def sampled(model, tokenizer, seed: int = 0):
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS, 3, "cpu")
    torch.manual_seed(seed)
    return generate(
        model, prompt_ids, prompt_mask, 24, [tokenizer.eos_token_id], tokenizer.pad_token_id, len(tokenizer)
    )


def test_generate_draws_the_unmerged_step_s_tokens_and_log_probs_bit_for_bit(monkeypatch):
    # The tiny model sampled at τ = 1, 24 tokens, rows of unequal prompts: every output equal to the
    # step without merged products (MERGED empty: no group), and a weight change between two calls is
    # in the second (the weights are joined again: one joined once a model, planted, would be stale).
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    merged = sampled(model, tokenizer)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("k_proj.weight", "up_proj.weight")):
                parameter.mul_(1.5)
    merged_after = sampled(model, tokenizer)
    monkeypatch.setattr(common, "MERGED", ())
    after = sampled(model, tokenizer)
    assert not all(torch.equal(a, b) for a, b in zip(merged, merged_after))  # the change matters
    assert all(torch.equal(a, b) for a, b in zip(merged_after, after))


def test_a_merge_that_gives_k_v_s_columns_fails_the_family_matrix(monkeypatch):
    # The check the family matrix makes (the sampler's log-probs against the plain forward pass's, to
    # 1e-5) catches a wrong split: k handed v's columns, planted. (Greedy tokens alone do not: a random
    # tiny model's attention is near uniform whatever its keys.)
    merged_product = common.merged_product

    def planted(group, index, hidden):
        return merged_product(group, 2 if index == 1 and len(group["sizes"]) == 3 else index, hidden)

    model = family_model("llama3")
    prompt_ids, prompt_mask = family_prompts()
    for wrong in (False, True):
        if wrong:
            monkeypatch.setattr(common, "merged_product", planted)
        ids, mask, _, sample_logp, _ = generate(model, prompt_ids, prompt_mask, 6, [VOCAB + 1], 0, VOCAB, 0.0)
        gap = (sample_logp - plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask)).abs().max().item()
        assert (gap > TOLERANCE) is wrong, gap


def test_the_compiled_decode_compiles_the_merged_step_once_for_every_call(traced):  # noqa: F811
    # --compile: the joined weights are new tensors at every call; the compiled step takes them as
    # inputs, not constants (a guard on their identity would compile each call again, planted: with a
    # different dtype the second call compiles again), so a second call compiles nothing more, breaks no
    # graph, and draws the first's tokens, which are eager's.
    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    eager = sampled(model, tokenizer)
    compile_blocks(model)
    first = sampled(model, tokenizer)
    graphs = traced["stats"]["unique_graphs"]
    second = sampled(model, tokenizer)
    assert traced["stats"]["unique_graphs"] == graphs > 0 and not traced["graph_break"], dict(traced["graph_break"])
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert torch.equal(first[0], eager[0]) and (first[3] - eager[3]).abs().max() <= 1e-6
