"""generate's one-token step attends with grouped_decode_attention: the query heads that share a
KV head are folded into the rows of one query, so no repeat of K and V is materialised. It must
give what attention head by head gives."""

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import common
import dapo
import grpo
import ppo

SCRIPTS = [grpo, dapo, ppo]
MASKED = -1e30  # generate's bias of a column not attended to


def test_two_query_heads_on_one_kv_head_by_hand():
    # One row, 2 query heads sharing 1 KV head, head dim 1, 2 cached columns, scale 1:
    #   q = (1, 2), keys (1, 0), values (2, 4).
    #   head 0: scores (1, 0) -> softmax (e/(e+1), 1/(e+1)) -> 2·e/(e+1) + 4/(e+1) = 2 + 2/(e+1)
    #   head 1: scores (2, 0) -> softmax (e²/(e²+1), 1/(e²+1))           -> 2 + 2/(e²+1)
    # With column 1 masked both heads read value 2 alone.
    query = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)
    key = torch.tensor([1.0, 0.0]).view(1, 1, 2, 1)
    value = torch.tensor([2.0, 4.0]).view(1, 1, 2, 1)
    open_mask = torch.zeros(1, 1, 1, 2)
    out, weights = common.grouped_decode_attention(None, query, key, value, open_mask, scaling=1.0)
    expected = torch.tensor([2 + 2 / (math.e + 1), 2 + 2 / (math.e**2 + 1)]).view(1, 1, 2, 1)
    assert weights is None
    assert out.shape == (1, 1, 2, 1)  # (n, q, heads, d): transformers' layout after attention
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    masked = torch.tensor([0.0, MASKED]).view(1, 1, 1, 2)
    out, _ = common.grouped_decode_attention(None, query, key, value, masked, scaling=1.0)
    torch.testing.assert_close(out, torch.full((1, 1, 2, 1), 2.0), rtol=0, atol=1e-6)


class Layer(torch.nn.Module):
    num_key_value_groups = 7  # what transformers' sdpa reads to repeat K and V
    is_causal = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_transformers_sdpa_with_repeated_kv(dtype):
    # The 0.5B shape's heads: 14 query heads on 2 KV heads, head dim 64; 3 rows with their own
    # padding hidden by the mask, 37 columns.
    torch.manual_seed(0)
    query = torch.randn(3, 14, 1, 64, dtype=dtype)
    key, value = torch.randn(3, 2, 37, 64, dtype=dtype), torch.randn(3, 2, 37, 64, dtype=dtype)
    mask = torch.zeros(3, 1, 1, 37, dtype=dtype)
    mask[0, ..., :5] = MASKED
    mask[2, ..., 20:] = MASKED
    scaling = 64**-0.5
    expected, _ = sdpa_attention_forward(Layer(), query, key, value, mask, scaling=scaling)
    out, _ = common.grouped_decode_attention(Layer(), query, key, value, mask, scaling=scaling)
    assert out.shape == expected.shape == (3, 1, 14, 64)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=0, atol=tolerance)
    # and head by head, with head h reading KV head h // 7
    weights = torch.softmax(
        (query.float() @ key.float().repeat_interleave(7, 1).transpose(-1, -2)) * scaling + mask.float(), -1
    )
    by_hand = (weights @ value.float().repeat_interleave(7, 1)).transpose(1, 2)
    torch.testing.assert_close(out.float(), by_hand, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


def gqa_model():
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=192,
        vocab_size=300,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_generate_runs_every_decode_step_through_it_and_matches_model_generate(script, monkeypatch):
    model = gqa_model()
    calls, attend = [], common.grouped_decode_attention

    def counted(*args, **kwargs):
        calls.append(args[1].shape)  # the query
        return attend(*args, **kwargs)

    monkeypatch.setattr(common, "grouped_decode_attention", counted)
    ids = torch.randint(3, 300, (5, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    out = script.generate(model, ids, mask, 10, [], 0, 300, temperature=0.0)
    # 9 one-token steps (the first token comes from the prefill), each through 2 layers
    assert len(calls) == 9 * 2 and all(shape == (5, 6, 1, 16) for shape in calls)
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0], reference[:, 9:])
    assert model.config._attn_implementation == "sdpa"  # restored: training runs the model's own attention


def test_the_models_attention_is_restored_after_an_error():
    model = gqa_model()
    with pytest.raises(RuntimeError, match="inside"):
        with common.grouped_attention(model):
            assert model.config._attn_implementation == "nanopo_grouped_decode"
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
