"""bench.py runs end to end on the tiny model with tiny settings and writes its tables."""

import contextlib
import json
import subprocess
import sys

import pytest
import torch

import common
from conftest import ROOT, flash_varlen_by_the_book


def test_bench_smoke(tmp_path):
    output = tmp_path / "bench.json"
    command = [sys.executable, "bench.py", "--model", "tiny", "--batch_sizes", "1,4", "--max_new_tokens", "4"]
    command += ["--repeats", "1", "--group_size", "2", "--train_batch_size", "1"]
    command += ["--contenders", "nanopo,hf,tools,masked,separate", "--output", str(output)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(output.read_text())
    assert all(row["tools tok/s"] > 0 and row["nanopo/tools"] > 0 for row in report["generation"])
    assert all(row["masked tok/s"] > 0 and row["nanopo/masked"] > 0 for row in report["generation"])
    assert all(row["separate tok/s"] > 0 and row["nanopo/separate"] > 0 for row in report["generation"])
    assert [(row["N"], row["mode"]) for row in report["generation"]] == [
        (1, "greedy"),
        (1, "sampled"),
        (4, "greedy"),
        (4, "sampled"),
    ]
    assert all(row["nanopo tok/s"] > 0 and row["hf tok/s"] > 0 for row in report["generation"])
    assert [row["script"] for row in report["training_step"]] == ["grpo", "dapo", "ppo"]
    assert all(row["time/generate"] > 0 and row["time/update"] > 0 for row in report["training_step"])
    assert "| N | P | mode |" in done.stdout


def test_qwen_sized_tokenizer():
    # The shapes' tokenizer has Qwen2.5's 151,665 ids (151,662 byte-level BPE pieces + 3 ChatML
    # special tokens), renders the chat template and decodes what it encodes.
    from bench import QWEN_TOKENIZER_SIZE, qwen_sized_tokenizer

    tokenizer = qwen_sized_tokenizer()
    assert len(tokenizer) == QWEN_TOKENIZER_SIZE == 151665
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 151664 and tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Using [3, 5], make 8."}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text and max(ids) < QWEN_TOKENIZER_SIZE


def test_bench_at_the_real_vocabulary(tmp_path):
    # The 0.5B shape cut to one layer: generation and a GRPO step sample and score over all
    # 151,665 ids of the shapes' tokenizer (the embedding has 151,936 rows).
    output = tmp_path / "bench.json"
    command = [sys.executable, "bench.py", "--model", "qwen2.5-0.5b-shape", "--num_layers", "1", "--batch_sizes", "2"]
    command += ["--max_new_tokens", "3", "--repeats", "1", "--group_size", "2", "--train_batch_size", "1"]
    command += ["--modes", "sampled", "--contenders", "nanopo,hf", "--train_steps", "grpo"]
    command += ["--output", str(output)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(output.read_text())
    assert report["generation"][0]["nanopo tok/s"] > 0
    assert report["training_step"][0]["time/update"] > 0


def test_steps_4_and_6_time_the_shared_unshared_and_packed_versions(tmp_path):
    # 8 rows, groups of 4, one worked example in each prompt: each version's phases timed, the
    # ratios against the shared version (the same computation, so the versions run the same work).
    output = tmp_path / "bench.json"
    command = [sys.executable, "bench.py", "--model", "tiny", "--batch_sizes", "", "--max_new_tokens", "6"]
    command += ["--repeats", "1", "--group_size", "4", "--train_steps", ""]
    command += ["--step_rows", "8", "--shots", "1", "--countdown_numbers", "2", "--output", str(output)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    [row] = json.loads(output.read_text())["steps_4_and_6"]
    assert (row["N"], row["G"]) == (8, 4) and row["mean prompt"] > 100  # the worked example's tokens
    for version in ("shared", "unshared", "packed"):
        assert row[f"{version} step 4 s"] > 0 and row[f"{version} step 6 s"] > 0
        assert row[f"{version} 4+6 s"] == row[f"{version} step 4 s"] + row[f"{version} step 6 s"]
        if version != "shared":
            assert row[f"{version}/shared"] == row[f"{version} 4+6 s"] / row["shared 4+6 s"]


def test_the_shapes_model_is_written_once_and_read_back(tmp_path, monkeypatch):
    # The shape's random model (here the 0.5B shape cut to one layer) is built once, written to
    # --model_dir in bf16 with its tokenizer, and every later run loads it: nothing is built again.
    import bench

    args = bench.Args(model="qwen2.5-0.5b-shape", num_layers=1, model_dir=str(tmp_path / "shape"))
    directory = bench.shape_directory(args, "cpu")
    assert (directory / "config.json").exists() and (directory / "tokenizer.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shape"]  # written beside it, renamed into place

    def built_again(*unused, **unused_named):
        raise AssertionError("the model was built again")

    monkeypatch.setattr(bench, "Qwen2ForCausalLM", built_again)
    assert bench.shape_directory(args, "cpu") == directory
    model, tokenizer, vocab_size, loaded = bench.load_bench_model(args, torch.device("cpu"), torch.float32)
    assert loaded == str(directory) and vocab_size == bench.QWEN_TOKENIZER_SIZE
    assert model.config.num_hidden_layers == 1 and next(model.parameters()).dtype == torch.float32


def test_the_removed_flags_stop_with_their_line():
    # The A/B flags of the scripts' paths since removed (docs/speed.md, "Tried and removed") stop
    # with their one line (common.REMOVED_SETTINGS), as the scripts' do.
    import bench

    for flag in ("--aligned_prompts", "--sdpa_backend", "--lm_head_precision"):
        assert not hasattr(bench.Args(), flag[2:])
        with pytest.raises(SystemExit, match=f"{flag} was removed: "):
            common.parse_args(bench.Args, [flag, "fp32"])


def test_the_sampler_parts():
    # bench.py --sampler_rows times each op of generate's sampler alone, then the whole sampler
    # (grpo.sample, the exponential race) and --compile's.
    from bench import bench_sampler

    rows = bench_sampler(2, 50, torch.device("cpu"), calls=2)
    assert [row["part"] for row in rows][-2:] == [
        "the whole sampler, as generate (sample)",
        "--compile's (compiled_for: sample through TorchInductor)",
    ]
    assert all(row["ms a call"] > 0 and (row["N"], row["V"]) == (2, 50) for row in rows)


def test_the_decode_attention_variants_compute_generate_attention():
    # bench.py --attention_rows times the one-token step's attention per variant and width. Every
    # variant that runs must compute the attention generate's step computes (against float64,
    # fp32 on the CPU: 1e-5), at each of decode_widths' widths: 4 query heads on 2 KV heads, so
    # grouped_decode_attention's fold of heads is tested.
    from transformers import Qwen2Config

    from bench import bench_attention

    config = Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    rows = bench_attention(config, 3, 5, 130, torch.device("cpu"), contextlib.nullcontext, torch.float32, calls=2)
    assert sorted({row["width"] for row in rows}) == common.decode_widths(5, 130) == [69, 133, 135]
    for width in (69, 133, 135):
        ran = {row["variant"]: row for row in rows if row["width"] == width and "refused" not in row}
        assert set(ran) == {"sdpa, masked (generate's masked step)", "sdpa, no mask"}  # the CPU refuses varlen
        for name, row in ran.items():
            assert row["ms a call"] > 0 and row["ms a step"] == pytest.approx(3 * row["ms a call"])
            assert name == "sdpa, no mask" or row["max |Δ| vs fp64"] < 1e-5


def test_the_varlen_row_attends_as_the_masked_call(monkeypatch):
    # --attention_rows times varlen_decode_attention (generate's one-token attention on a GPU in
    # bf16) as generate calls it: the whole cache left-aligned, each row's filled columns counted
    # (seqused_k), flash attention's variable-length entry with no mask. Here, with that entry written
    # out by its contract (PyTorch has no CPU kernel for it), its packing of rows, heads and lengths
    # must give the masked call's attention at every width (1e-5 in fp32), and without the emulation
    # the CPU refuses it, said so.
    from transformers import Qwen2Config

    from bench import bench_attention

    config = Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    rows = bench_attention(config, 3, 5, 130, torch.device("cpu"), contextlib.nullcontext, torch.float32, calls=2)
    refused = [row for row in rows if row["variant"] == "flash varlen (generate's in bf16)"]
    assert len(refused) == 3 and all("_flash_attention_forward" in row["refused"] for row in refused)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", flash_varlen_by_the_book)
    rows = bench_attention(config, 3, 5, 130, torch.device("cpu"), contextlib.nullcontext, torch.float32, calls=2)
    ran = [row for row in rows if row["variant"] == "flash varlen (generate's in bf16)"]
    assert [row["width"] for row in ran] == [69, 133, 135]
    assert all(row["max |Δ| vs fp64"] < 1e-5 for row in ran), ran


def test_replaced_swaps_a_name_in_common_and_the_scripts_for_one_call():
    # bench.py's contender `masked` is generate with varlen_decode answering no (replaced). The
    # model's runtime lives in common (common.DecodeStep looks varlen_decode and grouped_attention
    # up there); replaced swaps a name in common and in any script that binds it for the call and
    # puts them back after. Here each is replaced by a spy that calls the original: generate's own
    # tokens and log-probs, each spy called.
    import grpo
    from bench import prompts, replaced
    from common import load_model

    model, tokenizer, _ = load_model("tiny", torch.device("cpu"))
    ids, mask = prompts(tokenizer, 4, 2, torch.device("cpu"))
    inputs = (model, ids, mask, 70, [], tokenizer.pad_token_id, len(tokenizer), 0.0)  # two widths
    expected = grpo.generate(*inputs)
    names = ("varlen_decode", "grouped_decode_attention")
    bound = {name: [getattr(module, name, None) for module in (common, grpo)] for name in names}
    calls = []

    def spy(name: str):
        original = getattr(common, name)
        return lambda *a, **k: calls.append(name) or original(*a, **k)

    for name in names:
        got = replaced(name, spy(name), *inputs)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        torch.testing.assert_close(got[3], expected[3], atol=1e-5, rtol=0)
    assert set(calls) == set(names) and calls.count("varlen_decode") == 1  # once a generate; attention each layer
    assert {name: [getattr(module, name, None) for module in (common, grpo)] for name in names} == bound
    got = replaced("varlen_decode", lambda model, cache: False, *inputs)  # the contender masked
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    joined = []  # the contender separate, on a step that merges (as on a GPU): no group, the same tokens
    merged_init, merges = common.MergedProducts.__init__, common.merges
    common.MergedProducts.__init__ = lambda step, *a: (merged_init(step, *a), joined.append(step.groups))[0]
    common.merges = lambda device: True
    try:
        got = replaced("MERGED", (), *inputs)
        assert joined == [[]] and torch.equal(got[0], expected[0]) and torch.equal(got[3], expected[3])
        grpo.generate(*inputs)
        assert len(joined[1]) == 2 * model.config.num_hidden_layers  # and after it, every block's again
    finally:
        common.MergedProducts.__init__, common.merges = merged_init, merges


def test_training_steps_alone_load_no_model_and_report_each_phase(tmp_path, monkeypatch):
    # bench.py --train_steps grpo with no section that needs the model (--batch_sizes '', no
    # step rows) loads none (the training step loads its own), and the step's
    # row has the preflight's seconds, the sizes it ran with (on the CPU 4 and 8 rows) and each
    # phase's TFLOP/s.
    import bench

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(bench, "load_bench_model", no_model)
    settings = dict(model="tiny", batch_sizes="", train_steps="grpo", max_new_tokens=4)
    settings |= dict(group_size=2, train_batch_size=1, output=str(tmp_path / "bench.json"))
    report = bench.main(bench.Args(**settings))
    (row,) = report["training_step"]
    assert row["script"] == "grpo" and row["preflight s"] >= 0
    assert (row["micro_batch_size"], row["logprob_chunk_size"]) == (4, 8)
    assert all(row[f"TFLOP/s {phase}"] > 0 for phase in ("generate+reward", "logprobs", "update"))
    assert row["time/* summed"] == pytest.approx(
        sum(v for k, v in row.items() if k.startswith("time/") and k != "time/* summed")
    )
