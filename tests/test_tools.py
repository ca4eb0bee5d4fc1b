"""Tools in rollouts (issue 41): the built-in calculator on the Countdown verifier's parser, the
parser of the calls a model writes (Hermes/Qwen blocks, Llama 3's JSON), running a call (its
failures become the answer, never the run's end), --tools and --tool, the text a chat template
writes after a turn that called tools, the tiny-tools model, and the secret toy task's reward."""

import json
import random
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer
from transformers.utils import get_json_schema

from common import (
    TINY_EMBED_ROWS,
    TINY_SECRET_CALL,
    TINY_VOCAB,
    build_tiny_model,
    load_model,
    render_chat,
)
from rewards import (
    BUILTIN_TOOLS,
    MAX_EXPRESSION_CHARS,
    REWARD_CORRECT,
    REWARD_FORMAT,
    REWARD_NONE,
    calculator,
    check_tool_turns,
    evaluate_expression,
    import_reward_fn,
    load_heldout_task,
    load_task,
    load_tools,
    parse_tool_calls,
    read_expression,
    run_tool_call,
    secret_digit,
    secret_score,
    tool_call_format,
    tool_turn_text,
    tool_turns,
    training_task,
    with_reward_fn,
    with_tools,
)

SECRET_CALL = TINY_SECRET_CALL  # the one token of tiny-tools whose text is the secret task's whole call and <|im_end|>


# ----------------------------------------------------------------------------------------
# calculator: exact arithmetic on the Countdown verifier's parser


