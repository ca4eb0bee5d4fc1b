"""Messages a new user met (issue 57): each names only flags the user passed or the script has,
a missing file says so, and no warning from inside peft reaches the user."""

import warnings

import pytest
import torch

import evaluate
import grpo
from common import load_model, load_policy, render_chat, resolve_model_name
from rewards import load_task, tool_turn_text

CPU = torch.device("cpu")


def test_tools_on_a_model_without_a_chat_template_do_not_say_drop_a_flag_never_passed():
    _, tokenizer, _ = load_model("tiny-base", CPU)  # no chat template: plain prompts, --prompt_format auto
    task = load_task("secret")
    with pytest.raises(SystemExit) as stop:
        render_chat(tokenizer, task.messages(task.problems[0]), tools=task.tools)
    assert str(stop.value) == (
        "Tools need a chat template, to show the model the tools and their answers, and this model has none, so "
        "its prompts are plain text: use a chat model (tiny-tools among the tiny ones)."
    )
    with pytest.raises(SystemExit) as stop:
        tool_turn_text(tokenizer, [("secret_digit", "7")])
    assert str(stop.value) == (
        "Tools need a chat template, to give the model the tools' answers, and this model has none, so its "
        "prompts are plain text: use a chat model (tiny-tools among the tiny ones)."
    )


def test_tools_with_prompt_format_plain_on_a_chat_model_say_drop_it():
    _, tokenizer, _ = load_model("tiny-tools", CPU, prompt_format="plain")
    task = load_task("secret")
    with pytest.raises(SystemExit, match=r"drop --prompt_format plain, or use a chat model"):
        render_chat(tokenizer, task.messages(task.problems[0]), tools=task.tools)
    with pytest.raises(SystemExit, match=r"drop --prompt_format plain, or use a chat model"):
        tool_turn_text(tokenizer, [("secret_digit", "7")])


def test_evaluate_names_its_own_flags_where_the_template_does_not_show_the_tools(tmp_path):
    args = evaluate.Args(model="tiny", benchmarks="digit", tools="calculator", output_dir=str(tmp_path), limit=1)
    with pytest.raises(SystemExit) as stop:
        evaluate.main(args)
    message = str(stop.value)
    assert message.endswith("(Qwen2.5, Qwen3, Llama 3.1; tiny-tools among the tiny ones), or drop --tools/--tool.")
    assert "--task" not in message


def test_a_gguf_file_that_does_not_exist_is_no_such_file(tmp_path):
    for name in (str(tmp_path / "model.gguf"), "model.gguf", "models/model.gguf"):
        with pytest.raises(SystemExit) as stop:
            resolve_model_name(name)
        assert str(stop.value) == f"--model {name!r}: no such file; give the path of an existing .gguf file."


def test_lora_lets_no_deprecation_warning_from_peft_through():
    args = grpo.Args(model="tiny", lora_rank=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_policy(args, CPU, torch.float32)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
