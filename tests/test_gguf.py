"""--model takes a GGUF file (or a directory holding one), read by transformers' GGUF loader,
and base models without a chat template get plain-text prompts (--prompt_format). The GGUF
file is written here from tiny-llama's weights with the gguf package's writer, laid out as
llama.cpp's converter lays out a Llama model: F32 tensors, q and k rows permuted for its rotary
layout, a byte-level BPE ("gpt2") vocabulary with its merges."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import dapo
import grpo
import ppo
from common import load_model, render_chat, resolve_model_name

gguf = pytest.importorskip("gguf")

SCRIPTS = [grpo, dapo, ppo]


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp stores q/k in (transformers' loader undoes it)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model_dir: Path, path: Path) -> Path:
    """tiny-llama (model_dir) as one F32 GGUF file at path."""
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    template = (model_dir / "chat_template.jinja").read_text()
    weights = load_file(model_dir / "model.safetensors")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(
        config["rope_theta"] if "rope_theta" in config else config["rope_parameters"]["rope_theta"]
    )
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    special = {token["content"] for token in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])  # 3: control, 1: normal
    writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(tokenizer["model"]["vocab"]["<|finetune_right_pad_id|>"])  # as llama.cpp's converter
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v"}
    names |= {"self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up"}
    names |= {"mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    for layer in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in names.items():
            weight = weights[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                weight = llama_cpp_permute(weight, heads if gguf_name == "attn_q" else kv_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("gguf")
    return write_gguf(Path(resolve_model_name("tiny-llama")), directory / "tiny-llama.F32.gguf")


def test_a_gguf_file_loads_as_the_model_it_was_written_from(gguf_file):
    original, original_tokenizer, _ = load_model("tiny-llama", torch.device("cpu"))
    for name in (str(gguf_file), str(gguf_file.parent)):  # the file, or the directory holding it
        model, tokenizer, eos_ids = load_model(name, torch.device("cpu"))
        assert model.config.model_type == "llama"
        assert tokenizer.chat_template == original_tokenizer.chat_template
        assert tokenizer.convert_ids_to_tokens(eos_ids) == ["<|eot_id|>"]
        ids = torch.tensor([[5, 60, 200, 17, 300, 42]])
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-5, rtol=1e-5)
        text = "<think> 12 + 7 </think> <answer> 19 </answer>"
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_a_directory_with_two_gguf_files_asks_which(gguf_file, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(gguf_file.read_bytes())
    with pytest.raises(SystemExit, match="holds 2 GGUF files"):
        resolve_model_name(str(tmp_path))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match="not a .gguf file"):
        resolve_model_name(str(tmp_path / "notes.txt"))


def test_gguf_missing_says_how_to_install_it(gguf_file, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(SystemExit, match="pip install gguf"):
        load_model(str(gguf_file), torch.device("cpu"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_every_script_trains_from_a_gguf_file_and_saves_safetensors(script, gguf_file, tmp_path):
    settings = dict(model=str(gguf_file), task="countdown", max_new_tokens=8, batch_size=2, group_size=2)
    settings |= dict(max_steps=2, output_dir=str(tmp_path), shots=1, countdown_numbers="2")
    if script is dapo:
        settings |= dict(dynamic_sampling=False, overlong_buffer=2)
    run_dir = script.train(script.Args(**settings))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["policy/sample_logp_diff"] < 1e-5 for r in rows)
    final = run_dir / "final"
    assert (final / "model.safetensors").exists() and not list(final.glob("*.gguf"))
    loaded, _, _ = load_model(str(final), torch.device("cpu"))
    assert loaded.config.model_type == "llama"
    assert getattr(loaded.config, "quantization_config", None) is None


def test_a_model_without_a_chat_template_gets_plain_prompts():
    _, tokenizer, _ = load_model("tiny-base", torch.device("cpu"))
    assert tokenizer.chat_template is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    assert render_chat(tokenizer, messages) == "Be brief.\n\nQuestion: 2 + 2?\nAnswer:"
    few_shot = [messages[0], {"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    assert render_chat(tokenizer, [*few_shot, messages[1]]) == (
        "Be brief.\n\nQuestion: 1 + 1?\nAnswer: 2\n\nQuestion: 2 + 2?\nAnswer:"
    )
    with pytest.raises(SystemExit, match="no chat template"):
        load_model("tiny-base", torch.device("cpu"), prompt_format="chat")
    _, chat_tokenizer, _ = load_model("tiny", torch.device("cpu"), prompt_format="plain")
    assert render_chat(chat_tokenizer, messages) == "Be brief.\n\nQuestion: 2 + 2?\nAnswer:"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_every_script_trains_a_base_model_on_plain_prompts(script, tmp_path):
    settings = dict(model="tiny-base", task="countdown", max_new_tokens=8, batch_size=2, group_size=2)
    settings |= dict(max_steps=1, output_dir=str(tmp_path), sample_every=1, shots=1, countdown_numbers="2-3")
    if script is dapo:
        settings |= dict(dynamic_sampling=False, overlong_buffer=2)
    run_dir = script.train(script.Args(**settings))
    sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("You are a careful assistant.")
    assert "\nAnswer: <think>" in sample["prompt"] and sample["prompt"].endswith("Answer:")