@pytest.mark.parametrize(
    "expression, answer",
    [
        ("2 + 3 * 4", "14"),  # * before +: 3 · 4 = 12, + 2
        ("(2 + 3) * 4", "20"),  # the parentheses first: 5 · 4
        ("12 / 4", "3"),  # an integral quotient is its digits alone
        ("3 - 5", "-2"),  # a negative result
        ("-5 + 3", "-2"),  # a sign before a number (issue 59: GSM8K's problems have them)
        ("-(2 + 3) * 2", "-10"),  # and before a parenthesis
        ("0.1 + 0.2", "3/10 = 0.3"),  # decimals read exactly: 1/10 + 2/10, not the floats' 0.30000000000000004
        ("-1.5 * (2.25 + 4)", "-75/8 = -9.375"),  # −3/2 · 25/4
        ("7 / 2", "7/2 = 3.5"),  # the exact fraction, then its decimal
        ("1 - 9 / 2", "-7/2 = -3.5"),  # 1 − 4.5
        ("1 / 3", "1/3 ≈ 0.333333"),  # 0.333… does not end: rounded to 6 places, marked ≈
        ("2 / 3", "2/3 ≈ 0.666667"),  # 0.6666… rounds up at the 6th place
        ("1 / 8", "1/8 = 0.125"),  # ends within 6 places: exact, '='
        (" 6*7 ", "42"),  # spaces around and none inside
        ("1000000 * 1000000", "1000000000000"),  # 10^6 · 10^6, the largest literals allowed
    ],
)
def test_the_calculator_computes_exactly(expression, answer):
    assert calculator(expression) == answer


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1 / 0", "division by zero"),
        ("1 / (2 - 2)", "division by zero"),
        ("", "empty"),
        ("1 + " * 30 + "1", f"longer than {MAX_EXPRESSION_CHARS} characters"),  # 121 characters
        ("2 + x", "may be written, not: x$"),  # the characters that are not arithmetic, named
        ("__import__('os').system('ls')", "not: ' _ e i"),  # no names, calls or quotes: nothing reaches eval
        ("2.5.1", "not a complete expression"),
        ("1e5", "not: e"),  # no exponents
        ("2 ** 10", r"\*\*"),
        ("2 // 3", "//"),
        ("(1 + 2", "not a complete expression"),
        ("1000001 + 1", "above 1000000"),
        ("()", "not arithmetic"),
    ],
)
def test_the_calculator_says_what_is_wrong(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


@pytest.mark.parametrize("expression, message", [("1.5 + 2", "not: ."), ("-5 + 3", "0 - 5")])
def test_countdown_still_takes_whole_numbers_without_signs(expression, message):
    # The calculator's decimals and signs are its own: Countdown's answers stay whole numbers.
    with pytest.raises(ValueError, match=message):
        read_expression(expression)


def test_the_calculator_refuses_what_is_not_text():
    with pytest.raises(ValueError, match="text"):
        calculator(5)  # a model may write {"expression": 5}


def test_the_tools_schemas_are_what_the_chat_template_shows():
    # apply_chat_template(tools=[f]) calls get_json_schema(f): it must accept every built-in tool.
    schema = get_json_schema(calculator)["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert get_json_schema(secret_digit)["function"]["parameters"]["properties"] == {}
    assert BUILTIN_TOOLS == {"calculator": calculator}


# ----------------------------------------------------------------------------------------
# parse_tool_calls: what a model wrote in one turn, special tokens included


@pytest.mark.parametrize(
    "text, calls",
    [
        (  # Qwen2.5/Qwen3 (Hermes): one block, then the end of the turn
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>',
            [{"name": "calculator", "arguments": {"expression": "2 + 3"}}],
        ),
        (  # two blocks, with text before and between
            'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "secret_digit", "arguments": {}}\n</tool_call>',
            [{"name": "calculator", "arguments": {"expression": "1"}}, {"name": "secret_digit", "arguments": {}}],
        ),
        (  # the arguments as a JSON string holding an object
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7 / 2\\"}"}</tool_call>',
            [{"name": "calculator", "arguments": {"expression": "7 / 2"}}],
        ),
        (  # no "arguments": a function without any
            '<tool_call>{"name": "secret_digit"}</tool_call>',
            [{"name": "secret_digit", "arguments": {}}],
        ),
        (SECRET_CALL, [{"name": "secret_digit", "arguments": {}}]),  # tiny-tools' one-token call
        (  # Llama 3.1: <|python_tag|>, then one JSON object with "parameters"
            '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1 + 1"}}<|eom_id|>',
            [{"name": "calculator", "arguments": {"expression": "1 + 1"}}],
        ),
        (  # Llama 3.2: the turn's whole text is the JSON object
            ' {"name": "calculator", "parameters": {"expression": "1 + 1"}} <|eot_id|>',
            [{"name": "calculator", "arguments": {"expression": "1 + 1"}}],
        ),
        ("The answer is 5.<|im_end|>", []),  # no call
        ('{"answer": 5}<|eot_id|>', []),  # a JSON answer without a name and no marker: no call
        ("", []),
    ],
)
def test_tool_calls_are_read_in_each_format(text, calls):
    assert parse_tool_calls(text) == calls


def test_a_hermes_models_json_answer_is_no_call(tiny_tools):
    # Qwen's template writes calls in <tool_call> blocks: a final answer that is a JSON object with a
    # "name" is an answer there, not Llama's whole-turn call (the review's repro: it was answered
    # "error: no tool named 'Alice'" and the completion went on).
    _, tokenizer, _ = tiny_tools
    assert not tool_call_format(tokenizer)  # tiny-tools' template: Hermes
    answer = '{"name": "Alice", "age": 30}<|im_end|>'
    assert parse_tool_calls(answer, whole_turn_json=False) == []
    assert parse_tool_calls(answer) == [{"name": "Alice", "arguments": {}}]  # as Llama's format reads it
    assert tool_call_format(fresh_tokenizer("tiny-llama"))  # no <tool_call> in its template: whole-turn JSON


@pytest.mark.parametrize(
    "text, message",
    [
        ('<tool_call>\n{"name": "calculator", "arguments": {\n</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "calculator", "arguments": ["1 + 1"]}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": "1 + 1"}</tool_call>', "not a JSON object"),
        ("<tool_call>[1, 2]</tool_call>", "not a JSON object"),
        ('<tool_call>\n{"name": "secret_digit", "arguments": {}}', "no </tool_call>"),  # unclosed
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "nested too deep"),  # json.loads: RecursionError
        ('<|python_tag|>brave_search.call(query="x")<|eom_id|>', "not valid JSON"),  # the tag makes it a call
        ('<|python_tag|>{"name": "calculator", "parameters": 3}', "not a JSON object"),
    ],
)
def test_a_malformed_call_is_a_call_with_its_error(text, message):
    (call,) = parse_tool_calls(text)
    assert list(call) == ["error"] and message in call["error"]


