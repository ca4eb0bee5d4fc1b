"""Speed and memory of nanoPO's generation and training steps, measured in one process.

  python bench.py --model tiny                                   # CPU, seconds
  python bench.py --model qwen2.5-0.5b-shape --num_layers 4      # the 0.5B shape cut to 4 layers
  python bench.py --model qwen2.5-1.5b-shape --batch_sizes 256 --max_new_tokens 1024   # one GPU

--model: a directory, a Hub id or short name, `tiny`, or qwen2.5-0.5b-shape / qwen2.5-1.5b-shape (a
Qwen2 model of that size, random weights, a 151,665-id tokenizer built in code: nothing downloaded).

1. Generation, tok/s, for each N of --batch_sizes: the scripts' generate (nanopo) against
   model.generate (hf) on left-padded Countdown prompts (N/G prompts, each repeated G times),
   greedy and sampled (τ = 1), every completion max_new_tokens long or, with --lengths realistic,
   ended as real ones end (EndLikeCompletions). More --contenders: tools (tool turns on, none
   called: what enabling them costs), masked (the masked one-token step where generate runs the
   varlen one: the A/B of varlen_decode), separate (the one-token step's q, k, v and gate, up as
   separate products: the A/B of MergedProducts), compiled (--compile's model; its first call's
   seconds beside). On CUDA the share of the memory-bandwidth bound (bandwidth_bound).
2. --step_rows N: steps 4 and 6 of grpo.py, each prompt forwarded once per group (shared) against
   once per row (unshared) and one packed pass a micro-batch (packed); peak memory on CUDA.
3. --train_steps: one step of each script, phase by phase (its time/* metrics), the preflight's
   seconds and sizes, each phase's TFLOP/s, MFU and peak memory; --compile: after a step that compiles;
   the contenders no script chooses yet: --bf16_activations true, --head_precision bf16.
4. First, with no weights loaded: --sampler_rows N, generate's sampler op by op and whole (eager and
   --compile's); --attention_rows N, the one-token step's attention at each width; --decode_layers
   N, that step's kernels a layer, eager against --compile's; --update_layers N, the update's ops and
   their bytes a layer, activations fp32 against bf16 (bf16_activations).
5. --profile decode|grpo|dapo|ppo: instead of 1-3, each phase call under torch.profiler: wall and
   busy time, largest kernels, busy time by kind, FLOP/s, MFU, bytes/s, peak memory, host syncs.
Tables print as Markdown and go to --output (JSON) after every section. The figures, and the
alternatives tried and removed, are in docs/speed.md.
"""

import contextlib
import functools
import gc
import inspect
import json
import os
import re
import resource
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

import common
import dapo
import grpo
import ppo
from common import arg
from rewards import load_task

# The real Qwen2.5 configurations (config.json of Qwen/Qwen2.5-0.5B-Instruct and -1.5B-Instruct).
SHAPES = {
    "qwen2.5-0.5b-shape": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864),
    "qwen2.5-1.5b-shape": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, intermediate_size=8960),
}
LAYER_SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2)  # 1.5B's
QWEN_TOKENIZER_SIZE = 151665  # ids the Qwen2.5 tokenizer has; its embedding has 151936 rows


@dataclass
class Args:
    model: str = arg("tiny", "tiny, a directory, a Hub id, qwen2.5-0.5b-shape or qwen2.5-1.5b-shape")
    num_layers: int = arg(0, "keep only the first layers of the model (CPU speed); 0 = all")
    batch_sizes: str = arg("1,16,64,256", "N, completions generated at once, comma-separated; '' = none")
    group_size: int = arg(8, "G: each prompt repeated G times in a row (fewer when N < G)")
    max_new_tokens: int = arg(64, "every completion is forced to this length (--lengths fixed), or its cap")
    lengths: str = arg("fixed", "fixed: every completion max_new_tokens long; realistic: most short, 10% at the cap")
    repeats: int = arg(3, "repetitions per contender; the median is reported")
    modes: str = arg("greedy,sampled", "greedy (τ = 0) and/or sampled (τ = 1)")
    contenders: str = arg(
        "nanopo,hf", "nanopo (generate), hf (model.generate), tools, masked, separate, compiled (the docstring)"
    )
    step_rows: int = arg(0, "N of the steps 4 + 6 comparison (--lengths decides the lengths); 0 = skip it")
    shots: int = arg(0, "worked examples in each Countdown prompt of the steps 4 + 6 comparison (longer prompts)")
    micro_batch_size: int = arg(4, "rows per forward and backward in the steps 4 + 6 comparison's step 6")
    logprob_chunk_size: int = arg(8, "rows per scoring pass in the steps 4 + 6 comparison's step 4")
    countdown_numbers: str = arg("3-4", "numbers per Countdown problem in the steps 4 + 6 comparison's prompts")
    train_steps: str = arg("grpo,dapo,ppo", "scripts whose training step is timed; '' = none")
    train_batch_size: int = arg(2, "B of the training step")
    sampler_rows: int = arg(0, "N of the sampler's ops timed alone on (N, 151,665) logits; 0 = skip")
    attention_rows: int = arg(0, "N of the one-token step's attention timed alone, per variant and width; 0 = skip")
    decode_layers: int = arg(0, "the one-token step's kernels a layer, eager against --compile's (this many layers)")
    update_layers: int = arg(0, "the update's ops and bytes a layer, fp32 activations against bf16 (this many layers)")
    profile: str = arg("", "decode, grpo, dapo or ppo (comma-separated): each phase under torch.profiler; '' = none")
    profile_phases: str = arg(
        "", "the phases --profile profiles: generate+reward, logprobs, values, update, critic update"
    )
    tool_rows: int = arg(0, "N of the tools beside the decode: each row calls a tool at its first token; 0 = skip")
    tool_sleep: float = arg(1.0, "seconds each --tool_rows call sleeps, against an instant tool")
    tool_workers: str = arg("1,32", "--tool_workers of the --tool_rows runs, comma-separated")
    peak_tflops: float = arg(0.0, "the device's peak for MFU; 0 = from PEAK_BF16_TFLOPS by GPU name (none on CPU)")
    gradient_checkpointing: bool = arg(
        False, "the training steps with gradient checkpointing (ppo.py on one 80 GB GPU)"
    )
    compile: bool = arg(False, "--compile's model in the training steps (after a step that compiles), --profile decode")
    bf16_activations: bool = arg(False, "the training steps' models with common.bf16_activations (issue 58's lever 4)")
    head_precision: str = arg("tf32", "the training steps' LM head GEMMs on a GPU: tf32 (the scripts'), bf16 (inputs)")
    model_dir: str = arg(
        "", "the shapes' random model, written once and loaded after; '' = $NANOPO_CACHE/bench-<shape>"
    )
    device: str = arg("auto", "auto, cpu, cuda")
    dtype: str = arg("auto", "auto (bf16 autocast on GPU, fp32 on CPU), bfloat16, float32")
    output: str = arg("bench.json", "where the tables go, as JSON")


