"""Model loading, the tiny model, run directories and checkpoints."""

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import (
    MODEL_ALIASES,
    TINY_EMBED_ROWS,
    TINY_MODELS,
    TINY_VOCAB,
    Run,
    append_jsonl,
    interrupts_deferred,
    load_model,
    load_trainer_state,
    make_optimizer,
    make_run_dir,
    read_jsonl,
    render_chat,
    resolve_device,
    resolve_model_name,
    resolve_precision,
    save_checkpoint,
    set_pad_token,
    use_device,
)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", torch.device("cpu"))


def test_tiny_model_is_small_qwen2_with_padded_embedding(tiny):
    model, tokenizer, eos_ids = tiny
    assert model.config.model_type == "qwen2"
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    # Like Qwen, the embedding has more rows than the tokenizer has tokens.
    assert len(tokenizer) == TINY_VOCAB < TINY_EMBED_ROWS == model.get_input_embeddings().weight.shape[0]
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert eos_ids == sorted([im_end, endoftext])  # all EOS ids of the generation config
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None


def test_tiny_tokenizer_chat_template_and_digits(tiny):
    _, tokenizer, _ = tiny
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Use 12 and 7"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nUse 12 and 7<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte-level BPE round-trips
    assert [tokenizer.decode([i]) for i in tokenizer("127", add_special_tokens=False)["input_ids"]] == ["1", "2", "7"]


def test_pad_token_is_distinct_from_eos_when_possible(tiny):
    _, tokenizer, _ = tiny
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name("tiny"))
    tokenizer.pad_token = "<|im_end|>"  # pad == EOS, as in several base models
    set_pad_token(tokenizer, [im_end])
    assert tokenizer.pad_token_id == endoftext and tokenizer.padding_side == "left"
    tokenizer.pad_token = "<|im_end|>"
    set_pad_token(tokenizer, [im_end, endoftext])  # every candidate is an EOS: keep pad == EOS
    assert tokenizer.pad_token_id == im_end


def test_model_name_resolution(tmp_path):
    assert resolve_model_name("Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
    assert MODEL_ALIASES["Qwen2.5-1.5B-Instruct"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert resolve_model_name("Qwen/Qwen2.5-7B") == "Qwen/Qwen2.5-7B"  # any Hub id passes through
    assert resolve_model_name(str(tmp_path)) == str(tmp_path)  # a local directory
    with pytest.raises(SystemExit, match="short names"):
        resolve_model_name("qwen-1.5b")


def test_missing_model_gives_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="without config.json"):
        load_model(str(tmp_path), torch.device("cpu"))  # a directory without a model
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="no tokenizer files"):
        load_model(str(tmp_path), torch.device("cpu"))  # weights without a tokenizer
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit, match="Could not load model"):
        load_model(str(tmp_path), torch.device("cpu"))  # a broken model directory


def test_precision_choices():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", cpu) == (torch.float32, None)
    assert resolve_precision("auto", cuda) == (torch.float32, torch.bfloat16)  # fp32 master weights
    assert resolve_precision("bfloat16", cuda) == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(SystemExit, match="not one of"):
        resolve_precision("fp16", cpu)


@dataclass
class FakeArgs:
    model: str = "Qwen/Qwen2.5-1.5B-Instruct"
    task: str = "countdown"
    output_dir: str = ""
    lr: float = 1e-6