def test_a_good_call_then_an_unclosed_one_gives_both():
    text = '<tool_call>{"name": "secret_digit", "arguments": {}}</tool_call> <tool_call>{"name": "calc'
    good, unclosed = parse_tool_calls(text)
    assert good == {"name": "secret_digit", "arguments": {}} and "no </tool_call>" in unclosed["error"]


# ----------------------------------------------------------------------------------------
# run_tool_call: (answer, failed), never an exception


def sleeps(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def answers_a_dict() -> dict:
    """A dict.

    Returns:
        a JSON object
    """
    return {"sum": 3, "terms": [1, 2]}


def answers_a_set() -> set:
    """A set (not JSON).

    Returns:
        a set
    """
    return {7}


def sleeps_and_catches_everything(seconds: float) -> str:
    """Sleeps inside `except Exception`, as careless code does.

    Args:
        seconds: how long
    """
    try:
        time.sleep(seconds)
    except Exception:
        return "swallowed"
    return "slept"


TOOLS = {"calculator": calculator, "sleeps": sleeps, "answers_a_dict": answers_a_dict, "answers_a_set": answers_a_set}


@pytest.mark.parametrize(
    "call, answer, failed",
    [
        ({"name": "calculator", "arguments": {"expression": "7 / 2"}}, "7/2 = 3.5", False),
        ({"name": "answers_a_dict", "arguments": {}}, '{"sum": 3, "terms": [1, 2]}', False),  # json.dumps
        ({"name": "answers_a_set", "arguments": {}}, "{7}", False),  # not JSON-able: str()
        (
            {"name": "search", "arguments": {}},
            "error: no tool named 'search'; the tools are: calculator, sleeps, answers_a_dict, answers_a_set",
            True,
        ),
        (
            {"name": "calculator", "arguments": {"expr": "1"}},
            "error: wrong arguments for calculator: missing a required argument: 'expression'",
            True,
        ),
        ({"name": "calculator", "arguments": {"expression": "1 / 0"}}, "error: ValueError: division by zero", True),
        ({"error": "the call is not valid JSON"}, "error: the call is not valid JSON", True),  # parse_tool_calls'
    ],
)
def test_a_call_runs_and_its_failures_are_the_answer(call, answer, failed):
    assert run_tool_call(call, TOOLS, timeout_s=1.0) == (answer, failed)


@pytest.mark.parametrize("tool", ["sleeps", "sleeps_and_catches_everything"])
def test_a_tool_past_its_time_is_stopped(tool):
    # The time limit is not an Exception: a tool that catches every Exception does not swallow it
    start = time.perf_counter()
    tools = TOOLS | {"sleeps_and_catches_everything": sleeps_and_catches_everything}
    answer, failed = run_tool_call({"name": tool, "arguments": {"seconds": 5}}, tools, timeout_s=0.5)
    assert failed and answer == f"error: {tool} ran past its time limit of 0.5 s"
    assert time.perf_counter() - start < 2  # stopped at 0.5 s, not after the 5 s sleep


# ----------------------------------------------------------------------------------------
# --tools (built-in) and --tool (your own, imported as --reward_fn is)

GOOD_TOOL = '''
def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b
'''


def tool_file(tmp_path, source: str = GOOD_TOOL, name: str = "my_tools.py") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_built_in_and_own_tools_load(tmp_path, monkeypatch):
    assert load_tools("", "") == []
    assert load_tools("calculator", "") == [calculator]
    (by_file,) = load_tools("", f"{tool_file(tmp_path)}:add")
    assert by_file.__name__ == "add" and by_file(2, 3) == 5
    (tmp_path / "modules").mkdir()
    tool_file(tmp_path / "modules", name="nanopo_test_tool_module.py")
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    both = load_tools(" calculator ", "nanopo_test_tool_module:add")  # module:function, spaces ignored
    assert [tool.__name__ for tool in both] == ["calculator", "add"]


@pytest.mark.parametrize(
    "source, message",
    [
        ("def add(a: int) -> int:\n    return a\n", "--tool .*add.*no docstring"),
        (
            'def add(a) -> int:\n    """Adds.\n\n    Args:\n        a: it\n    """\n',
            "--tool .*add.*missing a type hint",
        ),
        ('def add(a: int) -> int:\n    """Adds."""\n', "--tool .*add.*no description for the argument 'a'"),
    ],
)
def test_a_tool_the_schema_cannot_describe_stops_with_what_to_add(tmp_path, source, message):
    with pytest.raises(SystemExit, match=message) as stop:
        load_tools("", f"{tool_file(tmp_path, source)}:add")
    assert "type hint on every argument" in str(stop.value) and "Args:" in str(stop.value)


def test_unknown_duplicate_and_unimportable_tools_stop(tmp_path):
    with pytest.raises(SystemExit, match="--tools 'search' is not a built-in tool; they are: calculator"):
        load_tools("calculator,search", "")
    twice = tool_file(tmp_path, GOOD_TOOL.replace("def add", "def calculator"), "twice.py")
    with pytest.raises(SystemExit, match="two tools named 'calculator'"):
        load_tools("calculator", f"{twice}:calculator")
    with pytest.raises(SystemExit, match="--tool 'no_such_module_here:f' does not import"):
        load_tools("", "no_such_module_here:f")
    with pytest.raises(SystemExit, match="--reward_fn 'no_such_module_here:f' does not import"):
        import_reward_fn("no_such_module_here:f")  # the shared importer names each flag


def task_flags(**flags):
    """What training_task reads of a script's Args."""
    settings = dict(
        task="secret", data_file="", eval_data_file="", seed=0, num_problems=10, dataset="", data_dir="", shots=0,
        countdown_numbers="3-4", reward_fn="", reward_fn_timeout=1.0, tools="", tool="", eval_problems=2,
    )  # fmt: skip
    return SimpleNamespace(**(settings | flags))


def test_the_tool_flags_add_to_the_tasks_own_tools(tmp_path):
    secret = load_task("secret")
    assert with_tools(secret, task_flags()) is secret  # no flags: the same task, nothing imported
    assert with_tools(secret, SimpleNamespace()) is secret  # Args without the flags (evaluate.py's)
    assert with_tools(secret, task_flags(tools="calculator")).tools == [secret_digit, calculator]
    assert training_task(task_flags(tools="calculator")).tools == [secret_digit, calculator]
    own = tool_file(tmp_path, GOOD_TOOL.replace("def add", "def secret_digit"), "clash.py")
    with pytest.raises(SystemExit, match="two tools named 'secret_digit'"):
        with_tools(secret, task_flags(tool=f"{own}:secret_digit"))


def test_a_reward_function_keeps_the_tasks_tools(tmp_path):
    reward = tool_file(tmp_path, "def one(completion, problem, truncated):\n    return 1.0\n", "reward.py")
    task = with_reward_fn(load_task("secret"), f"{reward}:one", 1.0)
    assert task.tools == [secret_digit] and task.score("x", task.problems[0]).reward == 1.0
    assert training_task(task_flags(reward_fn=f"{reward}:one")).tools == [secret_digit]


# ----------------------------------------------------------------------------------------
# The chat template's side: the tools in the prompt, the text after a turn that called tools


@pytest.fixture(scope="module")
def tiny_tools():
    return load_model("tiny-tools", torch.device("cpu"))


def fresh_tokenizer(name: str):
    """A tokenizer of a tiny model that a test may change (load_model's sets the prompt format)."""
    return AutoTokenizer.from_pretrained(build_tiny_model(name=name))


def test_tiny_tools_is_tiny_with_three_added_tokens(tiny_tools):
    model, tokenizer, eos_ids = tiny_tools
    assert len(tokenizer) == TINY_VOCAB + 3 < TINY_EMBED_ROWS == model.get_input_embeddings().weight.shape[0]
    call, response, end = tokenizer.convert_tokens_to_ids([SECRET_CALL, "<tool_response>", "</tool_response>"])
    assert {call, response, end} == {TINY_VOCAB, TINY_VOCAB + 1, TINY_VOCAB + 2}  # after tiny's 384
    assert tokenizer(f"x{SECRET_CALL}y", add_special_tokens=False).input_ids[1:-1] == [call]  # one token
    # Not special (as Qwen2.5's): a decode that skips special tokens keeps them, for the scorer.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode([call, response], skip_special_tokens=True) == SECRET_CALL + "<tool_response>"
    assert tokenizer.eos_token == "<|im_end|>" and im_end in eos_ids
    assert call in eos_ids  # the call ends the turn, as its <|im_end|> says


def test_tool_turn_text_of_tiny_tools_is_qwen_shaped(tiny_tools):
    _, tokenizer, _ = tiny_tools
    # <|im_end|> (the model's) + "\n", the answer as a user turn in <tool_response>, the next header.
    assert tool_turn_text(tokenizer, [("secret_digit", "7")]) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tool_turn_text(tokenizer, [("secret_digit", "7"), ("calculator", "3")]) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_turn_text_of_the_other_tiny_templates():
    # tiny's plain ChatML writes the tool role as it writes any role; tiny-llama's template too.
    assert tool_turn_text(fresh_tokenizer("tiny"), [("calculator", "12")]) == (
        "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tool_turn_text(fresh_tokenizer("tiny-llama"), [("calculator", "12")]) == (
        "<|start_header_id|>tool<|end_header_id|>\n\n12<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_tool_turn_text_when_the_template_renders_the_last_turn_otherwise():
    # Qwen3's template adds an empty <think></think> to the last assistant turn only, so the
    # conversation with the tool answer does not start with the one without it. The text after
    # the turn's end is still well defined: the same as plain ChatML's.
    tokenizer = fresh_tokenizer("tiny")
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content']",
        "{{ '<|im_start|>' + message['role'] + '\n' + ('<think>\n\n</think>\n\n' if loop.last and "
        "message['role'] == 'assistant' else '') + message['content']",
    )
    last = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert "<think>" in tokenizer.apply_chat_template(last, tokenize=False)  # the planted behaviour is there
    assert (
        tool_turn_text(tokenizer, [("calculator", "12")]) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_turn_text_stops_where_a_template_cannot_write_tool_answers():
    refuses = fresh_tokenizer("tiny")
    refuses.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('Only user and assistant') }}"
        "{% endif %}{{ m['content'] + '<|im_end|>' }}{% endfor %}"
    )
    with pytest.raises(SystemExit, match="chat template has no tool role.*Only user and assistant"):
        tool_turn_text(refuses, [("calculator", "12")])
    drops = fresh_tokenizer("tiny")
    drops.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(SystemExit, match="drops the tool's answer"):
        check_tool_turns(drops)
    _, plain, _ = load_model("tiny-base", torch.device("cpu"))
    with pytest.raises(SystemExit, match="need a chat template"):
        tool_turn_text(plain, [("calculator", "12")])