def qwen_sized_tokenizer(size: int = QWEN_TOKENIZER_SIZE):
    """A byte-level BPE tokenizer with as many ids as Qwen2.5's and its ChatML special tokens, built in
    a second: the 256 byte symbols, then byte pairs and triples as merges, until there are `size` ids.
    It splits text otherwise than Qwen's; a benchmark needs the vocabulary's width and real ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = {symbol: i for i, symbol in enumerate(alphabet)}, []
    pairs = [(a, b) for a in alphabet for b in alphabet]
    for left, right in pairs + [(a + b, c) for a, b in pairs for c in alphabet]:
        if len(vocab) == size - len(special):
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(special)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=common.CHATML_TEMPLATE
    )
    tokenizer.chat_template = common.CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def default_model_dir(shape: str, num_layers: int = 0) -> Path:
    root = Path(os.environ.get("NANOPO_CACHE", Path.home() / ".cache" / "nanopo"))
    return root / (f"bench-{shape}" + (f"-{num_layers}l" if num_layers else ""))


def shape_directory(args: Args, device) -> Path:
    """The directory of --model's shape (random weights in bf16, the 151,665-id tokenizer), written
    once, on `device` (a 1.5B model initialised on the CPU takes minutes), beside the target and
    renamed into place; every later run and the training scripts read it."""
    directory = Path(args.model_dir) if args.model_dir else default_model_dir(args.model, args.num_layers)
    if (directory / "config.json").exists():
        return directory
    start = time.perf_counter()
    torch.manual_seed(0)
    tokenizer = qwen_sized_tokenizer()
    stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    shape = dict(SHAPES[args.model], num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    shape |= dict(eos_token_id=stop[0], pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if args.num_layers:
        shape["num_hidden_layers"] = args.num_layers
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    writing = directory.with_name(f"{directory.name}.writing-{os.getpid()}")
    model.to(torch.bfloat16).save_pretrained(writing)
    tokenizer.save_pretrained(writing)
    GenerationConfig(eos_token_id=stop, pad_token_id=tokenizer.pad_token_id).save_pretrained(writing)
    del model
    try:
        writing.rename(directory)
    except OSError:  # another run wrote it first
        shutil.rmtree(writing, ignore_errors=True)
    print(f"{args.model}: built on {device} and written to {directory} in {time.perf_counter() - start:.1f} s")
    return directory


def bench_directory(args: Args, device) -> str:
    """What train(--model) loads: the shape's directory, the tiny model's, or --model itself."""
    if args.model in SHAPES:
        return str(shape_directory(args, device))
    return str(common.build_tiny_model()) if args.model == "tiny" else args.model


def load_bench_model(args: Args, device, dtype):
    """(model, tokenizer, vocab_size, model directory for the training scripts)."""
    directory = bench_directory(args, device)
    model, tokenizer, _ = common.load_model(directory if args.model in SHAPES else args.model, device, dtype)
    if args.num_layers and args.model not in SHAPES:
        model.model.layers = model.model.layers[: args.num_layers]
        model.config.num_hidden_layers = args.num_layers
    return model.eval(), tokenizer, len(tokenizer), directory


def prompts(tokenizer, num_rows: int, group_size: int, device, shots: int = 0, numbers: str = "3-4"):
    """Countdown prompts (shots worked examples, problems of `numbers` numbers), left padded, each
    repeated G times: (N, P) ids and mask."""
    task = load_task(
        "countdown", seed=0, num_problems=max(1, -(-num_rows // group_size)), shots=shots, countdown_numbers=numbers
    )
    conversations = [task.messages(problem) for problem in task.problems]
    ids, mask = grpo.encode_prompts(tokenizer, conversations, group_size, device)
    return ids[:num_rows], mask[:num_rows]


def timed(function, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    function()
    synchronize(device)
    return time.perf_counter() - start


MEDIAN_SHARE = 0.3  # --lengths realistic: the median completion is this share of max_new_tokens


def end_probability(max_new_tokens: int) -> float:
    """The per-token EOS probability h of --lengths realistic: P(length > m) = (1 − h)^m, so the
    median is MEDIAN_SHARE·max_new_tokens and 2^(−1/MEDIAN_SHARE) ≈ 10% of rows reach the cap."""
    return 1 - 0.5 ** (1 / (MEDIAN_SHARE * max_new_tokens))


def expected_length(max_new_tokens: int) -> float:
    """E[min(L, max_new_tokens)] for L geometric with end_probability: Σ_{m<M} (1 − h)^m."""
    keep = 1 - end_probability(max_new_tokens)
    return (1 - keep**max_new_tokens) / (1 - keep)


class EndLikeCompletions:
    """A forward hook that ends completions as real ones end, whoever decodes: each row's last logits
    get EOS forced (+1e4) with probability end_probability, else forbidden (−1e4). The draw hashes the
    row's last token and position, so a row reading the same tokens ends at the same step in every
    contender, however they batch, order or drop rows."""

    def __init__(self, model, eos_id: int, max_new_tokens: int):
        self.eos_id, self.probability = eos_id, end_probability(max_new_tokens)
        self.handle = model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output):
        token = kwargs["input_ids"][:, -1].long()  # (n,)
        if kwargs.get("position_ids") is not None:
            position = kwargs["position_ids"][:, -1].long()
        else:  # model.generate may leave the positions to the model: they count the unmasked tokens
            position = kwargs["attention_mask"].long().sum(-1) - 1
        mixed = (token * 1_000_003 + position * 7919 + 12345) * 2654435761 % 2**32  # (n,) a hash
        ends = (mixed.double() / 2**32) < self.probability  # (n,)
        logits = output.logits  # (n, q, V)
        logits[:, -1, self.eos_id] = torch.where(ends, 1e4, -1e4).to(logits.dtype)
        return output


def bench_generation(args, model, tokenizer, vocab_size, device, amp, compute_dtype) -> list[dict]:
    rows, length = [], args.max_new_tokens
    pad = tokenizer.pad_token_id
    realistic = args.lengths == "realistic"
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")] if realistic else []
    ender = EndLikeCompletions(model, eos[0], length) if realistic else None
    tokens_per_row = expected_length(length) if realistic else length
    ending = dict(min_new_tokens=1, eos_token_id=eos[0]) if realistic else dict(min_new_tokens=length)
    for num_rows in [int(n) for n in args.batch_sizes.split(",") if n]:
        prompt_ids, prompt_mask = prompts(tokenizer, num_rows, args.group_size, device)
        for mode in args.modes.split(","):
            temperature = 0.0 if mode == "greedy" else 1.0
            sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if temperature > 0 else {}
            hf_config = GenerationConfig(max_new_tokens=length, pad_token_id=pad, **ending, **sampling)
            inputs = (model, prompt_ids, prompt_mask, length, eos, pad, vocab_size, temperature)
            contenders = {
                "nanopo": functools.partial(grpo.generate, *inputs),
                "hf": functools.partial(
                    model.generate, input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=hf_config
                ),
                # tools on (the scripts' default limits), no call made: each turn's end asks the host
                "tools": functools.partial(
                    grpo.generate, *inputs, tool_turn=lambda row, ids: None, max_turns=4, max_tool_tokens=256
                ),
                # the masked one-token step where generate would run varlen_decode_attention (a GPU, bf16)
                "masked": functools.partial(replaced, "varlen_decode", lambda model, cache: False, *inputs),
                "separate": functools.partial(replaced, "MERGED", (), *inputs),  # no group merged
                "compiled": functools.partial(compiled_generate, *inputs),
            }
            chosen = args.contenders.split(",")
            seconds, first = {name: [] for name in chosen}, {}
            with amp():
                for name in dict.fromkeys([chosen[0], *(["compiled"] if "compiled" in chosen else [])]):
                    first[name] = timed(contenders[name], device)  # warm-up: allocations, kernels picked, compiling
                for _ in range(args.repeats):
                    for name in chosen:  # interleaved, so a slow spell of a shared machine hits all alike
                        seconds[name].append(timed(contenders[name], device))
            row = {"N": num_rows, "P": prompt_ids.shape[1], "mode": mode, "lengths": args.lengths}
            for name in chosen:
                row[f"{name} tok/s"] = num_rows * tokens_per_row / statistics.median(seconds[name])
            for name in chosen[1:]:
                row[f"{chosen[0]}/{name}"] = row[f"{chosen[0]} tok/s"] / row[f"{name} tok/s"]
            if "compiled" in first:  # compiling (the blocks, the one-token step, the sampler) and one call
                row["compiled first call s"] = first["compiled"]
            if device.type == "cuda" and "nanopo" in chosen:
                context = prompt_ids.shape[1] + length // 2  # the mean over the decode steps
                element = 2 if compute_dtype == torch.bfloat16 else next(model.parameters()).element_size()
                row |= bandwidth_bound(model, num_rows, context, row["nanopo tok/s"], device, element)
            rows.append(row)
            print(row, flush=True)
    if ender is not None:
        ender.handle.remove()
    return rows


def bench_tools(args, model, tokenizer, vocab_size, device, amp) -> list[dict]:
    """--tool_rows N rows each end their first turn at their first token with a call: a tool that sleeps
    --tool_sleep s, run by each --tool_workers, against an instant one; the seconds of generate it adds.
    The other rows decode on while one waits; 32 rows × 1 s should add about 1 s with 32 workers."""
    prompt_ids, prompt_mask = prompts(tokenizer, args.tool_rows, args.group_size, device)
    ends = list(range(vocab_size))  # every token ends a turn: each row calls at its first
    inputs = (model, prompt_ids, prompt_mask, args.max_new_tokens, ends, tokenizer.pad_token_id, vocab_size, 1.0)
    rows = []
    for workers in [int(n) for n in args.tool_workers.split(",")]:
        seconds = {}
        for sleep in (0.0, args.tool_sleep):
            with ThreadPoolExecutor(workers) as pool:  # rewards.tool_turns' way: Futures from a pool
                turns = set()  # the rows that have called: a row's second turn calls nothing, and it ends

                def tool_turn(row, ids, sleep=sleep, pool=pool, turns=turns):
                    answer = [tokenizer.pad_token_id] * 4
                    return None if row in turns or turns.add(row) else pool.submit(lambda: time.sleep(sleep) or answer)

                run = functools.partial(grpo.generate, *inputs, tool_turn=tool_turn, max_turns=1, max_tool_tokens=4)
                with amp():
                    seconds[sleep] = timed(run, device)
        added = seconds[args.tool_sleep] - seconds[0.0]
        row = {"N": args.tool_rows, "tool_workers": workers, "instant s": seconds[0.0], "added s": added}
        rows.append(row | {f"{args.tool_sleep:g} s tool s": seconds[args.tool_sleep]})
        print(row, flush=True)
    return rows


def bench_steps_4_and_6(args, model, tokenizer, vocab_size, device, amp) -> list[dict]:
    """Steps 4 and 6 of grpo.py on N = step_rows rows (random completion tokens, lengths as --lengths
    draws them): the reference's scoring (sequence_logprobs) and policy_backward, each prompt forwarded
    once per group (`shared`), once per row (`unshared`, share=False), and packed (`packed`:
    common.packed_completions, one pass of a micro-batch's real tokens); peak memory on CUDA."""
    num_rows, length = args.step_rows, args.max_new_tokens
    prompt_ids, prompt_mask = prompts(tokenizer, num_rows, args.group_size, device, args.shots, args.countdown_numbers)
    generator = torch.Generator().manual_seed(0)
    if args.lengths == "realistic":
        uniform = torch.rand(num_rows, generator=generator)
        lengths = (uniform.log() / torch.tensor(1 - end_probability(length)).log()).long().add(1).clamp(max=length)
        lengths[0] = length  # one row at the cap
    else:
        lengths = torch.full((num_rows,), length)
    mask = (torch.arange(length)[None] < lengths[:, None]).long().to(device)
    ids = torch.randint(0, vocab_size, (num_rows, length), generator=generator).to(device) * mask
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": ids, "completion_mask": mask}
    batch |= {"sample_logp": torch.zeros(num_rows, length, device=device), "old_logp": None, "ref_logp": None}
    batch |= {"advantages": torch.randn(num_rows, generator=generator).to(device)}
    grpo_args = grpo.Args(
        max_new_tokens=length, logprob_chunk_size=args.logprob_chunk_size, micro_batch_size=args.micro_batch_size
    )
    model.train()
    sequences = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]

    def step_4():
        with torch.no_grad(), amp():
            batch["ref_logp"], _ = grpo.sequence_logprobs(model, *sequences, 1.0, vocab_size, args.logprob_chunk_size)

    def step_6():
        grpo.policy_backward(model, batch, grpo_args, vocab_size, amp)  # (totals, recorded): unused
        model.zero_grad(set_to_none=True)

    versions = {
        name: functools.partial(common.forward_completions, share=name == "shared") for name in ("shared", "unshared")
    }
    versions["packed"] = common.packed_completions  # one pass a micro-batch, no padding (the contender)
    seconds = {(name, phase): [] for name in versions for phase in ("4", "6")}
    peaks = {}
    for name in versions:  # warm-up, and on CUDA each version's peak memory
        with swapped("forward_completions", versions[name]):
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            step_4(), step_6()
            if device.type == "cuda":
                peaks[name] = torch.cuda.max_memory_allocated(device) / 2**30
    for _ in range(args.repeats):  # the versions take turns within each repetition
        for name in versions:
            with swapped("forward_completions", versions[name]):
                seconds[(name, "4")].append(timed(step_4, device))
                seconds[(name, "6")].append(timed(step_6, device))
    model.eval()
    row = {"N": num_rows, "G": args.group_size, "P": prompt_ids.shape[1]}
    row |= {"mean prompt": prompt_mask.sum(-1).float().mean().item(), "lengths": args.lengths}
    row["mean length"] = lengths.float().mean().item()
    for name in versions:
        step_4_s, step_6_s = (statistics.median(seconds[(name, phase)]) for phase in ("4", "6"))
        row |= {f"{name} step 4 s": step_4_s, f"{name} step 6 s": step_6_s, f"{name} 4+6 s": step_4_s + step_6_s}
        row |= {f"{name} peak GiB": peaks[name]} if peaks else {}
    row["unshared/shared"] = row["unshared 4+6 s"] / row["shared 4+6 s"]
    row["packed/shared"] = row["packed 4+6 s"] / row["shared 4+6 s"]
    print(row, flush=True)
    return [row]


