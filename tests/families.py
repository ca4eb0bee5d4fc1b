"""The family matrix: tiny random models of every family people fine-tune with RL, built from
transformers' own config classes (nothing downloaded), for tests/test_families.py.

Each is 4 layers of width 64 with grouped-query attention (4 query heads on 2 KV heads), and
every sliding-window layer has a window of WINDOW tokens, shorter than the test's prompts, so a
sampler that attends past the window reads other keys than the model's own forward pass.
Families that mix full and sliding layers (config.layer_types) alternate them.

    python tests/families.py        # the gaps of generate against the model's own forward, a table
"""

import contextlib
import sys
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from unittest import mock

import torch
import transformers

WINDOW = 8  # the sliding window of every sliding layer: prompts here are 12 to 30 tokens
VOCAB = 448  # the tiny tokenizer's embedding rows (common.TINY_EMBED_ROWS), so the scripts can run them
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# gpt-oss: its YaRN factor of 32 over its own 4096 positions, as the real config (no warning)
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=131072)

# family -> (config class, its settings beyond SHAPE)
FAMILIES = {
    "qwen2": ("Qwen2Config", {}),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED)),
    "qwen3": ("Qwen3Config", {}),
    "qwen3-moe": ("Qwen3MoeConfig", dict(MOE, decoder_sparse_step=1, mlp_only_layers=[])),
    "llama3": ("LlamaConfig", dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, layer_types=MIXED, attn_logit_softcapping=1.0)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=WINDOW, layer_types=MIXED)),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW)),
    "olmo2": ("Olmo2Config", {}),
    "smollm3": ("SmolLM3Config", {}),
    "gpt-oss": ("GptOssConfig", dict(GPT_OSS, sliding_window=WINDOW, layer_types=MIXED)),
    "cohere2": ("Cohere2Config", dict(sliding_window=WINDOW, layer_types=MIXED)),
}


def family_config(family: str, **overrides):
    """The config of a tiny `family` model; overrides replace any setting (the special ids, say)."""
    class_name, settings = FAMILIES[family]
    config_class = getattr(transformers, class_name)
    config = config_class(**{**SHAPE, **settings, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides})
    if family == "phi3":  # Phi-3 has no head_dim setting: hidden / heads
        assert config.hidden_size // config.num_attention_heads == SHAPE["head_dim"]
    return config


def unbuildable(family: str) -> str | None:
    """Why the installed transformers cannot build this family's config, or None. transformers 5.4
    (the floor) declares some of Olmo2Config's and Cohere2Config's flags as int while their
    defaults are bool, which the strict dataclasses of today's huggingface_hub refuse: no model of
    those families loads there at all, ours or a real one."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        family_config(family)
    except StrictDataclassError as error:
        return (
            f"transformers {transformers.__version__} cannot build {FAMILIES[family][0]}: {str(error).splitlines()[0]}"
        )
    return None


def family_model(family: str, seed: int = 0, **overrides):
    """A randomly initialised fp32 `family` model, in eval mode."""
    config = family_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def family_prompts(seed: int = 0, lengths=(30, 12, 21)):
    """Left-padded random prompts of different lengths (all longer than WINDOW): ids, mask (n, P)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, VOCAB, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def plain_forward_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """log π of each completion token from the model's own forward over prompt + completion, with
    its own masks (a 2D attention mask): the reference. (n, T)"""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float()
    logits = logits[:, prompt_ids.shape[1] - 1 : -1] / temperature
    logp = logits.log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    return logp * completion_mask