def test_run_dir_args_and_metrics(tmp_path):
    args = FakeArgs(output_dir=str(tmp_path))
    first, second = make_run_dir(args, "grpo"), make_run_dir(args, "grpo")
    assert first != second  # two runs in the same second do not share a directory
    assert first.name.startswith("grpo-countdown-Qwen2.5-1.5B-Instruct-")
    assert json.loads((first / "args.json").read_text())["lr"] == 1e-6
    append_jsonl(first / "metrics.jsonl", {"step": 1, "reward/mean": 0.5})
    append_jsonl(first / "metrics.jsonl", {"step": 2, "reward/mean": 0.75})
    assert [r["reward/mean"] for r in read_jsonl(first / "metrics.jsonl")] == [0.5, 0.75]


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_checkpoint_round_trip_and_overwrite(name, tmp_path):
    model, tokenizer, _ = load_model(name, torch.device("cpu"))
    path = tmp_path / "final"
    save_checkpoint(path, model, tokenizer, {"step": 3})
    save_checkpoint(path, model, tokenizer, {"step": 5})  # overwriting replaces it whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no staging leftovers
    assert load_trainer_state(str(path))["step"] == 5
    loaded = AutoModelForCausalLM.from_pretrained(path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert (path / "model.safetensors").exists()
    reloaded, reloaded_tokenizer, _ = load_model(str(path), torch.device("cpu"))  # as --model or evaluate.py would
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template
    assert reloaded_tokenizer.pad_token_id == tokenizer.pad_token_id
    assert reloaded.config.model_type == model.config.model_type
    with pytest.raises(SystemExit, match="no trainer_state.pt"):
        load_trainer_state(str(tmp_path))


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_build_is_deterministic_and_leaves_the_rng_alone(name, tmp_path):
    # Two fresh builds give the same tokenizer and weights, and building (the first run on a
    # machine) must not shift the caller's RNG, or that run would sample differently.
    from common import build_tiny_model

    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, second = build_tiny_model(str(tmp_path / "a"), name), build_tiny_model(str(tmp_path / "b"), name)
    assert torch.equal(torch.get_rng_state(), state)
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()
    a = AutoModelForCausalLM.from_pretrained(first).state_dict()
    b = AutoModelForCausalLM.from_pretrained(second).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_llama_model_with_its_own_template_and_pad():
    model, tokenizer, eos_ids = load_model("tiny-llama", torch.device("cpu"))
    assert model.config.model_type == "llama" and not model.config.tie_word_embeddings
    assert len(tokenizer) == TINY_VOCAB == model.get_input_embeddings().weight.shape[0]  # no padded rows
    eot, end_of_text = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert eos_ids == sorted([eot, end_of_text])
    # It ships no pad token: set_pad_token picks one that is not an EOS (pad = EOS would mask the EOS out).
    assert tokenizer.pad_token == "<|finetune_right_pad_id|>" and tokenizer.pad_token_id not in eos_ids
    # The template starts with BOS and inserts its default system prompt when none is given.
    assert render_chat(tokenizer, [{"role": "user", "content": "Hi"}]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    system = [{"role": "system", "content": "Think first."}, {"role": "user", "content": "Hi"}]
    assert render_chat(tokenizer, system).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nThink first.<|eot_id|>"
    )
    ids = tokenizer(render_chat(tokenizer, system), add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1  # the template's BOS, not a second one from the tokenizer


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_user_turn():
    # Countdown's prompt has a system message. tiny-llama-nosystem's template raises on one
    # (as Gemma's does); a template that silently skips system messages would lose it. Both
    # get the system text at the top of the first user message instead.
    _, tokenizer, _ = load_model("tiny-llama-nosystem", torch.device("cpu"))
    messages = [{"role": "system", "content": "Think first."}, {"role": "user", "content": "Hi"}]
    folded = (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nThink first.\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_chat(tokenizer, messages) == folded
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] != 'system' %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
        "{% endif %}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    )
    assert render_chat(tokenizer, messages) == folded
    assert render_chat(tokenizer, messages[1:]) == folded.replace("Think first.\n\n", "")


# ----------------------------------------------------------------------------------------
# common.Run: the run harness every training script uses around its algorithm.


def run_args(tmp_path, **overrides):
    from grpo import Args

    settings = dict(model="tiny", output_dir=str(tmp_path), max_steps=5, batch_size=2, group_size=2)
    return Args(**(settings | dict(eval_every=2, save_every=2, sample_every=2, num_samples=1) | overrides))


def fake_batch(tokenizer, n=4):
    """What end_step reads of a script's Rollout: prompts, completions and their rewards."""
    ids = torch.tensor(tokenizer(["q0", "q0", "q1", "q1"][:n])["input_ids"])
    texts = [f"completion {i}" for i in range(n)]
    scores = [SimpleNamespace(reward=float(i)) for i in range(n)]
    return SimpleNamespace(prompt_ids=ids, prompt_mask=torch.ones_like(ids), texts=texts, scores=scores)


def test_run_evaluates_logs_samples_and_saves_on_schedule(tiny, tmp_path):
    # max_steps 5, eval_every 2, save_every 2, sample_every 2 (0-based step % 2 == 0, logged as
    # step + 1): evaluations after steps 2, 4 and 5 (the last); samples at steps 1, 3, 5, one
    # each (num_samples 1: the first row of the first group); checkpoints step-000002 and
    # step-000004, then final. Only final keeps the trainer state.
    model, tokenizer, _ = tiny
    optimizer, scheduler = make_optimizer(model, 1e-3, run_args(tmp_path))
    calls = []
    run = Run(
        run_args(tmp_path), "grpo", model, tokenizer, resumable={"optimizer": optimizer, "scheduler": scheduler},
        same_on_resume=("model",), evaluate=lambda: calls.append(1) or {"eval/accuracy": 0.5},
    )  # fmt: skip
    with run:
        for step in run.steps():
            run.end_step(step, {"reward/mean": 0.25}, {"generate": 1.5}, fake_batch(tokenizer))
        run.save_final()
    rows = read_jsonl(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r.get("eval/accuracy") for r in rows] == [None, 0.5, None, 0.5, 0.5] and len(calls) == 3
    assert list(rows[1]) == ["step", "reward/mean", "time/generate", "eval/accuracy"]  # time/, then eval/
    samples = read_jsonl(run.dir / "samples.jsonl")
    assert [(s["step"], s["completion"], s["reward"]) for s in samples] == [(s, "completion 0", 0.0) for s in (1, 3, 5)]
    saved = sorted(p.name for p in run.dir.iterdir() if p.is_dir())
    assert saved == ["final", "step-000002", "step-000004"]
    assert [(run.dir / name / "trainer_state.pt").exists() for name in saved] == [True, False, False]
    state = load_trainer_state(str(run.dir / "final"))
    assert state["step"] == 5 and set(state) == {"step", "optimizer", "scheduler", "rng", "args", "world_size", "algo"}


def test_run_resumes_state_logs_and_args(tiny, tmp_path):
    # A run saved after step 2 with run.state {"rounds": 7} and the optimizer of one AdamW step;
    # the log holds steps 1-3 (step 3 ran after the checkpoint). Resuming restores the
    # optimizer's moments and run.state, drops step 3 from the log, keeps the earlier args.json
    # as args.before-step-000002.json, and the torch RNG as it was at the save.
    model, tokenizer, _ = tiny
    optimizer, scheduler = make_optimizer(model, 1e-3, run_args(tmp_path))
    model.lm_head.weight.sum().backward()
    optimizer.step()
    settings = dict(resumable={"optimizer": optimizer}, same_on_resume=("model",), evaluate=None)
    first = Run(run_args(tmp_path, eval_every=0), "grpo", model, tokenizer, **settings, state={"rounds": 0})
    for step in range(3):
        first.state["rounds"] = [4, 7, 107][step]  # as a script advances it; 7 at the checkpoint
        first.end_step(step, {}, {})
        if step == 1:
            expected_draw = (torch.manual_seed(11), torch.rand(3))[1]
            torch.manual_seed(11)
            first.save("step-000002", 2)
            torch.rand(5)  # the RNG moves on after the save
    fresh, _ = make_optimizer(model, 1e-3, run_args(tmp_path))
    args = run_args(tmp_path, eval_every=0, resume_from=str(first.dir / "step-000002"), lr=2e-3)
    settings["resumable"] = {"optimizer": fresh}
    resumed = Run(args, "grpo", model, tokenizer, **settings, state={"rounds": 0})
    assert resumed.dir == first.dir and resumed.start_step == 2 and resumed.state == {"rounds": 7}
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert [r["step"] for r in read_jsonl(first.dir / "metrics.jsonl")] == [1, 2]
    assert json.loads((first.dir / "args.json").read_text())["lr"] == 2e-3
    assert json.loads((first.dir / "args.before-step-000002.json").read_text())["lr"] is None  # unset: the default
    assert torch.equal(torch.rand(3), expected_draw)
    assert list(resumed.steps()) == [2, 3, 4]


def test_ctrl_c_in_a_run_stops_with_the_newest_checkpoint(tiny, tmp_path, capsys):
    model, tokenizer, _ = tiny
    settings = dict(resumable={}, same_on_resume=("model",), evaluate=None)
    run = Run(run_args(tmp_path, eval_every=0), "grpo", model, tokenizer, **settings)
    with pytest.raises(SystemExit) as stop, run:
        for step in run.steps():
            run.end_step(step, {}, {})
            if step == 2:
                raise KeyboardInterrupt
    assert stop.value.code == 130
    message = capsys.readouterr().err
    # Three steps ended (their metrics rows are written); the newest checkpoint is step 2's (save_every 2).
    assert f"Interrupted after 3 steps. Newest checkpoint: {run.dir / 'step-000002'}." in message
    assert f"--resume_from {run.dir / 'step-000002'}" in message


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test, as an interactive run has: a pytest started in the
    background by a script inherits SIGINT ignored, and interrupts_deferred then rightly does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_save_finishes_it_and_names_it(tiny, tmp_path, capsys, python_sigint):
    # SIGINT (Ctrl-C) arrives while step-000002 is being written (from write_extra, inside the
    # save). The save and the clean-up of step-000001's trainer state run to the end; then the run
    # stops and names step-000002, which holds the trainer state: its resume command works.
    model, tokenizer, _ = tiny
    saves = []

    def write_extra(directory):
        saves.append(directory)
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            (Path(directory) / "after_the_signal.txt").write_text("the save went on")

    settings = dict(resumable={}, same_on_resume=("model",), evaluate=None, write_extra=write_extra)
    run = Run(run_args(tmp_path, eval_every=0, save_every=1), "grpo", model, tokenizer, **settings)
    with pytest.raises(SystemExit) as stop, run:
        for step in run.steps():
            run.end_step(step, {}, {})
    assert stop.value.code == 130 and len(saves) == 2
    newest = run.dir / "step-000002"
    assert (newest / "after_the_signal.txt").exists() and (newest / "trainer_state.pt").exists()
    assert not (run.dir / "step-000001" / "trainer_state.pt").exists()
    assert f"Interrupted after 2 steps. Newest checkpoint: {newest}." in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler is back


def test_interrupts_deferred_raises_once_it_ends(python_sigint):
    # Nothing interrupts the block; the KeyboardInterrupt comes when it ends, and without a
    # signal the block ends as usual.
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            finished.append(True)
    assert finished == [True]
    with interrupts_deferred():
        pass
    # A second Ctrl-C stops at once: a save that hangs can still be stopped.
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            finished.append(False)  # not reached
    assert finished == [True]
    # An error within wins over a deferred Ctrl-C, and Python's handler is back after it.
    with pytest.raises(ValueError):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            raise ValueError("the save failed")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("handler", [signal.SIG_IGN, "own"], ids=["ignored", "own handler"])
def test_interrupts_deferred_leaves_other_handlers_alone(handler):
    # Where SIGINT is ignored (a background job's) or handled by the caller, it stays so, within and after.
    seen = []
    handler = (lambda number, frame: seen.append(number)) if handler == "own" else handler
    previous = signal.signal(signal.SIGINT, handler)
    try:
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == ([] if handler is signal.SIG_IGN else [signal.SIGINT])  # the caller's own handler ran


def test_the_cpu_tier_runs_on_the_cpu():
    # conftest: on a GPU machine too, --device auto resolves to the CPU in this tier, and the
    # processes it starts (torchrun, smoke runs) see no GPU.
    assert resolve_device("auto") == torch.device("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_device_names_are_checked():
    with pytest.raises(SystemExit, match="not a device torch knows"):
        resolve_device("gpu0")
    with pytest.raises(SystemExit, match="sees no CUDA GPU"):
        resolve_device("cuda:1")
    assert use_device(torch.device("cpu")) == torch.device("cpu")  # the CPU has no current device to set