def copy_bandwidth(device, mebibytes: int = 256) -> float:
    """Bytes per second a copy moves (read + written), the median of 10 copies of `mebibytes`."""
    source = torch.empty(mebibytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    copy_seconds = statistics.median(timed(lambda: target.copy_(source), device) for _ in range(10))
    return 2 * source.numel() / copy_seconds


def bandwidth_bound(model, num_rows: int, context: int, tokens_per_s: float, device, element_bytes: int) -> dict:
    """A decode step reads every weight once and the KV cache of every row: at the mean context,
    bytes/step = weights + N · context · layers · 2 (K, V) · kv heads · head dim · bytes. At the
    measured copy bandwidth the fastest possible step takes bytes/step ÷ bandwidth."""
    config = model.config
    weights = sum(p.numel() for p in model.parameters()) * element_bytes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = num_rows * context * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element_bytes
    bandwidth = copy_bandwidth(device)
    bound = num_rows * bandwidth / (weights + kv)  # tokens/s
    arithmetic = (
        f"({weights / 1e9:.2f} GB weights + {kv / 1e9:.2f} GB KV at context {context}) / "
        f"{bandwidth / 1e9:.0f} GB/s = {1e3 * (weights + kv) / bandwidth:.2f} ms/step; "
        f"bound {bound:.0f} tok/s for N = {num_rows}"
    )
    print(arithmetic)
    return {"bound tok/s": bound, "of bound": tokens_per_s / bound, "bound arithmetic": arithmetic}


def bench_sampler(num_rows: int, vocab_size: int, device, calls: int = 20) -> list[dict]:
    """generate's sampler outside its captured step (τ ≠ 1, top-p 1) on (N, V) fp32 logits: each op
    alone, ms a call over `calls` calls (its inputs made beforehand); then the whole sampler, eager
    (grpo.sample) and as --compile compiles it (compiled_for), in turn, the median of `calls`."""
    cuda = device.type == "cuda"
    temperature = 0.7
    logits = torch.randn(num_rows, vocab_size, device=device) * 4  # (N, V)
    scaled = logits / temperature
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (N, 1)
    logp = scaled - lse
    noise = torch.empty_like(scaled).exponential_()
    log_noise = noise.log()
    keys = logp - log_noise  # (N, V)
    token = keys.argmax(dim=-1)  # (N,)

    def rng_state():
        return torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()

    def sampler():  # generate's sampled branch, as its text runs it
        rng_state()
        return grpo.sample(logits / temperature, 1.0)

    parts = {
        "the random generator's state, kept per token": rng_state,
        "scale: logits / τ": lambda: logits / temperature,
        "logsumexp": lambda: torch.logsumexp(scaled, dim=-1, keepdim=True),
        "the check that it is finite": lambda: torch._assert_async(lse.isfinite().all()),
        "log-probs: scaled − logsumexp": lambda: scaled - lse,
        "noise: E ~ Exp(1)": lambda: torch.empty_like(scaled).exponential_(),
        "log E": lambda: noise.log(),
        "log-probs − log E": lambda: logp - log_noise,
        "argmax": lambda: keys.argmax(dim=-1),
        "the token's log-prob (gather)": lambda: logp.gather(-1, token[:, None]),
    }
    rows = []
    for name, part in parts.items():
        part()  # warm-up
        seconds = timed(functools.partial(repeat_calls, part, calls), device)
        rows.append({"part": name, "N": num_rows, "V": vocab_size, "ms a call": 1000 * seconds / calls})
    # in turn, so that a slow spell of a shared machine hits both alike
    compiled = torch.compile(grpo.sample, dynamic=True, options={"fallback_random": True})  # compiled_for's
    compiled(logits / temperature, 1.0)  # it compiles
    whole = {
        "the whole sampler, as generate (sample)": sampler,
        "--compile's (compiled_for: sample through TorchInductor)": lambda: compiled(logits / temperature, 1.0),
    }
    seconds = {name: [] for name in whole}
    for _ in range(calls):
        for name, function in whole.items():
            seconds[name].append(timed(function, device))
    for name, times in seconds.items():
        rows.append({"part": name, "N": num_rows, "V": vocab_size, "ms a call": 1000 * statistics.median(times)})
    return rows


@contextlib.contextmanager
def swapped(name: str, value):
    """`name` bound to `value` while inside, in common and in every script that binds it (a script
    may import a runtime name that common's own functions look up in common); then as it was."""
    modules = [module for module in (common, *SCRIPTS.values()) if hasattr(module, name)]
    if not modules:
        raise AttributeError(f"{name}: neither common nor a script has it")
    originals = [getattr(module, name) for module in modules]
    for module in modules:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            setattr(module, name, original)


def replaced(name: str, candidate, *inputs, **settings):
    """grpo.generate(*inputs, **settings) with the function `name` replaced by `candidate` for the call
    (the captured graphs hold the candidate). The contender `masked`: varlen_decode answering no."""
    with swapped(name, candidate):
        return grpo.generate(*inputs, **settings)


def compiled_generate(model, *inputs, **settings):
    """grpo.generate(model, *inputs, **settings) with the model as --compile makes it (common.compile_blocks:
    its blocks, its one-token step and its sampler compiled), for the call alone; then as it was.
    dynamo keeps what it compiled: a later call compiles nothing."""
    plain = [module for module in model.modules() if "forward" not in module.__dict__]
    common.compile_blocks(model)
    try:
        return grpo.generate(model, *inputs, **settings)
    finally:
        for module in plain:
            module.__dict__.pop("forward", None)
        common.DECODE_BACKBONES.pop(model, None)


def attention_shape(args: Args, device) -> tuple:
    """(text config, --attention_rows, prompt length) from the model's config and tokenizer alone."""
    from transformers import AutoConfig, AutoTokenizer

    directory = bench_directory(args, device)
    config = AutoConfig.from_pretrained(directory).get_text_config()
    if args.num_layers:
        config.num_hidden_layers = args.num_layers
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return config, args.attention_rows, prompts(tokenizer, args.attention_rows, args.group_size, device)[0].shape[1]


def bench_attention(config, num_rows: int, prompt_length: int, max_new_tokens: int, device, amp, dtype, calls=20):
    """The one-token step's attention, one layer's call, at each width of decode_widths: the masked SDPA
    call, the varlen flash call generate runs on a GPU in bf16, and SDPA without a mask. ms a call, GB/s
    of keys and values read, ms a step (× layers), max |Δ| against float64."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    generator = torch.Generator(device).manual_seed(0)
    length = prompt_length + max_new_tokens
    query = torch.randn(num_rows, heads, 1, head_dim, device=device, generator=generator).to(dtype)
    key = torch.randn(num_rows, kv_heads, length, head_dim, device=device, generator=generator).to(dtype)
    value = torch.randn(num_rows, kv_heads, length, head_dim, device=device, generator=generator).to(dtype)
    padding = torch.arange(num_rows, device=device)[:, None] % 8  # (n, 1) left padding of 0-7 columns
    columns = torch.arange(length, device=device)  # (S,)
    variants = ("sdpa, masked (generate's masked step)", "flash varlen (generate's in bf16)", "sdpa, no mask")
    rows, widths = [], common.decode_widths(prompt_length, max_new_tokens)
    for previous, width in zip([prompt_length, *widths], widths):
        filled = (previous + width) // 2 + 1  # halfway through the width's tokens
        visible = (columns[:width] >= padding) & (columns[:width] < filled)  # (n, W)
        mask = torch.where(visible, 0.0, -1e30)[:, None, None, :]  # (n, 1, 1, W) fp32
        k, v = key[:, :, :width], value[:, :, :width]
        scores = torch.einsum("nkgd,nksd->nkgs", query.double().reshape(num_rows, kv_heads, -1, head_dim), k.double())
        scores = scores * head_dim**-0.5 + mask.double()
        expected = torch.einsum("nkgs,nksd->nkgd", scores.softmax(-1), v.double()).reshape(num_rows, 1, heads, head_dim)
        read = num_rows * kv_heads * width * head_dim * 2 * key.element_size()
        shift = (columns + padding).clamp(max=length - 1)[:, None, :, None]  # (n, 1, S, 1) left-aligned
        left = [c.gather(2, shift.expand_as(c)).transpose(1, 2).contiguous().transpose(1, 2) for c in (key, value)]
        used, starts = visible.sum(-1, dtype=torch.int32), torch.arange(num_rows + 1, dtype=torch.int32).to(device)
        calls_of = {
            variants[0]: functools.partial(common.grouped_decode_attention, None, query, k, v, mask, head_dim**-0.5),
            variants[1]: functools.partial(
                common.varlen_decode_attention, None, query, *left, None, head_dim**-0.5, used=used, starts=starts
            ),
            variants[2]: functools.partial(common.grouped_decode_attention, None, query, k, v, None, head_dim**-0.5),
        }
        for name, call in calls_of.items():
            row = {"variant": name, "N": num_rows, "width": width}
            with amp():
                try:
                    output = call()[0]  # warm-up
                except (RuntimeError, NotImplementedError) as error:  # the CPU has no varlen flash kernel
                    rows.append(row | {"refused": str(error).strip().split(". ")[0]})
                    continue
                run, row["timed"] = call, "eager"
                if device.type == "cuda":
                    try:
                        run, row["timed"] = common.cuda_graph(call), "graph replay"
                    except RuntimeError as error:
                        row["timed"] = f"eager (capture failed: {str(error).strip()[:80]})"
                seconds = timed(functools.partial(repeat_calls, run, calls), device) / calls
            row |= {"ms a call": 1000 * seconds, "GB/s": read / seconds / 1e9}
            row |= {"ms a step": 1000 * seconds * config.num_hidden_layers}
            if name != variants[2]:
                row["max |Δ| vs fp64"] = (output.double() - expected).abs().max().item()
            rows.append(row)
    return rows


def repeat_calls(function, calls: int) -> None:
    for _ in range(calls):
        function()


PHASES = (("generate+reward", "rollout"), ("logprobs", "old_and_ref_logprobs"), ("values", "critic_values"),
          ("update", "policy_backward"), ("critic update", "critic_backward"))  # fmt: skip
SCRIPTS = {"grpo": grpo, "dapo": dapo, "ppo": ppo}


@contextlib.contextmanager
def phases_wrapped(script, around):
    """script's phase functions (PHASES) replaced, while inside, by around(phase, original, ...); a phase
    called within another (critic_backward calls critic_values) counts as the outer one's."""
    originals, inside = {}, []
    for phase, name in PHASES:
        if not hasattr(script, name):
            continue
        originals[name] = getattr(script, name)

        def wrapped(*a, _phase=phase, _function=originals[name], **k):
            if inside or common.IN_PREFLIGHT.get():  # the preflight's passes are not the step's phases
                return _function(*a, **k)
            inside.append(_phase)
            try:
                return around(_phase, _function, *a, **k)
            finally:
                inside.pop()

        setattr(script, name, wrapped)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(script, name, original)


@contextlib.contextmanager
def no_final_checkpoint():
    """A benchmark's step writes no final/ checkpoint (~20 GB at the 1.5B shape)."""
    saved = common.Run.save_final
    common.Run.save_final = lambda self: None
    try:
        yield
    finally:
        common.Run.save_final = saved


@contextlib.contextmanager
def with_bf16_activations(on: bool = True):
    """Within it (--bf16_activations) the models a script loads get common.bf16_activations: the policy, the
    reference and PPO's critic's backbone."""
    policy, reference, critic = common.load_policy, common.load_reference, ppo.load_critic

    def load_policy(*args, **settings):
        model, *rest = policy(*args, **settings)
        return common.bf16_activations(model), *rest

    def load_reference(*args, **settings):
        return common.bf16_activations(reference(*args, **settings))

    def load_critic(*args, **settings):
        loaded = critic(*args, **settings)
        common.bf16_activations(loaded.backbone)
        return loaded

    with contextlib.ExitStack() as stack:
        for loader in (load_policy, load_reference, load_critic) if on else ():
            stack.enter_context(swapped(loader.__name__, loader))
        yield


def one_step(args, name: str, directory: str) -> dict:
    """One training step of script `name`: its last metrics row, the sizes it ran with (`sized`, as the
    preflight set them) and the preflight's seconds (in no time/* metric)."""
    script = SCRIPTS[name]
    settings = dict(model=directory, max_steps=1, batch_size=args.train_batch_size, group_size=args.group_size)
    settings |= dict(max_new_tokens=args.max_new_tokens, device=args.device, dtype=args.dtype, save_every=0)
    settings |= dict(gradient_checkpointing=args.gradient_checkpointing, compile=args.compile)
    settings |= {"overlong_buffer": 0, "dynamic_sampling": False} if script is dapo else {}
    settings |= {"num_mini_batches": 1} if script is ppo and args.train_batch_size * args.group_size < 4 else {}
    run_args, sizing, seconds = script.Args(**settings), common.size_micro_batches, []

    def timed_sizing(*a, **k):  # the preflight (on a GPU; on the CPU the rows it sets), timed
        start = time.perf_counter()
        sizing(*a, **k)
        seconds.append(time.perf_counter() - start)

    head = args.head_precision
    if head not in ("tf32", "bf16"):
        raise SystemExit(f"--head_precision {head}: tf32 (the scripts') or bf16 (common.HEAD_PRECISION's contender)")
    common.size_micro_batches = timed_sizing
    try:
        lever = with_bf16_activations(args.bf16_activations)
        with tempfile.TemporaryDirectory() as output, no_final_checkpoint(), lever, swapped("HEAD_PRECISION", head):
            run_args.output_dir = output
            run_dir = script.train(run_args)
            metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    finally:
        common.size_micro_batches = sizing
    sizes = ("micro_batch_size", "micro_batch_tokens", "logprob_chunk_size", "logprob_chunk_tokens")
    return metrics | {"sized": {name: getattr(run_args, name) for name in sizes}, "preflight s": sum(seconds)}


def compiled_first(args, name: str, directory: str, device) -> dict:
    """--compile: one step first, which compiles (dynamo's cache outlives its models, so the measured
    step runs what it compiled); its models freed before the measured step's preflight. Returns its
    time/* metrics as `compiling …` and, with its preflight, `compiling step s`."""
    if not args.compile:
        return {}
    metrics = one_step(args, name, directory)
    gc.collect()  # a compiled block refers to itself: the cyclic collector frees its model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    phases = {f"compiling {k}": v for k, v in metrics.items() if k.startswith("time/")}
    return phases | {"compiling step s": sum(phases.values()) + metrics["preflight s"]}


def bench_training(args, directory: str, device, rows: list, save=lambda: None) -> list[dict]:
    """One step of each script: its time/* metrics, and per phase (each call timed between two
    synchronisations, no profiler) peak memory, TFLOP/s and MFU, its FLOPs as --profile computes them.
    A row is appended to `rows` and saved as each script finishes."""
    weight_dtype, compute_dtype = common.resolve_precision(args.dtype, device)
    element_bytes = (compute_dtype or weight_dtype).itemsize
    peak, _ = peak_flops(args, device)
    for name in [s for s in args.train_steps.split(",") if s]:
        peaks, work = {}, {}  # phase -> GB; phase -> [seconds, FLOPs]

        def measured(phase, function, *a, _peaks=peaks, _work=work, **k):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            synchronize(device)
            start = time.perf_counter()
            result = function(*a, **k)
            synchronize(device)
            seconds = time.perf_counter() - start
            if device.type == "cuda":
                _peaks[phase] = max(_peaks.get(phase, 0), torch.cuda.max_memory_allocated(device) / 1e9)
            total = _work.setdefault(phase, [0.0, 0])
            total[0] += seconds
            total[1] += call_work(phase, function, a, k, result, element_bytes)[0]
            return result

        compiling = compiled_first(args, name, directory, device)
        with phases_wrapped(SCRIPTS[name], measured):
            metrics = one_step(args, name, directory)
        row = {"script": name, **{k: v for k, v in metrics.items() if k.startswith("time/")}}
        row["time/* summed"] = sum(v for k, v in row.items() if k.startswith("time/"))
        row |= compiling
        row["preflight s"] = metrics["preflight s"]
        row |= {k: v for k, v in metrics.items() if k.startswith("policy/sample_logp_diff")}  # sampler vs trainer
        row |= {name: size for name, size in metrics["sized"].items() if size}
        for phase, (seconds, flops) in work.items():
            row[f"TFLOP/s {phase}"] = flops / seconds / 1e12
            if peak:
                row[f"MFU {phase}"] = flops / seconds / peak
        if device.type == "cuda":
            row |= {f"peak GB {phase}": value for phase, value in peaks.items()}
        else:
            row["peak RSS GB (process)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        rows.append(row)
        save()
        print(row, flush=True)
    return rows


PRODUCTS = re.compile(r"mm|scaled_dot_product|embedding")  # the ops whose bytes Counted leaves out: GEMMs, attention


class Counted(TorchDispatchMode):
    """Counts the aten ops run within it (below autograd), how many of them are views, and the bytes the others
    read and write but for the products (PRODUCTS): the elementwise ops, norms, casts and copies."""

    def __init__(self):
        super().__init__()
        self.ops = self.views = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.views += func.is_view
        if not func.is_view and not PRODUCTS.search(func.__name__):
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def embedding_cast(model):
    """bf16_activations' first version (bf16_residual, 7e29984): under bf16 autocast, the embedding's output cast
    alone."""
    model.get_input_embeddings().register_forward_hook(lambda module, inputs, out: out.to(torch.bfloat16))
    return model


def bench_update_kernels(layers: int, device, rows: int = 4, tokens: int = 512) -> list[dict]:
    """A micro-batch's forward and backward under bf16 autocast (into gradients already there, as after the
    first), its ops and their bytes but the products' a layer, activations fp32 (the scripts) against bf16
    (common.bf16_activations, issue 58's lever 4; and its first version, embedding_cast), on a Qwen2 of the
    1.5B shape's layers: a layer is the difference between `layers` deep and one deep."""
    if layers < 2:
        raise SystemExit(f"--update_layers {layers}: at least 2 (a layer's count is the difference from one layer)")
    ids = torch.randint(3, 1024, (rows, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    table, levers = (
        [],
        {
            "fp32 (the scripts)": lambda model: model,
            "bf16, the embedding's cast alone": embedding_cast,
            "bf16 (bf16_activations)": common.bf16_activations,
        },
    )
    for name, lever in levers.items():
        counts = {}  # depth -> (ops, bytes)
        for depth in (1, layers):
            config = Qwen2Config(**LAYER_SHAPE, vocab_size=1024, num_hidden_layers=depth)
            model = lever(Qwen2ForCausalLM(config).to(device))
            with torch.autocast(device.type, dtype=torch.bfloat16):
                for counted in (contextlib.nullcontext(), Counted()):  # the first sets up outside the count
                    with counted:
                        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
            counts[depth] = counted.ops - counted.views, counted.bytes
        ops, nbytes = ((deep - shallow) / (layers - 1) for deep, shallow in zip(counts[layers], counts[1]))
        table.append({"activations": name, "ops a layer": ops, "MB a layer, products apart": nbytes / 1e6})
    return table


def bench_decode_kernels(layers: int, device, amp) -> list[dict]:
    """The one-token step's kernels a layer, eager against --compile's, on a Qwen2 of the 1.5B shape's
    layers, as on a GPU (its products merged): a layer is the difference between `layers` deep and one deep.
    And the eager ops generate runs a token around the step (the sampler, the EOS and column bookkeeping)."""
    from torch._inductor.utils import run_and_get_code
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if layers < 2:
        raise SystemExit(f"--decode_layers {layers}: at least 2 (a layer's count is the difference from one layer)")
    prompt = torch.randint(3, 1024, (8, 64), generator=torch.Generator().manual_seed(0)).to(device)
    calls = re.compile(r"^\s+(?:\w+\.run\(|cpp_fused_\w+\(|extern_kernels\.|buf\w+ = torch\.ops\.)", re.M)  # one a line
    counts, inside, step_call = {}, [], common.DecodeStep.__call__

    def counted_step(self, *args, **settings):  # a DecodeStep call, its ops counted apart too
        with Counted() as ops:
            out = step_call(self, *args, **settings)
        inside.append(ops.ops - ops.views)
        return out

    gpu = swapped("merges", lambda device: True)  # the step as on a GPU: its products merged
    with swapped("cuda_graph", lambda step, pool=None: step), gpu:  # on a GPU too, each step runs (is counted) once
        for depth in (1, layers):
            model = Qwen2ForCausalLM(Qwen2Config(**LAYER_SHAPE, vocab_size=1024, num_hidden_layers=depth)).to(device)
            inputs = (model, prompt, torch.ones_like(prompt))
            with torch.no_grad(), amp():
                grpo.generate(*inputs, 2, [], 0, 1024, 1.0)  # set-up outside the count
                eager = {}
                for tokens in (1, 2):  # 2 tokens: one more sampled, through one step
                    with Counted() as counted, mock.patch.object(common.DecodeStep, "__call__", counted_step):
                        inside.clear()
                        grpo.generate(*inputs, tokens, [], 0, 1024, 1.0)
                    eager[tokens] = counted.ops - counted.views
                _, code = run_and_get_code(compiled_generate, *inputs, 2, [], 0, 1024, 1.0)
            largest = max(len(calls.findall(text[text.index("def call(") :])) for text in code)  # the step
            counts[depth] = eager[2] - eager[1], largest, eager[2] - eager[1] - sum(inside)
    step = lambda i: (counts[layers][i] - counts[1][i]) / (layers - 1)  # noqa: E731
    row = {"layers": layers, "eager kernels a layer": step(0), "compiled kernels a layer": step(1)}
    return [row | {"eager ops a token around the step": counts[layers][2]}]


def markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for row in rows for k in row if k != "bound arithmetic"))
    cell = lambda v: (f"{v:.0f}" if v >= 100 else f"{v:.3g}") if isinstance(v, float) else str(v)  # noqa: E731
    return common.markdown_table([{k: cell(row.get(k, "")) for k in keys} for row in rows])


# ----------------------------------------------------------------------------------------
# --profile: where a phase's time goes, on any device


SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::masked_select"}
SYNC_OPS |= {"aten::equal"}  # and every aten::unique* and aten::_unique* (is_sync_op); not nonzero_static
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaFree")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperative", "cudaGraphLaunch")  # a graph: one launch
PHASE_RANGE = "bench.profiled"  # the record_function range around the phase's own call
# Dense bf16 peaks, from NVIDIA's datasheets (the figures "with sparsity" halved): H100 SXM5 and
# H200 989 TFLOP/s, H100 PCIe 756, A100 312. The H100 SXM5 is the "H100 80GB HBM3".
PEAK_BF16_TFLOPS = {"H100 80GB HBM3": 989, "H100 SXM": 989, "H200": 989, "H100 PCIe": 756, "A100": 312}


def model_shape(model, head_rows: int | None = None) -> dict:
    """What the FLOP and byte formulas read from a model: `body`, the parameters a token's forward pass
    multiplies by (not the embedding, nor the head, counted per scored position), all `parameters`, the
    attention's shape, d, and the head's rows (V; 1 for a critic's value head). MoE counts every expert."""
    config = model.config.get_text_config()
    head = model.get_output_embeddings()
    outside = {id(p) for m in (model.get_input_embeddings(), head) if m is not None for p in m.parameters()}
    heads = config.num_attention_heads
    shape = dict(body=sum(p.numel() for p in model.parameters() if id(p) not in outside))
    shape |= dict(parameters=sum(p.numel() for p in model.parameters()), layers=config.num_hidden_layers, heads=heads)
    shape |= dict(kv_heads=getattr(config, "num_key_value_heads", None) or heads)
    shape |= dict(head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, hidden=config.hidden_size)
    return shape | dict(head_rows=head_rows or head.weight.shape[0])


def token_counts(prompt_ids, prompt_mask, completion_mask, decode: bool = False) -> dict:
    """The positions one pass over a batch computes, as the scripts do: each distinct prompt once (p_g
    real tokens), then f_i completion tokens of row i; a token at position k attends to k + 1 keys.
      scoring: f_i = ℓ_i, scored = Σ ℓ_i (the head at the positions that predict the completion)
      decode: the prefill, then ℓ_i − 1 one-token steps: f_i = ℓ_i − 1, scored = B + Σ f_i
    tokens = Σ_g p_g + Σ_i f_i;  keys = Σ_g p_g(p_g + 1)/2 + Σ_i [f_i·p_i + f_i(f_i + 1)/2], the rows'
    part of it decode_keys; steps = max_i f_i. (N, P), (N, P), (N, T) -> ints."""
    prompt_ids, prompt_mask, completion_mask = (
        t.detach().cpu().long() for t in (prompt_ids, prompt_mask, completion_mask)
    )
    distinct = torch.unique(torch.cat([prompt_ids, prompt_mask], -1), dim=0)
    prompts = distinct[:, prompt_ids.shape[1] :].sum(-1)  # (B,) p_g
    rows, lengths = prompt_mask.sum(-1), completion_mask.sum(-1)  # (N,) p_i, ℓ_i
    fed = (lengths - 1).clamp(min=0) if decode else lengths  # (N,) f_i
    decode_keys = int((fed * rows + fed * (fed + 1) // 2).sum())
    return dict(
        tokens=int(prompts.sum() + fed.sum()),
        keys=int((prompts * (prompts + 1) // 2).sum()) + decode_keys,
        scored=int(fed.sum()) + (len(prompts) if decode else 0),
        steps=int(fed.max()) if len(fed) else 0,
        decode_keys=decode_keys,
    )


def forward_flops(shape: dict, counts: dict) -> int:
    """FLOPs of one forward pass: 2·body·tokens (the layers' products) + 4·layers·heads·head_dim·keys
    (q·k and p·v) + 2·d·head_rows·scored (the head). Elementwise work is not counted."""
    attention = 4 * shape["layers"] * shape["heads"] * shape["head_dim"] * counts["keys"]
    return (
        2 * shape["body"] * counts["tokens"] + attention + 2 * shape["hidden"] * shape["head_rows"] * counts["scored"]
    )


def phase_work(kind: str, shape: dict, batch, element_bytes: int, passes: int = 1, models: int = 1) -> tuple[int, int]:
    """(FLOPs, bytes) of a phase over `batch` = (prompt_ids, prompt_mask, completion_mask), weights =
    parameters · element_bytes:
      decode  forward_flops(decode); weights·(1 + steps) + decode_keys·layers·kv_heads·head_dim·2·bytes
      score   models · forward_flops; models · passes · weights
      train   3 · forward_flops (backward = 2 forwards; recomputation not counted); 3 · passes · weights
    The scoring and training bytes are a floor: activations are not counted."""
    counts = token_counts(*batch, decode=kind == "decode")
    flops = forward_flops(shape, counts)
    weights = shape["parameters"] * element_bytes
    if kind == "decode":
        column = shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2 * element_bytes
        return flops, weights * (1 + counts["steps"]) + counts["decode_keys"] * column
    if kind == "score":
        return models * flops, models * passes * weights
    return 3 * flops, 3 * passes * weights


def is_sync_op(name: str) -> bool:
    return name in SYNC_OPS or name.startswith(("aten::unique", "aten::_unique"))


def read_events(profiler) -> list[tuple]:
    """(name, on the device, start ns, end ns, thread) of each event, read from kineto's results (building
    torch's FunctionEvents costs far more: docs/speed.md); GPU mirrors of record_function ranges left out."""
    from torch.autograd import DeviceType

    return [
        (e.name(), e.device_type() != DeviceType.CPU, e.start_ns(), e.end_ns(), e.start_thread_id())
        for e in profiler.profiler.kineto_results.events()
        if not e.is_hidden_event() and not (e.device_type() != DeviceType.CPU and e.is_user_annotation())
    ]


def summarise(events: list[tuple], cuda: bool) -> dict:
    """From read_events: ops {name: (µs, calls)} (CUDA: device time; CPU: self time), busy s, and within
    the phase's range (PHASE_RANGE): host syncs (SYNC_OPS, aten::unique*), CUDA syncs and the host's wait
    in them, kernel launches (a graph's replay is one). An op whose only child has its name is one call."""
    ranges = [(start, end) for name, _, start, end, _ in events if name == PHASE_RANGE]
    inside = lambda start: any(low <= start <= high for low, high in ranges)  # noqa: E731
    ops, syncs, runtime, waited, launches, stack = {}, 0, 0, 0, 0, []
    # stack: [name, start, end, thread, children's ns, under a sync op, children, first child of its name]

    def add(name: str, ns: int, call: int = 1) -> None:
        total, calls = ops.get(name, (0.0, 0))
        ops[name] = (total + ns / 1e3, calls + call)

    def close(frame) -> None:
        if not cuda and frame[0] != PHASE_RANGE:
            add(frame[0], frame[2] - frame[1] - frame[4], int(frame[6] != 1 or not frame[7]))

    for name, on_device, start, end, thread in sorted(events, key=lambda e: (e[1], e[4], e[2], -e[3])):
        if on_device:
            if cuda and name != PHASE_RANGE:
                add(name, end - start)
            continue
        if inside(start) and name in CUDA_SYNCS:
            runtime, waited = runtime + 1, waited + end - start
        launches += name.startswith(LAUNCHES) and inside(start)
        while stack and (stack[-1][3] != thread or stack[-1][2] <= start):
            close(stack.pop())
        parent = stack[-1] if stack else None
        under = parent is not None and (parent[5] or is_sync_op(parent[0]) or parent[0] == "aten::_assert_async")
        syncs += is_sync_op(name) and not under and inside(start)
        if parent is not None:
            parent[4] += end - start
            parent[6] += 1
            parent[7] = parent[6] == 1 and parent[0] == name
        stack.append([name, start, end, thread, 0, under, 0, False])
    while stack:
        close(stack.pop())
    busy = sum(us for us, _ in ops.values()) / 1e6
    waits = {"CUDA syncs": runtime, "sync wait s": waited / 1e9, "launches": launches}
    return {"ops": ops, "busy s": busy, "host syncs": syncs, **waits}


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled(function, device):
    """function() under its own torch.profiler: (its result, {wall s (synchronised), summarise's
    measures, peak GB (CUDA: allocated; CPU: peak RSS), profiler s (reading the events, not in wall s)})."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        with record_function(PHASE_RANGE):
            result = function()
        synchronize(device)
        wall = time.perf_counter() - start
    measured = {"wall s": wall, **summarise(read_events(profiler), cuda)}
    peak = torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1e3
    measured["peak GB"] = peak / 1e9
    measured["profiler s"] = time.perf_counter() - start - wall
    return result, measured


def peak_flops(args, device) -> tuple[float | None, str]:
    """The FLOP/s MFU is measured against, and where the figure comes from."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"--peak_tflops {args.peak_tflops:g}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name}: {tflops} TFLOP/s dense bf16 (NVIDIA's datasheet)"
        return None, f"{name}: no peak known (--peak_tflops)"
    return None, "CPU: no peak (--peak_tflops)"


class Profiles:
    """--profile's measurements per (run, phase), calls summed, and the tables built from them, saved
    after every call."""

    def __init__(self, device, bandwidth: float, peak: float | None, report: dict, save):
        self.device, self.bandwidth, self.peak, self.report, self.save = device, bandwidth, peak, report, save
        self.phases = {}  # (run, phase) -> summed measurements

    def add(self, run: str, phase: str, measured: dict, flops: int, nbytes: int, tokens: int | None = None):
        total = self.phases.setdefault((run, phase), {"calls": 0, "flops": 0, "bytes": 0, "tokens": None, "ops": {}})
        total["calls"] += 1
        total["flops"] += flops
        total["bytes"] += nbytes
        if tokens is not None:
            total["tokens"] = (total["tokens"] or 0) + tokens
        for key in ("wall s", "busy s", "host syncs", "CUDA syncs", "sync wait s", "launches", "profiler s"):
            total[key] = total.get(key, 0) + measured[key]
        total["peak GB"] = max(total.get("peak GB", 0), measured["peak GB"])
        for name, (us, calls) in measured["ops"].items():
            before = total["ops"].get(name, (0.0, 0))
            total["ops"][name] = (before[0] + us, before[1] + calls)
        self.report["profile"] = [self.row(run, phase, t) for (run, phase), t in self.phases.items()]
        self.report["profile_top"] = [r for (run, phase), t in self.phases.items() for r in self.top(run, phase, t)]
        self.report["profile_kinds"] = [r for (run, phase), t in self.phases.items() for r in self.kinds(run, phase, t)]
        self.save()
        print(self.row(run, phase, total), flush=True)

    def row(self, run: str, phase: str, total: dict) -> dict:
        cuda, wall = self.device.type == "cuda", total["wall s"]
        row = {"run": run, "phase": phase, "calls": total["calls"], "wall s": wall}
        row["GPU busy s" if cuda else "CPU op s"] = total["busy s"]
        row["busy/wall"] = total["busy s"] / wall
        row |= {"TFLOP": total["flops"] / 1e12, "TFLOP/s": total["flops"] / wall / 1e12}
        row["MFU"] = total["flops"] / wall / self.peak if self.peak else ""
        row |= {"GB": total["bytes"] / 1e9, "GB/s": total["bytes"] / wall / 1e9}
        row["of bandwidth"] = total["bytes"] / wall / self.bandwidth
        row["tok/s"] = total["tokens"] / wall if total["tokens"] is not None else ""
        row["peak GB" if cuda else "peak RSS GB"] = total["peak GB"]
        row["host syncs"] = total["host syncs"]
        if cuda:
            row |= {key: total[key] for key in ("CUDA syncs", "sync wait s", "launches")}
        row["profiler s"] = total["profiler s"]
        return row

    def top(self, run: str, phase: str, total: dict, count: int = 10) -> list[dict]:
        busy = sum(us for us, _ in total["ops"].values()) or 1.0
        largest = sorted(total["ops"].items(), key=lambda item: -item[1][0])[:count]
        what = "kernel" if self.device.type == "cuda" else "CPU op"
        return [
            {"run": run, "phase": phase, "#": i + 1, what: name.replace("|", "/")[:100]}
            | {"ms": us / 1e3, "calls": calls, "of busy": us / busy}
            for i, (name, (us, calls)) in enumerate(largest)
        ]

    def kinds(self, run: str, phase: str, total: dict) -> list[dict]:
        """The phase's busy time by kernel_kind, largest first, and µs a kernel of each kind."""
        busy = sum(us for us, _ in total["ops"].values()) or 1.0
        grouped = {}
        for name, (us, calls) in total["ops"].items():
            before = grouped.get(kernel_kind(name), (0.0, 0))
            grouped[kernel_kind(name)] = (before[0] + us, before[1] + calls)
        return [
            {"run": run, "phase": phase, "kind": kind, "ms": us / 1e3, "calls": calls}
            | {"µs a call": us / calls if calls else 0.0, "of busy": us / busy}
            for kind, (us, calls) in sorted(grouped.items(), key=lambda item: -item[1][0])
        ]


ELEMENTWISE_OPS = "add|sub|rsub|mul|div|exp|log|pow|rsqrt|sqrt|neg|silu|sigmoid|tanh|where|clamp|abs|maximum|minimum"
ELEMENTWISE_OPS += "|masked_fill|lt|gt|le|ge|eq|ne|cos|sin|reciprocal"
KERNEL_KINDS = (  # (kind, pattern in a CUDA kernel's or a CPU op's name), the first that matches
    ("communication", r"nccl|allreduce|allgather|reducescatter|c10d::"),
    ("attention", r"sdpa|flash|fmha|attention|attn"),
    ("matrix products, fp32 inputs", r"(gemm|gemv).*(f32f32|tf32)|sgemm"),
    ("matrix products", r"gemm|gemv|nvjet|xmma|cutlass|wgmma|splitKreduce|aten::(mm|addmm|bmm|baddbmm|linear|matmul)$"),
    # a cast is a copy kernel (bfloat16_copy_kernel_cuda); "cast" alone would take gpu_kernel_impl_nocast
    ("copies and casts", r"copy|Memcpy|aten::(to|_to_copy|copy_|contiguous|clone)$"),
    ("fills", r"Memset|fill|aten::(zero_|zeros|zeros_like|ones|full)$"),
    ("random numbers", r"distribution|philox|curand|aten::(exponential_|uniform_|normal_|bernoulli_|rand\w*)$"),
    ("reductions, softmax, norms", r"reduce|softmax|norm|logsumexp|aten::(sum|mean|max|amax|argmax|cumsum)$"),
    ("indexing, gathers, sorts", r"index|gather|scatter|embedding|sort|radix|unique|cat"),
    ("elementwise", rf"elementwise|functor|vectorized|unrolled|aten::({ELEMENTWISE_OPS})_?$"),
)


def kernel_kind(name: str) -> str:
    """What a kernel (CUDA) or op (CPU) does, from its name (KERNEL_KINDS; case ignored)."""
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def phase_batch(phase: str, named: dict, result) -> tuple:
    """A phase call's model shape, batch (prompt_ids, prompt_mask, completion_mask), and phase_work's
    kind, passes and models, from its arguments by name."""
    if phase == "generate+reward":  # the Rollout it returns
        return model_shape(named["policy"]), rollout_batch(result), "decode", 1, 1
    if phase == "logprobs":  # π_θold's pass where score_policy, π_ref's where a reference is
        models = int(bool(named["score_policy"])) + (named["reference"] is not None)
        batch, args = rollout_batch(named["batch"]), named["args"]
        passes = passes_of(batch, args.logprob_chunk_size, args.logprob_chunk_tokens)
        return model_shape(named["policy"]), batch, "score", passes, models
    if phase == "values":
        batch = named["prompt_ids"], named["prompt_mask"], named["completion_mask"]
        passes = passes_of(batch, named["chunk_size"], named.get("chunk_tokens", 0))
        return model_shape(named["critic"].backbone, head_rows=1), batch, "score", passes, 1
    batch = tuple(named["batch"][k] for k in ("prompt_ids", "prompt_mask", "completion_mask"))
    critic = phase == "critic update"
    shape = model_shape(named["critic"].backbone, head_rows=1) if critic else model_shape(named["policy"])
    return shape, batch, "train", passes_of(batch, named["args"].micro_batch_size, named["args"].micro_batch_tokens), 1


def call_work(phase: str, function, args: tuple, kwargs: dict, result, element_bytes: int) -> tuple:
    """(FLOPs, bytes, batch, kind) of one call of a script's phase function (phase_batch, phase_work)."""
    named = inspect.signature(function).bind(*args, **kwargs).arguments
    shape, batch, kind, passes, models = phase_batch(phase, named, result)
    return (*phase_work(kind, shape, batch, element_bytes, passes, models), batch, kind)


def passes_of(batch, rows: int, tokens: int) -> int:
    """The chunks the scripts cut `batch` into, by rows or by tokens (common.chunks_of)."""
    prompt_ids, prompt_mask, completion_mask = batch
    order = common.length_order(prompt_ids, prompt_mask, completion_mask)
    return len(common.chunks_of(order, prompt_ids, prompt_mask, completion_mask, rows, tokens))


def rollout_batch(rollout) -> tuple:
    return rollout.prompt_ids, rollout.prompt_mask, rollout.completion_mask


def profile_script(args, name: str, directory: str, device, element_bytes: int, profiles: Profiles) -> dict:
    """One step of script `name`, each phase call (or those --profile_phases names) under its own
    profiler: rows of `profiles`, and the step's time/* metrics (the profiler's reading included)."""

    chosen = [p.strip() for p in args.profile_phases.split(",") if p.strip()]

    def around(phase, function, *a, **k):
        if chosen and phase not in chosen:  # unprofiled: its time is in the step's time/* metrics alone
            return function(*a, **k)
        result, measured = profiled(lambda: function(*a, **k), device)
        flops, nbytes, batch, kind = call_work(phase, function, a, k, result, element_bytes)
        tokens = int(batch[2].sum()) if kind == "decode" else None
        profiles.add(name, phase, measured, flops, nbytes, tokens)
        return result

    compiled_first(args, name, directory, device)
    with phases_wrapped(SCRIPTS[name], around):
        metrics = one_step(args, name, directory)
    spent = sum(t["profiler s"] for (run, _), t in profiles.phases.items() if run == name)
    return {"script": name, **{k: v for k, v in metrics.items() if k.startswith("time/")}, "profiler s": spent}


def profile_decode(args, device, weight_dtype, amp, element_bytes: int, profiles: Profiles) -> None:
    """grpo.generate at N = the largest of --batch_sizes, every completion at its cap, sampled, one call
    profiled after a warm-up (of 16 tokens; with --compile, of as many, which compiles what it runs)."""
    model, tokenizer, vocab_size, _ = load_bench_model(args, device, weight_dtype)
    common.compile_blocks(model, args.compile)
    num_rows = max(int(n) for n in args.batch_sizes.split(",") if n)
    ids, mask = prompts(tokenizer, num_rows, args.group_size, device)
    inputs = (model, ids, mask)
    settings = dict(eos_ids=[], pad_id=tokenizer.pad_token_id, vocab_size=vocab_size, temperature=1.0)
    with amp():
        warm_up = args.max_new_tokens if args.compile else min(16, args.max_new_tokens)
        grpo.generate(*inputs, warm_up, **settings)  # lazy set-up, kernels picked, what --compile compiles
        result, measured = profiled(lambda: grpo.generate(*inputs, args.max_new_tokens, **settings), device)
    batch = ids, mask, result[1]
    flops, nbytes = phase_work("decode", model_shape(model), batch, element_bytes)
    profiles.add("decode", f"generate N={num_rows}", measured, flops, nbytes, int(result[1].sum()))


def bench_profile(args, device, weight_dtype, compute_dtype, amp, report: dict, save) -> dict:
    """--profile: each run's phases, a row each, their largest kernels and busy time by kind."""
    if device.type == "cuda":  # kineto set up before any CUDA graph is captured (pytorch#75504)
        with torch.profiler.profile():
            pass
    bandwidth = copy_bandwidth(device, 256 if device.type == "cuda" else 32)
    peak, source = peak_flops(args, device)
    element_bytes = (compute_dtype or weight_dtype).itemsize  # what a pass reads: bf16 under autocast
    sections = ("profile", "profile_top", "profile_kinds", "training_step")
    report |= {"copy bandwidth GB/s": bandwidth / 1e9, "peak": source} | {section: [] for section in sections}
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; peak: {source}", flush=True)
    profiles = Profiles(device, bandwidth, peak, report, save)
    for name in [n for n in args.profile.split(",") if n]:
        if name == "decode":
            profile_decode(args, device, weight_dtype, amp, element_bytes, profiles)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the training steps load their own copies
        else:
            directory = bench_directory(args, device)
            report["training_step"].append(profile_script(args, name, directory, device, element_bytes, profiles))
            save()
    for section in sections:
        print(f"\n### {section}\n\n{markdown(report[section])}")
    return report


def check_profile_args(args: Args) -> None:
    """--profile and --profile_phases name what exists, before anything runs."""
    phases = [phase for phase, _ in PHASES]
    for flag, given, known in (
        ("--profile", args.profile, ["decode", *SCRIPTS]),
        ("--profile_phases", args.profile_phases, phases),
    ):
        unknown = sorted({name.strip() for name in given.split(",") if name.strip()} - set(known))
        if unknown:
            raise SystemExit(f"{flag} {given}: {', '.join(unknown)} is none of {', '.join(known)}")
    if args.profile_phases and not args.profile:
        raise SystemExit("--profile_phases names the phases --profile profiles: give --profile grpo (dapo, ppo) too")


def main(args: Args) -> dict:
    check_profile_args(args)
    device = common.use_device(common.resolve_device(args.device))  # a GPU named by --device becomes the current one
    weight_dtype, compute_dtype = common.resolve_precision(args.dtype, device)
    amp = lambda: common.autocast(device, compute_dtype)  # noqa: E731
    report = {"args": asdict(args), "device": str(device), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    save = lambda: Path(args.output).write_text(json.dumps(report, indent=1))  # noqa: E731  (after every section)

    def section(name: str, rows: list[dict]) -> None:
        report[name] = rows
        save()
        print(f"\n### {name}\n\n{markdown(rows)}")

    # First what loads no weights: the sampler's cost is its (N, V) alone, the attention's its shapes
    if args.sampler_rows:
        section("sampler", bench_sampler(args.sampler_rows, QWEN_TOKENIZER_SIZE, device))
    if args.attention_rows:
        shape = attention_shape(args, device)
        section("attention", bench_attention(*shape, args.max_new_tokens, device, amp, compute_dtype or weight_dtype))
    if args.decode_layers:
        section("decode_kernels", bench_decode_kernels(args.decode_layers, device, amp))
    if args.update_layers:
        section("update_kernels", bench_update_kernels(args.update_layers, device))
    if args.profile:
        return bench_profile(args, device, weight_dtype, compute_dtype, amp, report, save)
    sections = ("generation", "steps_4_and_6", "training_step")
    report |= {section: [] for section in sections}
    if args.batch_sizes or args.step_rows or args.tool_rows:  # one loaded model; the training steps load theirs
        model, tokenizer, vocab_size, _ = load_bench_model(args, device, weight_dtype)
        report["generation"] = bench_generation(args, model, tokenizer, vocab_size, device, amp, compute_dtype)
        save()
        if args.tool_rows:
            report["tools"] = bench_tools(args, model, tokenizer, vocab_size, device, amp)
            print(f"\n### tools beside the decode\n\n{markdown(report['tools'])}")
            save()
        if args.step_rows:
            report["steps_4_and_6"] = bench_steps_4_and_6(args, model, tokenizer, vocab_size, device, amp)
            save()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.train_steps:
        bench_training(args, bench_directory(args, device), device, report["training_step"], save)
    for section in sections:
        print(f"\n### {section}\n\n{markdown(report[section])}")
    return report


if __name__ == "__main__":
    main(common.parse_args(Args))
