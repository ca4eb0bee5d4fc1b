"""Tools at agent scale (issue 59): what a user of tools meets, each with a test that failed before
its fix. dapo.py logs tools/* over every completion it sampled, so a step whose groups are all
filtered still shows its calls; a run prints its directory when it starts."""

import asyncio
import gc
import inspect
import json
import threading
import time

import pytest
import torch
import transformers
from test_cli import no_model_load, tiny_args
from transformers import AutoTokenizer

import common
import dapo
import grpo
import ppo
import rewards
from common import TINY_SECRET_CALL
from rewards import Score, class_tool, load_tools, run_tool_call, tool_turn_text, tool_turns


def rollout_of(completion_mask, tool_mask, tool_counts) -> dapo.Rollout:
    rows, width = completion_mask.shape
    return dapo.Rollout(
        prompt_ids=torch.zeros(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1, dtype=torch.long),
        completion_ids=torch.zeros(rows, width, dtype=torch.long), completion_mask=completion_mask,
        truncated=torch.zeros(rows, dtype=torch.bool), sample_logp=torch.zeros(rows, width),
        rewards=torch.zeros(rows), texts=[""] * rows, scores=[Score(0.0, False, False)] * rows, tool_mask=tool_mask,
        tool_counts=tool_counts,
    )  # fmt: skip


def test_dapo_logs_tools_over_every_completion_it_sampled_even_with_every_group_filtered():
    # Two rounds of G = 2 with different widths, no group kept (every reward 0). Calls, failed, turns,
    # past --max_turns: round 1 [1, 0, 1, 0], [0, 0, 0, 0]; round 2 [2, 1, 1, 1], [1, 1, 1, 0]. calls
    # (1 + 0 + 2 + 1)/4 = 1.0 a completion, errors 2 of 4 calls = 0.5, turns 3/4 = 0.75, over budget
    # 1/4; the tools' tokens 2 + 1 = 3 of
    # 3 + (3 + 2 + 2 + 1) = 11 in all: 3/11.
    first = rollout_of(
        torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]]), torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]]),
        torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0]]),
    )  # fmt: skip
    second = rollout_of(
        torch.tensor([[1, 0, 1], [1, 1, 0]]),
        torch.tensor([[0, 1, 0], [0, 0, 0]]),
        torch.tensor([[2, 1, 1, 1], [1, 1, 1, 0]]),
    )
    metrics = dapo.sampling_metrics([first, second], groups_kept=0, group_size=2)
    assert metrics["sampling/groups_kept"] == 0
    assert {k: v for k, v in metrics.items() if k.startswith("tools/")} == pytest.approx(
        {
            "tools/calls": 1.0,
            "tools/errors": 0.5,
            "tools/turns": 0.75,
            "tools/over_budget": 0.25,
            "tools/env_share": 3 / 11,
        }
    )
    # without tools: no tools/ keys
    plain = rollout_of(torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), None)
    assert not any(k.startswith("tools/") for k in dapo.sampling_metrics([plain], 0, 2))


def test_a_run_prints_its_directory_when_it_starts(tmp_path, capsys):
    run_dir = grpo.train(tiny_args(grpo, max_steps=1, output_dir=str(tmp_path)))
    assert f"grpo: run directory {run_dir}\n" in capsys.readouterr().out


@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=lambda m: m.__name__)
def test_max_turns_0_with_tools_stops_before_any_weight_loads(script, tmp_path, monkeypatch):
    # Tools given and no turn for them: every call would end its completion unanswered. The task's
    # tools are known before the model loads: the run stops there, with no run directory.
    monkeypatch.setattr(common, "load_model", no_model_load)
    with pytest.raises(SystemExit, match=r"--max_turns 0 gives the task's tools \(calculator\) no turn"):
        script.train(tiny_args(script, task="digit", tools="calculator", max_turns=0, output_dir=str(tmp_path)))
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------
# Tools a user writes: async ones, ones that swallow every exception or never return, huge answers,
# answers that hold a special token's text, signatures the model cannot call


@pytest.fixture(scope="module")
def tools_tokenizer():
    return AutoTokenizer.from_pretrained(common.build_tiny_model(name="tiny-tools"))