def gaps(family: str, new_tokens: int = 16) -> dict:
    """generate against the model's own forward: the largest log-prob gaps (sampled at τ 1, and
    greedy) and whether the greedy tokens are the plain forward's argmax."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from conftest import greedy_by_recomputation
    from grpo import generate, sequence_logprobs

    model = family_model(family)
    prompt_ids, prompt_mask = family_prompts()
    eos = [VOCAB + 1]  # never sampled: every row runs to new_tokens
    result = {}
    for temperature in (1.0, 0.0):
        torch.manual_seed(1)
        ids, mask, _, sample_logp, _ = generate(model, prompt_ids, prompt_mask, new_tokens, eos, 0, VOCAB, temperature)
        scale = temperature or 1.0
        with torch.no_grad():
            scored, _ = sequence_logprobs(model, prompt_ids, prompt_mask, ids, mask, scale, VOCAB, chunk_size=2)
        plain = plain_forward_logprobs(model, prompt_ids, prompt_mask, ids, mask, scale)
        key = "sampled" if temperature else "greedy"
        result[f"{key} vs plain"] = (sample_logp - plain).abs().max().item()
        result[f"{key} vs scoring"] = (sample_logp - scored).abs().max().item()
        result["scoring vs plain"] = max(result.get("scoring vs plain", 0), (scored - plain).abs().max().item())
        if not temperature:
            with torch.no_grad():
                reference = greedy_by_recomputation(model, prompt_ids, prompt_mask, new_tokens, VOCAB)
            result["greedy tokens equal"] = bool((ids == reference).all())
    return result


if __name__ == "__main__":
    print(f"transformers {transformers.__version__}, window {WINDOW}")
    print("| family | sampled vs plain | greedy vs plain | sampled vs scoring | scoring vs plain | greedy tokens |")
    print("|---|---|---|---|---|---|")
    for name in FAMILIES:
        try:
            r = gaps(name)
        except Exception as error:  # a table of every family, the failures among them
            print(f"| {name} | {type(error).__name__}: {str(error)[:80]} |")
            continue
        print(
            f"| {name} | {r['sampled vs plain']:.1e} | {r['greedy vs plain']:.1e} | {r['sampled vs scoring']:.1e} | "
            f"{r['scoring vs plain']:.1e} | {'equal' if r['greedy tokens equal'] else 'DIFFER'} |"
        )


# Multi-turn rollouts with a scripted tool (tests/test_tool_rollouts.py, the matrix in test_families.py)
STOP = list(range(3, 60))  # ~13% of the vocabulary as EOS ids: turns end after ~8 tokens
NEW_TOKENS = 12
ANSWER = 3  # tokens of each scripted answer


def scripted_tools(max_turns: int = 2):
    """A tool_turn that answers every ended turn of a row, up to max_turns, with ANSWER tokens
    that say which row and turn they answer: [300 + row, 301 + turn, 400]. Records each call."""
    calls = []

    def tool_turn(row: int, ids: list[int]) -> list[int] | None:
        calls.append((row, list(ids)))
        turn = sum(r == row for r, _ in calls)
        return [300 + row, 301 + turn, 400] if turn <= max_turns else None

    return tool_turn, calls


class LateAnswers:
    """Answers that land `delay(row, turn)` decode steps after their call, as a slow tool's do: each a Future
    that the model's forward hook fills when its step comes, whatever the wall time. When generate blocks
    (every row still decoding waits, or a sliding window lets none skip a column), the wait itself fills the
    earliest one (or all): the same rows wait the same steps on any machine. Use it as a context manager."""

    def __init__(self, model, delay):
        self.model, self.delay, self.steps, self.due = model, delay, 0, []  # due: [step, Future, answer, row]
        self.handed, self.landed = {}, {}  # (row, turn) -> the step

    def hand(self, row: int, turn: int, answer: list[int]) -> Future:
        future = Future()
        self.handed[row, turn] = self.steps
        self.due.append([self.steps + self.delay(row, turn), future, answer, (row, turn)])
        return future

    def land(self, entries) -> None:
        for entry in entries:
            self.due.remove(entry)
            self.landed[entry[3]] = self.steps
            entry[1].set_result(entry[2])

    def forward_hook(self, *unused) -> None:
        self.steps += 1
        self.land([entry for entry in self.due if entry[0] <= self.steps])

    def wait(self, fs, timeout=None, return_when=futures.ALL_COMPLETED):
        waiting = [entry for entry in self.due if entry[1] in fs]
        if timeout is None and waiting and not any(future.done() for future in fs):  # generate blocks here
            first = min(waiting, key=lambda entry: entry[0])
            self.land(waiting if return_when == futures.ALL_COMPLETED else [first])
        return WAIT(fs, timeout=0)

    def __enter__(self):
        import rewards

        self.hook = self.model.register_forward_hook(self.forward_hook)
        self.patches = [mock.patch.object(rewards, "TOOL_GRACE_S", 0.0), mock.patch.object(futures, "wait", self.wait)]
        for patch in self.patches:
            patch.start()
        return self

    def __exit__(self, *unused):
        self.hook.remove()
        for patch in self.patches:
            patch.stop()


WAIT = futures.wait


def sample_with_tools(model, temperature=1.0, seed=3, max_turns=2, device="cpu", delay=None, answered=None):
    """generate on family_prompts (each twice), STOP ending turns, scripted_tools answering them, at once or,
    with delay (row, turn) -> steps, that many decode steps late (LateAnswers; answered: a tool_turn's answer
    -> what tool_turn returns, a Future of it for one). Returns prompt_ids, prompt_mask, generate's five
    outputs, and tool_turn's calls (with delay: and the LateAnswers)."""
    from grpo import generate

    prompt_ids, prompt_mask = (tensor.repeat_interleave(2, 0).to(device) for tensor in family_prompts())  # (6, P)
    scripted, calls = scripted_tools(max_turns)
    late = LateAnswers(model, delay or (lambda row, turn: 0))

    def tool_turn(row: int, ids: list[int]):
        answer = scripted(row, ids)
        if answer is None or (delay is None and answered is None):
            return answer
        return answered(answer) if answered is not None else late.hand(row, answer[1] - 301, answer)

    torch.manual_seed(seed)
    with late if delay is not None else contextlib.nullcontext():
        out = generate(
            model, prompt_ids, prompt_mask, NEW_TOKENS, STOP, 0, VOCAB, temperature,
            tool_turn=tool_turn, max_turns=max_turns, max_tool_tokens=ANSWER,
        )  # fmt: skip
    return prompt_ids, prompt_mask, out, (calls, late) if delay is not None else calls