def test_an_answer_the_template_escapes_goes_through(tiny_tools):
    # Llama 3.1's template writes a tool message's content through tojson: quoted, its quotes and
    # newlines escaped. The answer is then not found as given, and a tool turn must not stop on it
    # (the review's repro: an error answer with quotes stopped training); the template passes its check.
    escapes = fresh_tokenizer("tiny")
    escapes.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ '<tool>' + (m['content'] | tojson) + '<|im_end|>' }}"
        "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    check_tool_turns(escapes)
    answer = 'error: the call has no "name"\nline two'
    assert tool_turn_text(escapes, [("calculator", answer)]) == f"<tool>{json.dumps(answer)}<|im_end|>A:"


def test_the_prompt_shows_the_tools(tiny_tools):
    # tiny-tools' template lists the tools by name in a system turn (a real one, Qwen2.5's, writes
    # their JSON schemas there: get_json_schema's, which render_chat passes on).
    _, tokenizer, _ = tiny_tools
    question = [{"role": "user", "content": "What is the secret digit?"}]
    text = render_chat(tokenizer, question, tools=[secret_digit, calculator])
    assert text == (
        "<|im_start|>system\n<tools> secret_digit calculator </tools><|im_end|>\n"
        "<|im_start|>user\nWhat is the secret digit?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without tools, plain ChatML as tiny's; a system message joins the tools' system turn, once.
    assert (
        render_chat(tokenizer, question)
        == "<|im_start|>user\nWhat is the secret digit?<|im_end|>\n<|im_start|>assistant\n"
    )
    system = [{"role": "system", "content": "Be brief."}, *question]
    text = render_chat(tokenizer, system, tools=[secret_digit])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n<tools>") and text.count("<|im_start|>system") == 1


def test_tools_need_a_template_that_shows_them():
    _, plain, _ = load_model("tiny-base", torch.device("cpu"))
    with pytest.raises(SystemExit, match="need a chat template.*this model has none.*use a chat model"):
        render_chat(plain, [{"role": "user", "content": "x"}], tools=[secret_digit])
    with pytest.raises(SystemExit, match="does not show the tools"):  # tiny's ChatML ignores `tools`
        render_chat(fresh_tokenizer("tiny"), [{"role": "user", "content": "x"}], tools=[secret_digit])
    # A prompt that happens to hold the tool's name shows no tools either: the same text as without.
    with pytest.raises(SystemExit, match="does not show the tools"):
        render_chat(fresh_tokenizer("tiny"), [{"role": "user", "content": "call secret_digit"}], tools=[secret_digit])


# ----------------------------------------------------------------------------------------
# The secret task: only the tool knows the digit


def test_the_secret_digit_comes_from_the_runs_random_seed():
    random.seed(0)  # Python's Mersenne Twister from seed 0: randint(0, 9) gives 6, 6, 0
    assert [secret_digit() for _ in range(3)] == ["6", "6", "0"]


def test_the_secret_task_carries_its_tool():
    task, heldout = load_task("secret"), load_heldout_task("secret", 2)
    assert task.tools == [secret_digit] and heldout.tools == [secret_digit]
    assert heldout.problems == task.problems[:2]  # nothing held out: its own prompts
    assert task.messages(task.problems[0]) == [{"role": "user", "content": task.problems[0]["prompt"]}]


def answered(digit: str) -> str:
    """A completion as the scorer gets it from tiny-tools: the call, the tool's answer `digit` as the
    template wrote it, special tokens (<|im_end|>, <|im_start|>) dropped by the decode."""
    return f"{SECRET_CALL}\nuser\n<tool_response>\n{digit}\n</tool_response>\nassistant\n"


@pytest.mark.parametrize(
    "completion, reward, formatted",
    [
        (answered("7") + "7", REWARD_CORRECT, True),  # called, copied the answer
        (answered("7") + "The digit is 7.", REWARD_CORRECT, True),  # the first digit it writes counts
        (answered("7") + "3", REWARD_FORMAT, True),  # called, then wrote another digit
        (answered("7") + "seven", REWARD_NONE, False),  # no digit after the answer: a call alone earns 0
        ("7", REWARD_NONE, False),  # no call: a guess, however lucky
        ("7" + answered("7") + "no", REWARD_NONE, False),  # a digit before the answer does not count
        (answered("3") + "3" + answered("5") + "5", REWARD_CORRECT, True),  # the last answer counts
        (answered("3") + "3" + answered("5") + "3", REWARD_FORMAT, True),
        (answered("error: ValueError: x") + "7", REWARD_FORMAT, True),  # the tool failed: no digit to copy
        ("<tool_response>\n7\n", REWARD_NONE, False),  # never closed: no answer
    ],
)
def test_the_secret_reward_by_hand(completion, reward, formatted):
    score = secret_score(completion, {"prompt": "What is the secret digit?"})
    assert (score.reward, score.correct, score.formatted) == (reward, reward == REWARD_CORRECT, formatted)


def test_the_secret_reward_of_a_decoded_tiny_tools_rollout(tiny_tools):
    # The tokens a rollout holds: the call token, its <|im_end|> in it (the model's), the tool turn
    # (the environment's), then the model's "4" and <|im_end|>; decoded as the scripts decode.
    _, tokenizer, _ = tiny_tools
    call, im_end = tokenizer.convert_tokens_to_ids([SECRET_CALL, "<|im_end|>"])
    tool_turn = tokenizer(tool_turn_text(tokenizer, [("secret_digit", "4")]), add_special_tokens=False).input_ids
    reply = tokenizer("4", add_special_tokens=False).input_ids
    text = tokenizer.decode([call, *tool_turn, *reply, im_end], skip_special_tokens=True)
    assert text == answered("4") + "4"
    assert secret_score(text, {}).reward == REWARD_CORRECT
    assert parse_tool_calls(tokenizer.decode([call])) == [{"name": "secret_digit", "arguments": {}}]


# mutmut's survivors in read_expression and evaluate_expression (docs/tests.md, Mutation testing):
# each limit at its boundary, and what each mode says


def test_the_expression_limits_at_their_boundaries():
    # 12 operations nested is the most: 13 ones joined by + (the leftmost 1 at depth 12) is read,
    # 14 are not; the same nested to the right, and in signs (the calculator's).
    assert evaluate_expression(read_expression("+".join(["1"] * 13))[0]) == 13
    with pytest.raises(ValueError, match="more than 12 operations"):
        read_expression("+".join(["1"] * 14))
    assert evaluate_expression(read_expression("1+(" * 11 + "1+1" + ")" * 11)[0]) == 13
    with pytest.raises(ValueError, match="more than 12 operations"):
        read_expression("1+(" * 12 + "1+1" + ")" * 12)
    assert calculator("-" * 12 + "1") == "1"
    with pytest.raises(ValueError, match="more than 12 operations"):
        calculator("-" * 13 + "1")
    # 100 characters is the most (parentheses add no depth)
    hundred = "(" * 49 + "1" + ")" * 49 + " "
    assert len(hundred) == MAX_EXPRESSION_CHARS and evaluate_expression(read_expression(hundred)[0]) == 1
    with pytest.raises(ValueError, match=f"longer than {MAX_EXPRESSION_CHARS} characters"):
        read_expression(hundred + " ")


def test_each_mode_says_what_may_be_written():
    with pytest.raises(ValueError, match="only digits, "):
        read_expression("2 + x")  # Countdown's
    with pytest.raises(ValueError, match="only numbers, "):
        calculator("2 + x")  # the calculator's


def test_a_plus_sign_keeps_the_sign():
    assert calculator("+3") == "3" and calculator("-(+3)") == "-3"


def test_tool_turns_reads_a_llama_models_whole_turn_json_call():
    # tiny-llama's template writes no <tool_call> blocks: a turn that is one JSON object is a call
    # (tool_turns reads the format off the template; mutmut's survivor read Hermes' blocks alone).
    tokenizer = fresh_tokenizer("tiny-llama")
    tool_turn, counts = tool_turns(tokenizer, [calculator], 1, 1, 64, 5.0)
    turn = '{"name": "calculator", "parameters": {"expression": "1 + 1"}}' + tokenizer.eos_token
    answer = tool_turn(0, tokenizer(turn, add_special_tokens=False)["input_ids"]).result()
    assert answer is not None and "2" in tokenizer.decode(answer) and counts[0].tolist() == [1, 0, 1, 0]