def test_a_tool_that_swallows_every_exception_is_stopped_at_its_time_limit():
    # A bare except: swallowed the SIGALRM of the old time limit, and this tool then ran its whole
    # 10 s (one that loops forever hung the run). The call is abandoned at 0.5 s: an error answer.
    def stubborn(x: int) -> str:
        for _ in range(20):
            try:
                time.sleep(0.5)
            except:  # noqa: E722 (the point of the test)
                pass
        return "done"

    start = time.perf_counter()
    answer, failed = run_tool_call({"name": "stubborn", "arguments": {"x": 1}}, {"stubborn": stubborn}, 0.5)
    assert failed and answer == "error: stubborn ran past its time limit of 0.5 s"
    assert time.perf_counter() - start < 3


def test_an_async_tool_is_awaited():
    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0.01)
        return a + b

    assert run_tool_call({"name": "add", "arguments": {"a": 2, "b": 3}}, {"add": add}, 5.0) == ("5", False)


def test_a_tool_that_takes_arguments_by_position_only_stops_at_load(tmp_path):
    # Its schema lists xs, and the model names every argument: every call would fail.
    source = tmp_path / "mine.py"
    source.write_text(
        'def total(*xs: int) -> int:\n    """Adds.\n\n    Args:\n        xs: the numbers\n    """\n    return sum(xs)\n'
    )
    with pytest.raises(SystemExit, match=r"total\(\*xs: int\) -> int takes xs by position only"):
        load_tools("", f"{source}:total")


def test_a_huge_answer_is_cut_from_its_first_characters(tools_tokenizer, monkeypatch):
    # 10 MB of text was tokenised whole, again and again, to find what fits: seconds outside the
    # tool's time limit. Now fitted_answer is handed at most max_tool_tokens × the vocabulary's longest
    # token (76 characters in tiny-tools': its one-token call), and a "…" where it was cut.
    def secret_digit() -> str:
        """The secret digit."""
        return "7" * 10_000_000

    handed, real = [], rewards.fitted_answer
    monkeypatch.setattr(rewards, "fitted_answer", lambda t, answers, n: handed.append(answers) or real(t, answers, n))
    tool_turn, _ = tool_turns(tools_tokenizer, [secret_digit], 1, 1, 64, 5.0)
    answer = tool_turn(0, tools_tokenizer(TINY_SECRET_CALL, add_special_tokens=False)["input_ids"]).result()
    ((name, text),) = handed[-1]
    assert text == "7" * (64 * 76) + "…"
    assert len(answer) <= 64 and "7" in tools_tokenizer.decode(answer) and "…" in tools_tokenizer.decode(answer)

    def at_the_limit() -> str:  # exactly 64 × 76 characters: handed on whole, with no "…"
        """The secret digit."""
        return "7" * (64 * 76)

    at_the_limit.__name__ = "secret_digit"
    tool_turn, _ = tool_turns(tools_tokenizer, [at_the_limit], 1, 1, 64, 5.0)
    tool_turn(0, tools_tokenizer(TINY_SECRET_CALL, add_special_tokens=False)["input_ids"]).result()
    assert handed[-1] == [("secret_digit", "7" * (64 * 76))]


def test_an_answer_holding_a_special_tokens_text_is_text(tools_tokenizer):
    # "<|im_end|>" in an answer was tokenised as the end of the turn: the template's own one stays
    # the only one.
    def secret_digit() -> str:
        """The secret digit."""
        return "7<|im_end|><tool_response>"

    end, response = (tools_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<tool_response>"))
    tool_turn, _ = tool_turns(tools_tokenizer, [secret_digit], 1, 1, 64, 5.0)
    answer = tool_turn(0, tools_tokenizer(TINY_SECRET_CALL, add_special_tokens=False)["input_ids"]).result()
    empty = tools_tokenizer(tool_turn_text(tools_tokenizer, [("secret_digit", "")]), add_special_tokens=False)
    assert answer.count(end) == empty["input_ids"].count(end) == 1
    assert answer.count(response) == empty["input_ids"].count(response)
    assert "7<\u200b|im_end|>" in tools_tokenizer.decode(answer)


def test_tool_errors_of_a_single_failed_call_is_1():
    # mutmut (common.tool_metrics): max(calls, 1) guards the division when no call was made; with one
    # call, failed, the share is 1/1, not 1/2 (the mutant max(calls, 2) survived every other test).
    batch = rollout_of(torch.tensor([[1, 0, 1]]), torch.tensor([[0, 1, 0]]), torch.tensor([[1, 1, 1, 0]]))
    assert common.tool_metrics(batch)["tools/errors"] == 1.0
    none = rollout_of(torch.tensor([[1, 1, 0]]), torch.zeros(1, 3, dtype=torch.long), torch.tensor([[0, 0, 0, 0]]))
    assert common.tool_metrics(none)["tools/errors"] == 0.0  # no call: 0/1, not a division by 0
    # the tools' share of one token in all, theirs: 1/1 (the mutant max(…, 2) made it 1/2)
    alone = rollout_of(torch.tensor([[0, 0]]), torch.tensor([[1, 0]]), torch.tensor([[1, 0, 1, 0]]))
    assert common.tool_metrics(alone)["tools/env_share"] == 1.0


@pytest.mark.parametrize(
    "flags, lower",
    [
        (
            dict(tools="calculator", max_turns=1_000_000, max_tool_tokens=100_000_000),
            "--max_turns or --max_tool_tokens",
        ),
        (dict(max_new_tokens=10**13), "--max_new_tokens"),
    ],
)
def test_a_cache_that_cannot_hold_one_completion_stops_before_any_weight_loads(flags, lower, tmp_path, monkeypatch):
    # --max_turns 1000000 passed every check and died in generate on a 98 GB allocation, the model
    # loaded. The config alone gives a column's bytes (2 · layers · kv heads · head dim · 4 on the
    # CPU): 10^14 columns of the tiny model's are more than any machine has free.
    monkeypatch.setattr(common, "load_model", no_model_load)
    with pytest.raises(SystemExit, match=f"One completion's KV cache would need .* lower {lower}"):
        grpo.train(tiny_args(grpo, task="digit", **flags, output_dir=str(tmp_path)))
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------
# mutmut's survivors in the tools' code (docs/tests.md, Mutation testing)


def test_every_positional_only_parameter_is_named(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text(
        'def pair(a: int, b: int, /) -> int:\n    """Adds.\n\n    Args:\n        a: one\n        b: two\n    """\n    return a + b\n'
    )
    with pytest.raises(SystemExit, match="takes a, b by position only"):
        load_tools("", f"{source}:pair")


def test_a_call_with_no_tools_at_all_says_none():
    assert run_tool_call({"name": "x", "arguments": {}}, {}, 1.0) == (
        "error: no tool named 'x'; the tools are: none",
        True,
    )


def test_an_answer_keeps_its_non_ascii_text():
    def where() -> dict:
        """Where."""
        return {"ville": "Besançon"}

    assert run_tool_call({"name": "where", "arguments": {}}, {"where": where}, 5.0) == ('{"ville": "Besançon"}', False)


def test_a_call_runs_in_a_daemon_thread_and_a_time_limit_of_0_is_none():
    # a daemon: a tool that never returns cannot keep the process from ending; 0: no limit (a call
    # of 0.2 s returns its value, where join(0) would abandon it at once)
    def where() -> str:
        """Where."""
        time.sleep(0.2)
        thread = threading.current_thread()
        return f"{thread.daemon} {thread.name}"

    assert run_tool_call({"name": "where", "arguments": {}}, {"where": where}, 0) == ("True nanoPO tool call", False)


def test_tool_turns_counts_in_integers_and_fits_the_template_at_the_limit(tools_tokenizer):
    # --max_tool_tokens equal to the template's own 21 tokens around an empty answer is accepted
    def secret_digit() -> str:
        """The secret digit."""
        return ""

    tool_turn, counts = tool_turns(tools_tokenizer, [secret_digit], 2, 1, 21, 5.0)
    assert counts.dtype == torch.long and counts.shape == (2, 4)
    with pytest.raises(SystemExit, match="--max_tool_tokens 20 is fewer than the 21 tokens"):
        tool_turns(tools_tokenizer, [secret_digit], 2, 1, 20, 5.0)


# ----------------------------------------------------------------------------------------
# A tool with state: a class, one instance per rollout row

STATEFUL_TOOL = '''
closed = []


class secret_digit:
    """Counts its calls: the state of one row's completion, across its turns."""

    def __init__(self):
        self.calls = 0

    def __call__(self) -> str:
        """Tells how many times this completion has asked.

        Returns:
            The number of calls so far, this one included.
        """
        self.calls += 1
        return str(self.calls)

    def close(self):
        closed.append(self.calls)
'''


def test_a_class_tool_keeps_each_rows_state_across_its_turns(tools_tokenizer, tmp_path):
    # tiny-tools' one-token call names secret_digit: a class of that name, loaded as --tool gives it.
    # Row 0 calls in three turns: 1, 2, 3; row 1 once: its own instance, 1. When the rollout is done
    # with tool_turn, each instance is closed (close() records its count).
    source = tmp_path / "stateful.py"
    source.write_text(STATEFUL_TOOL)
    (tool,) = load_tools("", f"{source}:secret_digit")
    assert tool.__name__ == "secret_digit" and list(inspect.signature(tool).parameters) == []
    schema = transformers.utils.get_json_schema(tool)["function"]
    assert schema["name"] == "secret_digit" and schema["description"].startswith("Tells how many times")
    tool_turn, counts = tool_turns(tools_tokenizer, [tool], 2, 3, 64, 5.0)
    call = tools_tokenizer(TINY_SECRET_CALL, add_special_tokens=False)["input_ids"]
    said = [tools_tokenizer.decode(tool_turn(row, call).result()) for row in (0, 0, 1, 0)]
    assert [text.split("<tool_response>\n")[1][0] for text in said] == ["1", "2", "1", "3"]
    assert counts[:, 0].tolist() == [3, 1] and counts[:, 1].tolist() == [0, 0]
    closed = tool.stateful.close.__globals__["closed"]  # the tool file's own list
    assert closed == []
    del tool_turn
    gc.collect()
    assert sorted(closed) == [1, 3]


def test_a_class_tool_whose_constructor_raises_answers_with_the_error(tools_tokenizer):
    class secret_digit:
        def __init__(self):
            raise RuntimeError("no sandbox today")

        def __call__(self) -> str:
            """Never reached."""
            return "7"

    tool_turn, counts = tool_turns(tools_tokenizer, [class_tool(secret_digit)], 1, 1, 64, 5.0)
    answer = tool_turn(0, tools_tokenizer(TINY_SECRET_CALL, add_special_tokens=False)["input_ids"]).result()
    assert "error: RuntimeError: no sandbox today" in tools_tokenizer.decode(answer) and counts[0, 1] == 1


@pytest.mark.parametrize("workers, rows", [(32, 32), (4, 5)])
def test_tool_workers_run_that_many_calls_at_once(tools_tokenizer, workers, rows):
    # `rows` rows end a turn with a call at one step; each call waits at a barrier for all of them to
    # be running together (no wall time measured: the barrier is the proof). --tool_workers 32, 32
    # rows: all meet, none fails. 4 workers, 5 rows: the 5th call cannot start until one of the first 4
    # is abandoned at the 0.5 s time limit, so at least one fails (the bug it plants: too few at once).
    barrier = threading.Barrier(rows)

    def secret_digit() -> str:
        """The secret digit, once enough calls run together."""
        return str(barrier.wait(timeout=30))

    tool_turn, counts = tool_turns(tools_tokenizer, [secret_digit], rows, 1, 64, 0.5, workers)
    call = tools_tokenizer(TINY_SECRET_CALL, add_special_tokens=False)["input_ids"]
    answers = [tool_turn(row, call) for row in range(rows)]  # handed over at once, as one step's rows are
    said = [tools_tokenizer.decode(answer.result()) for answer in answers]
    failed = counts[:, 1].sum().item()
    if workers >= rows:
        assert failed == 0 and all("error" not in text for text in said)
    else:
        assert failed >= 1 and any("ran past its time limit" in text for text in said)
    barrier.abort()  # frees the calls a time limit abandoned


KINDS_OF_TOOL = {
    # Each named secret_digit, as the tool --task digit gets by --tool. An async tool, awaited:
    "async": """
import asyncio

async def secret_digit() -> str:
    '''Tells the secret digit, after a wait.'''
    await asyncio.sleep(0.01)
    return "7"
""",
    # A class: one instance a row, its state across turns; the reward reads it (a parameter `tools`).
    "class": """
class secret_digit:
    '''Tells the secret digit, counting its calls.'''

    def __init__(self):
        self.calls = 0

    def __call__(self) -> str:
        '''Tells the secret digit, counting this row's calls.'''
        self.calls += 1
        return "7"


def reward(completion: str, problem: dict, truncated: bool, tools: dict) -> float:
    return 0.25 * tools["secret_digit"].calls if "secret_digit" in tools else 0.0
""",
    # A tool that swallows everything, its time limit included, and would sleep 10 s.
    "bare-except": """
import time

def secret_digit() -> str:
    '''Tells the secret digit, eventually.'''
    try:
        time.sleep(10)
    except:  # noqa: E722
        pass
    return "7"
""",
}


@pytest.mark.parametrize("kind", KINDS_OF_TOOL)
@pytest.mark.parametrize("script", [grpo, dapo, ppo], ids=lambda m: m.__name__)
def test_async_class_and_swallowing_tools_run_in_every_script(script, kind, tmp_path, monkeypatch):
    # One step of each script with each kind of tool, every row calling it at its first token (a turn
    # ends at any token; every turn is a call to secret_digit): the run ends, each completion made its
    # one call (--max_turns 1), answered, or abandoned at --tool_timeout and failed for the swallowing
    # tool. Four rows' calls run at once (--tool_workers 4). The class tool's reward reads each row's
    # instance: 0.25 × its calls = 0.25 (the planted bug, a reward handed no state: 0).
    path = tmp_path / "tool.py"
    path.write_text(KINDS_OF_TOOL[kind])
    monkeypatch.setattr(common, "eos_token_ids", lambda model_path, tokenizer: list(range(tokenizer.vocab_size)))
    monkeypatch.setattr(rewards, "parse_tool_calls", lambda text, *unused: [{"name": "secret_digit", "arguments": {}}])
    reward_fn = {"reward_fn": f"{path}:reward"} if kind == "class" else {}
    reward_fn |= {"dynamic_sampling": False} if script is dapo else {}  # one round: every reward is equal here
    args = tiny_args(
        script, model="tiny-tools", tool=f"{path}:secret_digit", max_turns=1, max_tool_tokens=32, tool_timeout=0.5,
        tool_workers=4, max_steps=1, save_every=0, sample_every=0, output_dir=str(tmp_path / "run"), **reward_fn,
    )  # fmt: skip
    (row,) = [json.loads(line) for line in (script.train(args) / "metrics.jsonl").read_text().splitlines()]
    assert row["tools/calls"] == 1.0 and row["tools/turns"] == 1.0
    assert row["tools/errors"] == (1.0 if kind == "bare-except" else 0.0)
    if kind == "class":
        assert row["reward/mean"] == 0.25


def test_a_reward_naming_tools_gets_the_rows_class_tools_and_no_other_reward_does(tmp_path):
    # tool_state: {"tools": the row's instances} for a --reward_fn with a parameter `tools` ({} without
    # a rollout's tools); nothing for one without it, which is called with its three arguments as before.
    path = tmp_path / "reward.py"
    path.write_text(
        "def with_tools(completion, problem, truncated, tools):\n    return float(len(tools))\n\n"
        "def plain(completion, problem, truncated):\n    return float(len(problem['prompt']))\n"
    )
    task = rewards.load_task("digit")
    stateful = rewards.with_reward_fn(task, f"{path}:with_tools", 5.0)
    plain = rewards.with_reward_fn(task, f"{path}:plain", 5.0)

    def tool_turn():
        """A stand-in for tool_turns' tool_turn: row 1 made one class tool."""

    tool_turn.instances = [{}, {"Sandbox": object()}]
    assert rewards.tool_state(plain, tool_turn, 1) == {} and rewards.tool_state(stateful, None, 0) == {"tools": {}}
    scores = rewards.scored(stateful, ["a", "b"], task.problems[:1], 2, [False, False], tool_turn)
    assert [score.reward for score in scores] == [0.0, 1.0] and not any(score.failed for score in scores)
    # rows i·G … i·G+G-1 answer problem i (the planted bug, no problem handed: the call fails)
    scores = rewards.scored(plain, ["a", "b", "c", "d"], task.problems[:2], 2, [False] * 4)
    assert [score.reward for score in scores] == [float(len(task.problems[i // 2]["prompt"])) for i in range(4)]


def test_the_steps_after_calls_stop_waiting_once_a_call_outlasts_the_grace(monkeypatch):
    # ToolQueue.held: the step after a call waits TOOL_GRACE_S for it (an instant tool costs no step).
    # A call still running then marks the tools slow, and later steps wait no more: each new call would
    # otherwise stall every row 50 ms. Waits recorded by their timeout (none really sleeps here).
    from concurrent import futures

    real, waits = futures.wait, []

    def recorded(fs, timeout=None, return_when=futures.ALL_COMPLETED):
        waits.append(timeout)
        return real(fs, timeout=0 if timeout else None, return_when=return_when)

    monkeypatch.setattr(futures, "wait", recorded)
    env = rewards.ToolQueue.empty(2, 4, 0, torch.device("cpu"))
    rows, filled, alive = torch.tensor([0, 1]), torch.tensor([3, 5]), torch.tensor([True, True])
    quick, slow, later = (futures.Future() for _ in range(3))
    quick.set_result([7, 8])
    env.pending[0] = (quick, 0)
    assert env.held(rows, filled, alive, 1, True).tolist() == [False, False] and env.patient  # landed in its grace
    assert env.queued.tolist() == [2, 0] and env.start.tolist() == [5, 0] and waits == [rewards.TOOL_GRACE_S]
    env.pending[0] = (slow, 1)
    assert env.held(rows, filled, alive, 2, True).tolist() == [True, False] and not env.patient  # missed it
    later.set_result([9])
    env.pending[1] = (later, 2)
    assert env.held(rows, filled, alive, 3, True).tolist() == [True, False]  # row 1's answer taken, with no grace
    # then both rows waited (no other could decode): a wait for the first answer, done at once; no grace
    assert waits == [rewards.TOOL_GRACE_S] * 2 + [None] and env.queued.tolist() == [2, 1]
    assert env.waits.tolist() == [2, 0]  # row 0 held at steps 2 and 3: the steps generate's loop and RNG add


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4, 5], []], ids=["longer", "empty"])
def test_an_answer_longer_than_its_queue_or_empty_stops_naming_both_lengths(tokens):
    # A tool_turn of one's own (generate takes any) whose Future lands more than max_tool_tokens tokens,
    # or none (a row ends by None, handed back at once: an empty answer would leave it sampling on).
    from concurrent import futures

    env = rewards.ToolQueue.empty(1, 4, 0, torch.device("cpu"))
    answer = futures.Future()
    answer.set_result(tokens)
    env.pending[0] = (answer, 0)
    with pytest.raises(ValueError, match=f"tool_turn gave {len(tokens)} tokens; max_tool_tokens is 4"):
        env.held(torch.tensor([0]), torch.tensor([2]), torch.tensor([True]), 1, True)


def test_each_call_of_a_step_gets_its_own_grace(monkeypatch):
    # With one worker (--tool_workers 1) a step's calls run one after another: three calls of 30 ms
    # each are instant calls, and the step after them waits for them 3 × TOOL_GRACE_S (not 1 ×, which
    # they would outlast together, and every later call would then cost its row a step).
    from concurrent import futures

    real, waits = futures.wait, []
    monkeypatch.setattr(futures, "wait", lambda fs, timeout=None, **kw: waits.append(timeout) or real(fs, 0, **kw))
    env = rewards.ToolQueue.empty(4, 4, 0, torch.device("cpu"))  # rows 0-2 called at step 0; row 3 decodes on
    for row in range(3):
        env.pending[row] = (futures.Future(), 0)
        env.pending[row][0].set_result([7])
    env.held(torch.arange(4), torch.zeros(4, dtype=torch.long), torch.tensor([True] * 4), 1, True)
    assert waits == [3 * rewards.TOOL_GRACE_S] and env.patient and env.queued.tolist() == [1, 1, 1, 0]


def test_a_reward_without_a_signature_takes_no_tools():
    # A builtin (no signature to read) is called with its three arguments, never handed `tools`.
    assert not rewards.takes_tools(max) and rewards.takes_tools(lambda completion, problem, truncated, tools: 0)


def test_calls_run_one_at_a_time_in_the_order_handed_by_default(tools_tokenizer):
    # tool_turns' workers default to 1 (--tool_workers 1): a second call starts only once the first has
    # returned, so tools drawing from Python's random draw in the rows' order. The first call waits
    # (up to 0.5 s) for a second to start beside it; run one at a time, none does.
    started, first_running, second_started = [], threading.Event(), threading.Event()

    def secret_digit() -> str:
        """The secret digit."""
        started.append(first_running.is_set())
        if len(started) == 1:
            first_running.set()
            second_started.wait(0.5)  # returns at once where a second worker started the second call
            first_running.clear()
        else:
            second_started.set()
        return "7"

    tool_turn, counts = tool_turns(tools_tokenizer, [secret_digit], 2, 1, 64, 5.0)
    call = tools_tokenizer(TINY_SECRET_CALL, add_special_tokens=False)["input_ids"]
    answers = [tool_turn(row, call) for row in (0, 1)]
    [answer.result() for answer in answers]
    assert started == [False, False] and counts[:, 0].tolist() == [1, 1]
