"""What ppo.py, grpo.py and dapo.py share: their common flags (RunArgs), the models and their runtime
(how they run fast, called by name), the tiny test models, seeding, the run on disk and checkpoints.
No algorithm: sampling, log-probs, advantages and losses live in the scripts, each read on its own."""

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import io
import json
import math
import os
import pickle
import random
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import typing
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
from jinja2 import TemplateError
from tqdm import tqdm
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    HfArgumentParser,
    PreTrainedModel,
)
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.utils import logging as hf_logging

from rewards import arg, check_tool_turns, plain_prompt_advice, too_few_tool_tokens, tool_turn_text

hf_logging.disable_progress_bar()  # per-shard load/save bars would drown the training bar
# Segments that grow: the KV cache, logits and activations change size each step, and fixed blocks
# fragment. Read at the first CUDA allocation; a user's own PYTORCH_CUDA_ALLOC_CONF wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

# Short names for --model -> Hub ids; anything else is a local directory, a Hub id or a tiny model.
MODEL_ALIASES = {
    "Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen2.5-1.5B-Instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B-Instruct": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct",
    "Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B",
    "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B",
    "Qwen2.5-3B": "Qwen/Qwen2.5-3B",
    "Qwen2.5-Math-1.5B": "Qwen/Qwen2.5-Math-1.5B",
    "Qwen3-0.6B": "Qwen/Qwen3-0.6B",
    "Qwen3-1.7B": "Qwen/Qwen3-1.7B",
}

# Files that hold a tokenizer's vocabulary; a model directory needs at least one of them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
TRAINER_STATE = "trainer_state.pt"  # optimizer, scheduler, step and RNG states, for resuming
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's adapters, in peft's format
FULL_LR, LORA_LR = 1e-6, 1e-5  # the default --lr; LoRA's ~10× (docs/lora.md: LoRA Without Regret)


# ----------------------------------------------------------------------------------------
# Command line


PROMPT_FORMATS = ("auto", "chat", "plain")
PROMPT_FORMAT_HELP = (
    "how prompts are written: chat (the tokenizer's chat template), plain (text a base model continues: "
    "the system text, then 'Question: ...' and 'Answer:' lines), auto (chat if the tokenizer has a template)"
)


@dataclass
class RunArgs:
    """The flags every training script has, beyond its algorithm's: a script's Args extends it."""

    # the model
    model: str = arg("Qwen2.5-1.5B-Instruct", "local dir, Hub id, short name (common.MODEL_ALIASES) or 'tiny'")
    prompt_format: str = arg("auto", PROMPT_FORMAT_HELP)
    # LoRA (peft): train low-rank adapters on the frozen model instead of every weight
    lora_rank: int = arg(0, "r, rank of the LoRA adapters (Hu et al. 2021); 0 = train every weight")
    lora_alpha: float = arg(32.0, "α: the adapters' update is scaled by α/r (LoRA Without Regret keeps α = 32)")
    lora_targets: str = arg("all-linear", "layers with adapters: all-linear (attention, MLP) or names: q_proj,v_proj")
    # how the passes run: micro-batches, scoring chunks, memory, compilation
    micro_batch_size: int = arg(0, "rows per forward/backward (gradient accumulation); 0 = by tokens")
    micro_batch_tokens: int = arg(0, "tokens per forward/backward; 0 = the GPU preflight's (CPU: 4 rows)")
    logprob_chunk_size: int = arg(0, "rows per no-grad scoring pass; 0 = by tokens")
    logprob_chunk_tokens: int = arg(0, "tokens per no-grad scoring pass; 0 = the GPU preflight's (CPU: 8 rows)")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward: less memory, ~30% slower")
    compile: bool = arg(False, "torch.compile: MLP and RMSNorm blocks, the decode step, the sampler; step 1 compiles")
    # the run
    seed: int = arg(0, "seeds prompts order, sampling and initialisation")
    device: str = arg("auto", "auto, cpu, cuda, cuda:1, ...")
    dtype: str = arg("auto", "auto (bf16 compute, fp32 weights on GPU; fp32 on CPU), bfloat16, float32")
    output_dir: str = arg("runs", "runs/<algo>-<task>-<model>-<time>/")
    save_every: int = arg(100, "checkpoint every this many steps (and always at the end); 0 = end only")
    sample_every: int = arg(10, "write a few completions to samples.jsonl every this many steps")
    num_samples: int = arg(4, "completions written each time")
    resume_from: str = arg("", "a checkpoint directory of an earlier run to continue from")
    report_to: str = arg("none", "none, tensorboard, wandb or both (tensorboard,wandb): every metrics row to it too")
    # held-out evaluation
    eval_every: int = arg(0, "greedy accuracy on held-out problems every this many steps and at the end; 0 = never")
    eval_problems: int = arg(128, "held-out problems per evaluation (Countdown: its held-out share; GSM8K: test split)")
    eval_batch_size: int = arg(32, "held-out problems per generation batch")


def parse_args(args_class, argv: list[str] | None = None):
    """The command line as a script's Args. --config FILE (YAML or JSON, an args.json too) sets any field,
    flags override it; `--lr -1e-6` is attached to its flag (argparse reads a flag); an unknown flag
    stops naming the closest. Under torchrun a node's first process alone prints a stop (said_once)."""
    if first_of_node():
        return parsed_args(args_class, argv)
    try:  # another process of the node: argparse's usage error (printed, then exit 2) and a message go unsaid
        with contextlib.redirect_stderr(io.StringIO()):
            return parsed_args(args_class, argv)
    except SystemExit as stop:
        raise SystemExit(1 if isinstance(stop.code, str) else stop.code) from None


def said_once(message: str) -> str | int:
    """A stop's message in a node's first process, exit status 1 in the others (no line printed per GPU)."""
    return message if first_of_node() else 1


def first_of_node() -> bool:
    """Without torchrun (no WORLD_SIZE), or a torchrun node's first process (LOCAL_RANK 0)."""
    return "WORLD_SIZE" not in os.environ or os.environ.get("LOCAL_RANK", "0") == "0"


# Removed flags -> (the value that did what runs now do, what replaced it). On the command line the flag
# stops; in a --config file that value is accepted, any other stops (docs/speed.md: tried and removed).
REMOVED_SETTINGS = {
    "lm_head_precision": ("tf32", "the LM head runs on TF32 tensor cores on a GPU, fp32 on the CPU, always"),
    # bench.py's A/B flags of paths measured and removed
    "aligned_prompts": ("off", "the prompt pass keeps its mask, always"),
    "sdpa_backend": ("", "PyTorch picks the SDPA backend"),
}


def removed_setting(name: str, value=None) -> str | None:
    """The line a removed setting stops with, or None (not one, or from a file with today's value)."""
    if name not in REMOVED_SETTINGS or (value is not None and str(value) == REMOVED_SETTINGS[name][0]):
        return None
    return f"--{name} was removed: {REMOVED_SETTINGS[name][1]}. Leave it out."


def parsed_args(args_class, argv: list[str] | None):
    """parse_args' work, in any process."""
    parser = HfArgumentParser(args_class, epilog=CONFIG_HELP, allow_abbrev=False)  # --max_step is a typo
    help_groups(parser, args_class)
    argv, config = pop_config(list(sys.argv[1:] if argv is None else argv))
    for token in argv:
        if token.startswith("--") and removed_setting(token[2:].split("=", 1)[0]):
            raise SystemExit(said_once(removed_setting(token[2:].split("=", 1)[0])))
    if config:
        parser.set_defaults(**read_config(config, args_class))
    attached = []
    for token in argv:
        flag = attached[-1] if attached else ""  # a flag without an attached value: '--lr', not '--lr=1e-6'
        if _is_number(token) and token.startswith("-") and flag.startswith("--") and "=" not in flag:
            attached[-1] = f"{attached[-1]}={token}"
        else:
            attached.append(token)
    args, unknown = parser.parse_args_into_dataclasses(args=attached, return_remaining_strings=True)
    if unknown:
        fields = dataclasses.fields(args_class)
        flags = ["--help", "--config"] + [f"--{f.name}" for f in fields]
        flags += [f"--no_{f.name}" for f in fields if f.default is True]
        hints = []
        for token in unknown:
            close = difflib.get_close_matches(token.split("=", 1)[0], flags, n=1) if token.startswith("-") else []
            hints.append(f"{token} (did you mean {close[0]}?)" if close else token)
        parser.error(f"unrecognized arguments: {' '.join(hints)}. See --help for every option.")
    return args


def help_groups(parser, args_class) -> None:
    """--help lists a script's own flags first, then each class its Args extends, a titled group each."""
    bases = [cls for cls in args_class.__mro__[1:] if dataclasses.is_dataclass(cls)]
    if not bases:
        return
    owner = {}
    for cls in reversed(args_class.__mro__):
        owner |= dict.fromkeys(vars(cls).get("__annotations__", {}), cls)
    titles = {args_class: "the algorithm's hyperparameters"}
    titles |= {cls: re.split(r"[:(.]", cls.__doc__)[0].strip() for cls in bases}  # "The flags of …"
    groups = {cls: parser.add_argument_group(title) for cls, title in titles.items()}
    for action in list(parser._optionals._group_actions):  # argparse's own list of them, as HfArgumentParser left it
        if action.dest in owner:
            parser._optionals._group_actions.remove(action)
            groups[owner[action.dest]]._group_actions.append(action)


CONFIG_HELP = (
    "--config FILE: a YAML or JSON file of field: value pairs (any field above; a run's args.json reruns it); "
    "flags given on the command line override it."
)


def pop_config(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without its --config FILE (or --config=FILE), and FILE (None when absent)."""
    rest, config = [], None
    tokens = iter(argv)
    for token in tokens:
        if token == "--config":
            config = next(tokens, None)
            if config is None:
                raise SystemExit("--config needs a file: --config recipes/grpo-countdown.yaml")
        elif token.startswith("--config="):
            config = token.split("=", 1)[1]
        else:
            rest.append(token)
    return rest, config


def read_config(path: str, args_class) -> dict:
    """A --config file's values, checked and converted to each field's type (YAML's `lr: 2e-5`: 2e-5)."""
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"--config {path}: no such file.")
    if file.suffix not in (".yaml", ".yml", ".json"):
        raise SystemExit(f"--config {path}: the file must end in .yaml, .yml or .json.")
    data = parsed_file(file, "--config")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SystemExit(
            f"--config {path}: the file must hold a mapping of settings to values, not a {type(data).__name__}."
        )
    return checked_settings(data, args_class, f"--config {path}")


def parsed_file(file: Path, flag: str):
    """The YAML or JSON in a file a flag names, or a SystemExit: not UTF-8, or the parser's message."""
    import yaml  # PyYAML, which transformers itself requires

    try:
        text = file.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark, as Windows editors write, is not text
        return json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except UnicodeDecodeError as error:
        raise SystemExit(f"{flag} {file}: not UTF-8 text ({error}): save it as UTF-8.") from error
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        kind = "JSON" if file.suffix == ".json" else "YAML"
        raise SystemExit(f"{flag} {file}: not valid {kind}: {error}") from error


def checked_settings(data: dict, args_class, where: str) -> dict:
    """data's values as args_class's field types; an unknown key or a wrong type stops, `where` first."""
    fields = {field.name for field in dataclasses.fields(args_class)}
    types = typing.get_type_hints(args_class)  # not field.type: HfArgumentParser rewrites it (float | None -> float)
    values, problems = {}, []
    for key, value in data.items():
        if key in REMOVED_SETTINGS and key not in fields:
            if removed_setting(key, value):
                problems.append(removed_setting(key, value))
            continue
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            problems.append(f"{key!r} is not a setting" + (f" (did you mean {close[0]!r}?)" if close else ""))
            continue
        try:
            values[key] = as_field_type(value, types[key])
        except ValueError as error:
            problems.append(f"{key}: {error}")
    if problems and "lr" in fields and {"model", "lr"} <= set(data):  # a training script's whole arguments
        theirs, ours = written_by_script(data), written_by_script(dict.fromkeys(fields))
        if theirs != ours:  # another script's args.json: one line for it, not one a setting
            raise SystemExit(
                f"{where}: these are {theirs}.py's arguments (a {theirs}.py run's args.json?): run {theirs}.py "
                "with them."
            )
    if problems:
        raise SystemExit(f"{where}:\n  " + "\n  ".join(problems) + "\nSee --help for every setting.")
    return values


def as_field_type(value, kind):
    """value as a field of type `kind` (bool, int, float, str, a list, or one | None); else ValueError."""
    if typing.get_origin(kind) is list:  # evaluate.py's --compare, --plot: a list of texts
        if not isinstance(value, list):
            raise ValueError(f"needs a list, not {value!r}")
        return [as_field_type(item, typing.get_args(kind)[0]) for item in value]
    declared = typing.get_args(kind)  # (float, NoneType) for float | None; () for float
    optional = type(None) in declared
    kind = next((option for option in declared if option is not type(None)), kind)
    wanted = {bool: "true or false", int: "an int", float: "a float", str: "a text"}.get(kind, kind.__name__)
    if value is None:
        if optional:
            return None
        raise ValueError(f"needs {wanted}, not null")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ValueError(f"needs {wanted}, not {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):  # a bool is an int to Python only
        raise ValueError(f"needs {wanted}, not {value!r}")
    if kind is str:
        return str(value)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"needs {wanted}, not {value!r}") from None
    # an int given as 2.5, or NaN ("nan", YAML's .nan): every comparison is False, so `beta > 0` would drop the KL
    if (kind is int and isinstance(value, float) and value != number) or number != number:
        raise ValueError(f"needs {wanted}, not {value!r}")
    return number


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def check_run_args(args, algo: str) -> list[str]:
    """The range checks every script shares, before anything loads (algo: the script). One line a problem."""
    problems = []
    for field in dataclasses.fields(args):  # NaN passes every range check (each comparison is False):
        value = getattr(args, field.name)  # --beta nan would drop the KL term without a word
        if isinstance(value, float) and value != value:
            problems.append(f"--{field.name} is NaN: give it a number.")
        infinite = isinstance(value, float) and value in (float("inf"), float("-inf"))
        if infinite and (field.name in ("lr", "critic_lr", "beta", "weight_decay") or field.name.endswith("_coef")):
            problems.append(f"--{field.name} is {value}: give it a finite number.")  # the first update: NaN weights
    if args.lr is not None and not args.lr > 0:
        problems.append(f"--lr must be > 0 (got {args.lr}); the seed study used 1e-6 to 3e-6.")
    if args.lora_rank < 0 or not args.lora_alpha > 0 or not args.lora_targets.strip(","):
        problems.append(
            f"LoRA needs --lora_rank >= 0 (0: off), --lora_alpha > 0 and --lora_targets 'all-linear' or layer "
            f"names such as q_proj,v_proj (got {args.lora_rank}, {args.lora_alpha}, {args.lora_targets!r})."
        )
    defaults = {field.name: field.default for field in dataclasses.fields(args)}
    shaping = [f"--{n} {getattr(args, n)}" for n in ("lora_alpha", "lora_targets") if getattr(args, n) != defaults[n]]
    if not args.lora_rank and shaping:  # given, and ignored: the run would train every weight
        problems.append(
            f"{', '.join(shaping)}: these shape LoRA adapters, and LoRA is off (--lora_rank 0: every weight "
            "trains): add --lora_rank (e.g. 32), or drop them."
        )
    if not 0 <= args.adam_beta2 < 1:
        problems.append(f"--adam_beta2 must be in [0, 1) (got {args.adam_beta2}).")
    if not args.max_grad_norm > 0:
        problems.append(f"--max_grad_norm must be > 0 (got {args.max_grad_norm}).")
    problems += check_prompt_format(args.prompt_format)
    for name in ("warmup_steps", "weight_decay", "save_every", "sample_every", "num_samples", "seed", "shots"):
        if getattr(args, name) < 0:
            problems.append(f"--{name} must be >= 0 (got {getattr(args, name)}).")
    if args.max_steps < 1:
        problems.append(f"--max_steps must be at least 1 (got {args.max_steps}): a run of no steps trains nothing.")
    if args.dtype not in ("auto", "bfloat16", "float32"):
        problems.append(f"--dtype {args.dtype!r} is not one of: auto, bfloat16, float32.")
    if args.eval_every < 0 or (args.eval_every and (args.eval_problems < 1 or args.eval_batch_size < 1)):
        problems.append("--eval_every must be >= 0, and with it --eval_problems and --eval_batch_size >= 1.")
    for name in ("micro_batch_size", "micro_batch_tokens", "logprob_chunk_size", "logprob_chunk_tokens"):
        if getattr(args, name) < 0:
            problems.append(f"--{name} must be >= 0 (0: by tokens, or sized before step 1).")
    if args.max_turns < 0:
        problems.append(f"--max_turns must be >= 0 (got {args.max_turns}): the tool turns a completion may take.")
    if args.max_tool_tokens < 1:
        problems.append(f"--max_tool_tokens must be >= 1 (got {args.max_tool_tokens}): the tokens of one tool answer.")
    if args.tool_workers < 1:
        problems.append(f"--tool_workers must be >= 1 (got {args.tool_workers}): the tool calls that run at once.")
    problems += timeout_problems(args)
    if args.resume_from:
        problems += resume_problems(args, algo)
    problems += output_dir_problems(args.output_dir)
    try:  # the tracker libraries are looked for here (not imported): a missing one stops before a model loads
        for name in trackers_named(args.report_to):
            if importlib.util.find_spec(name) is None:
                problems.append(missing_tracker(name, name, stop=False))
    except ValueError as error:
        problems.append(str(error))
    return problems


def check_technique_args(args) -> list[str]:
    """The ranges of the techniques' flags that grpo.py and dapo.py share."""
    problems = []
    if args.sapo_tau_pos <= 0 or args.sapo_tau_neg <= 0:
        problems.append(
            f"--sapo_tau_pos and --sapo_tau_neg must be > 0 (got {args.sapo_tau_pos}, {args.sapo_tau_neg})."
        )
    if args.dppo_delta <= 0 or args.dppo_kl_delta <= 0 or args.dppo_ratio_cap < 1:
        problems.append(
            "--dppo_delta and --dppo_kl_delta must be > 0 and --dppo_ratio_cap >= 1 (got "
            f"{args.dppo_delta}, {args.dppo_kl_delta}, {args.dppo_ratio_cap})."
        )
    if args.dppo_type not in ("binary_tv", "binary_kl"):
        problems.append(f"--dppo_type must be one of binary_tv, binary_kl (got {args.dppo_type!r}).")
    if args.kl_tau < 0:
        problems.append(f"--kl_tau must be >= 0 (got {args.kl_tau}): τ of the squared log-ratio penalty.")
    if args.loss_type == "dppo" and args.dual_clip:
        problems.append(
            "--loss_type dppo's objective sg(r)·Â·log π with Â < 0 never falls below c·Â: use --dual_clip 0."
        )
    if args.loss_type == "sapo" and args.dual_clip:
        problems.append(
            "--loss_type sapo gates the ratio softly, with no clip for dual-clip to bound: use --dual_clip 0."
        )
    if args.scale_rewards not in ("", "group", "batch", "mean", "none"):
        problems.append(f"--scale_rewards {args.scale_rewards!r} is not one of: group, batch, mean, none.")
    if args.scale_rewards and args.loss_type == "gpg":
        problems.append("--loss_type gpg scales its advantage itself (α = B/(B − M)): leave --scale_rewards unset.")
    if not 0 < args.clip_cov_ratio <= 1 or not 0 < args.kl_cov_ratio <= 1 or args.kl_cov_coef < 0:
        problems.append("--clip_cov_ratio and --kl_cov_ratio must be in (0, 1], --kl_cov_coef >= 0 (2e-4, 2e-4, 1).")
    try:
        low, high = (float(bound) for bound in args.clip_cov_bounds.split(","))
    except ValueError:
        low, high = 1.0, 0.0  # not two numbers: reported as the band below
    if not low < high:
        problems.append(
            f"--clip_cov_bounds takes ω_low,ω_high, ω_low < ω_high, e.g. 1,5 (got {args.clip_cov_bounds!r})."
        )
    if not 0 < args.top_entropy_quantile <= 1:
        problems.append(
            f"--top_entropy_quantile must be in (0, 1] (got {args.top_entropy_quantile}); the paper's 0.2, 1 = off."
        )
    if args.off_policy_mask_threshold < 0:
        problems.append(f"--off_policy_mask_threshold must be >= 0 (got {args.off_policy_mask_threshold}); 0 = off.")
    if args.unbiased_kl and args.beta == 0:
        problems.append("--unbiased_kl weights the KL term, and --beta 0 has none: add --beta, e.g. 0.01.")
    if args.entropy_coef < 0:
        problems.append(f"--entropy_coef must be >= 0 (got {args.entropy_coef}); T1 adds a small bonus, e.g. 0.001.")
    if not 0 <= args.ref_ema_decay < 1:
        problems.append(f"--ref_ema_decay must be in [0, 1) (got {args.ref_ema_decay}), e.g. 0.99; 0 = frozen.")
    elif args.ref_ema_decay and (args.beta == 0 or args.lora_rank):
        problems.append("--ref_ema_decay moves the reference of the KL term: it needs --beta > 0 and --lora_rank 0.")
    elif args.ref_ema_decay and args.dtype == "bfloat16":  # 8 significant bits: a step of (1−λ)·gap rounds away
        problems.append("--ref_ema_decay needs fp32 weights: with --dtype bfloat16 the reference would never move.")
    if args.tis_cap and args.tis_cap < 1:
        problems.append(f"--tis_cap must be >= 1, or 0 to disable it (got {args.tis_cap}); Yao et al. use 2.")
    return problems + check_is_mask(args)


def check_is_mask(args) -> list[str]:
    """The range of --is_mask α,β and --is_mask_level (all three scripts)."""
    if args.is_mask_level not in ("token", "sequence"):
        return [f"--is_mask_level {args.is_mask_level!r} is not one of: token, sequence."]
    try:
        is_mask_bounds(args.is_mask)
    except ValueError as error:
        return [str(error)]
    return []


def is_mask_bounds(text: str) -> tuple[float, float] | None:
    """--is_mask "α,β" -> (α, β), 0 <= α < 1 < β so a ratio of 1 always stays; "" -> None (off)."""
    if not text:
        return None
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--is_mask takes two numbers α,β, e.g. 0.5,5 (IcePop's), not {text!r}.") from None
    if not 0 <= low < 1 < high:
        raise ValueError(f"--is_mask α,β needs 0 <= α < 1 < β (got {text}): a ratio of 1 must stay, e.g. 0.5,5.")
    return low, high


def timeout_problems(args) -> list[str]:
    """--reward_fn_timeout and --tool_timeout: the seconds of a SIGALRM, finite (inf: every call fails)."""
    return [
        f"--{name} must be a finite number of seconds > 0 (got {getattr(args, name)})."
        for name in ("reward_fn_timeout", "tool_timeout")
        if not 0 < getattr(args, name) < float("inf")
    ]


def stop_interrupted(script: str, checkpoint: Path | None, steps_done: int) -> NoReturn:
    """Ctrl-C: one line naming the newest checkpoint and the command to continue, then exit status 130."""
    if checkpoint is None:
        message = f"Interrupted after {steps_done} steps; no checkpoint yet (--save_every sets how often)."
    else:
        command = resume_command(script, checkpoint)
        message = f"Interrupted after {steps_done} steps. Newest checkpoint: {checkpoint}. Continue with: {command}"
    if rank() == 0:  # under torchrun every rank stops, one prints
        print(message, file=sys.stderr)
    raise SystemExit(130)


# The mean |log π_sampler − log π_trainer| (policy/sample_logp_diff) no correct run reaches (docs/models.md).
SAMPLER_GAP_BOUND = {"fp32": 1e-3, "bf16": 0.05}

# The outermost of these functions an out-of-memory error rose through -> its phase, the flags that help.
MEMORY_PHASES = {
    "evaluate_heldout": ("held-out evaluation", "--eval_batch_size (problems generated at once), --max_new_tokens"),
    "rollout": (
        "generation (steps 1-3)",
        "--batch_size or --group_size (rows decoded at once), --max_new_tokens (the KV cache holds "
        "rows × (prompt + max_new_tokens) positions in every layer), --dtype bfloat16",
    ),
    "old_and_ref_logprobs": (
        "scoring (step 4)",
        "--logprob_chunk_tokens or --logprob_chunk_size (tokens or rows scored at once), --beta 0 (no reference)",
    ),
    "critic_values": ("the critic's values (step 4)", "--logprob_chunk_tokens or --logprob_chunk_size"),
    "policy_backward": (
        "the policy update (step 6)",
        "--micro_batch_tokens or --micro_batch_size (tokens or rows per forward and backward), "
        "--gradient_checkpointing true, --lora_rank 32",
    ),
    "critic_backward": (
        "the critic update",
        "--micro_batch_tokens or --micro_batch_size, --gradient_checkpointing true",
    ),
    "optimizer_step": (
        "the optimizer step",
        "--lora_rank 32 (AdamW's moments for the adapters only), --dtype bfloat16",
    ),
}


def out_of_memory_message(error: BaseException, checkpoint: Path | None, script: str) -> str:
    """An out-of-memory error's message: its phase, shapes, the GPU's memory, the flags, the checkpoint."""
    frames, traceback = [], error.__traceback__
    while traceback is not None:  # outermost first: train(), then what it called
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    phase, flags, shapes = "an unnamed phase", "--micro_batch_tokens, --logprob_chunk_tokens, --batch_size", ""
    for frame in frames:
        if frame.f_code.co_name in MEMORY_PHASES:
            phase, flags = MEMORY_PHASES[frame.f_code.co_name]
            break
    for frame in reversed(frames):  # the innermost frame holding token ids: the rows and columns being computed
        tensors = {
            name: tuple(value.shape)
            for name, value in frame.f_locals.items()
            if name in ("input_ids", "prompt_ids", "completion_ids") and isinstance(value, torch.Tensor)
        }
        if tensors:
            shapes = ", ".join(f"{name} {list(shape)}" for name, shape in tensors.items())
            shapes = f" on {shapes} (rows, tokens) in {frame.f_code.co_name}()"
            break
    memory = "no CUDA device"
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        peak = torch.cuda.max_memory_allocated()
        memory = (
            f"{total / 2**30:.1f} GiB in all, {free / 2**30:.1f} GiB free now, {peak / 2**30:.1f} GiB this run's peak"
        )
    resume = (
        f"Newest checkpoint: {checkpoint}. Continue with: {resume_command(script, checkpoint)}"
        if checkpoint is not None
        else "No checkpoint was written yet (--save_every sets how often)."
    )
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"Out of GPU memory in {phase}{shapes}. GPU: {memory}. Lower this phase's memory with {flags} "
        f"(docs/models.md: memory). {resume}\n(torch: {first_line})"
    )


def resume_command(script: str, checkpoint: Path) -> str:
    """The same arguments with --resume_from `checkpoint`, under torchrun with as many processes."""
    argv, skip = [], False
    for token in sys.argv[1:]:  # keep every argument but an earlier --resume_from
        if skip or token.startswith("--resume_from="):
            skip = False
        elif token == "--resume_from":
            skip = True
        else:
            argv.append(token)
    if sys.argv and sys.argv[0].endswith(".py"):
        script = sys.argv[0]  # as the user typed it (path/to/grpo.py)
    if world_size() == 1:
        return shlex.join(["python", script, *argv, "--resume_from", str(checkpoint)])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    nodes = world_size() // per_node
    launch = ["torchrun", f"--nproc_per_node={per_node}", *([f"--nnodes={nodes}"] if nodes > 1 else [])]
    command = shlex.join([*launch, script, *argv, "--resume_from", str(checkpoint)])
    return command + (" (on every node, with the launch's own rendezvous options)" if nodes > 1 else "")


@contextlib.contextmanager
def interrupts_deferred():
    """Ctrl-C within it raises when it ends, so a save finishes whole; a second stops at once. A no-op
    with another SIGINT handler, off the main thread, and under torchrun (a save waits on every rank)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or world_size() > 1 or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received = []

    def defer(number, frame):
        if received:
            raise KeyboardInterrupt
        received.append(number)

    signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


def record_args(run_dir: Path, args, resumed_at: int | None = None) -> None:
    """Writes args.json (a --config that reruns the run); a resume keeps the old as args.before-step-<k>.json."""
    path = Path(run_dir) / "args.json"
    if resumed_at is not None and path.exists():
        path.replace(path.with_name(f"args.before-step-{resumed_at:06d}.json"))
    settings = dataclasses.asdict(args) | ({"resume_from": ""} if hasattr(args, "resume_from") else {})
    path.write_text(json.dumps(settings, indent=2) + "\n")


# ----------------------------------------------------------------------------------------
# Device, precision, seeding


def resolve_device(device: str) -> torch.device:
    """'auto': CUDA if there is a GPU, else the CPU; a GPU with its index (cuda → cuda:0)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device} was asked for, but torch sees no CUDA GPU. Use --device cpu.")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise SystemExit(
            f"--device {device!r} is not a device torch knows ({error}): use cpu, cuda or cuda:<i>."
        ) from error
    if resolved.type == "cuda":
        index = resolved.index or 0
        if index >= torch.cuda.device_count():
            raise SystemExit(
                f"--device {device}: torch sees {torch.cuda.device_count()} GPU(s), cuda:0 … "
                f"cuda:{torch.cuda.device_count() - 1} (CUDA_VISIBLE_DEVICES renumbers them from 0)."
            )
        resolved = torch.device("cuda", index)
    return resolved


def use_device(device: torch.device) -> torch.device:
    """Makes a CUDA device the current one, where streams, CUDA graphs and NCCL go. Returns it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def resolve_precision(dtype: str, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(weight dtype, autocast dtype). 'auto' on CUDA: fp32 weights (an update of ~1e-6 is below bf16's
    resolution), bf16 compute; 'bfloat16': bf16 weights too. The CPU: all fp32."""
    if dtype == "auto":
        return (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32, None)
    if dtype == "bfloat16":
        return torch.bfloat16, torch.bfloat16 if device.type == "cuda" else None
    if dtype == "float32":
        return torch.float32, None
    raise SystemExit(f"--dtype {dtype!r} is not one of: auto, bfloat16, float32.")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# ----------------------------------------------------------------------------------------
# Several processes (torchrun): data parallel, sharded by FSDP2. Without torchrun each helper does nothing.


def init_distributed(device: torch.device) -> torch.device:
    """Joins torchrun's group (NCCL on cuda:LOCAL_RANK, gloo on the CPU). Returns this process's device."""
    if "WORLD_SIZE" not in os.environ:
        return use_device(device)
    if device.type == "cuda":
        device = use_device(torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def world_size() -> int:
    """K, the number of processes (1 without torchrun)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """This process's index, 0 … K−1 (0 without torchrun). Rank 0 alone writes files."""
    return dist.get_rank() if dist.is_initialized() else 0


def rank_seed(seed: int) -> int:
    """--seed + 1000·rank: no two ranks sample the same completions; rank 0's is a single process's."""
    return seed + 1000 * rank()


def my_share(items: list) -> list:
    """This rank's contiguous 1/K of `items` (check_distributed: K divides the length)."""
    size = len(items) // world_size()
    return items[rank() * size : (rank() + 1) * size]


def all_reduce(value, op: str = "sum"):
    """A number or tensor's "sum", "max" or "min" over every rank, as the same type (one process: itself)."""
    if not dist.is_initialized():
        return value
    tensor = torch.as_tensor(value, dtype=torch.float64 if not torch.is_tensor(value) else None).clone()
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(tensor, op=reduce_op)
    if torch.is_tensor(value):
        return tensor.to(value.device)
    return type(value)(tensor.item())


def all_reduce_totals(totals: dict) -> dict:
    """Update statistics summed over ranks (*_max: their maximum), as accumulate sums micro-batches."""
    return {k: all_reduce(v, "max" if k.endswith("_max") else "sum") for k, v in totals.items()}


IN_PREFLIGHT = contextvars.ContextVar("in_preflight", default=False)  # True while its passes run (bench skips them)
PREFLIGHT_MEMORY_SHARE = 0.8  # of the GPU's memory a micro-batch's pass may reach, AdamW's moments to come included
UNSIZED_ROWS = {"micro_batch": 4, "logprob_chunk": 8}  # rows per pass where no preflight runs (a CPU)


def size_micro_batches(args, task, tokenizer, trained: list, update, score) -> None:
    """Before step 1, sizes the passes the flags leave open: on a GPU the most rows of the run's longest sequence
    whose update and score fit (AdamW counted) -> --*_tokens; one row too many stops now. A CPU: UNSIZED_ROWS."""
    device = next(trained[0].parameters()).device
    open_ = [kind for kind in UNSIZED_ROWS if not (getattr(args, f"{kind}_size") or getattr(args, f"{kind}_tokens"))]
    if device.type != "cuda" or not open_:
        for kind in open_:
            setattr(args, f"{kind}_size", UNSIZED_ROWS[kind])
        return
    start = time.perf_counter()
    prompt = longest_prompt(tokenizer, task)
    length = prompt + args.max_new_tokens + (args.max_turns * args.max_tool_tokens if task.tools else 0)  # + answers
    draws = torch.Generator(device).manual_seed(0)  # the run's own random stream is left as it is

    def sequences(rows: int) -> tuple:  # prompt_ids, prompt_mask, completion_ids, completion_mask
        ids = torch.randint(len(tokenizer), (rows, length), device=device, generator=draws)
        return ids[:, :prompt], torch.ones_like(ids[:, :prompt]), ids[:, prompt:], torch.ones_like(ids[:, prompt:])

    rows = args.batch_size * args.group_size // world_size()  # this rank's rows of a step
    flags = "--max_new_tokens, --gradient_checkpointing true, --lora_rank 32, --dtype bfloat16"
    passes = {
        "micro_batch": (update, rows // args.num_mini_batches, f"--micro_batch_tokens or --micro_batch_size, {flags}"),
        "logprob_chunk": (score, rows, "--logprob_chunk_tokens or --logprob_chunk_size, --max_new_tokens"),
    }
    pending = 2 * sum(local_bytes(p) for model in trained for p in model.parameters() if p.requires_grad)
    budget = PREFLIGHT_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory - pending
    chosen, timings, inside = {}, {kind: {} for kind in open_}, IN_PREFLIGHT.set(True)
    try:
        with torch.random.fork_rng(devices=[device]):  # dropout in the update's pass draws; the run's stream stays
            for kind in open_:
                for model in trained:  # step 4 finds no gradients (optimizer_step frees them); step 6 makes them
                    model.zero_grad(set_to_none=True)
                measure = functools.partial(cuda_peak, sequences=sequences, device=device, seconds=timings[kind])
                chosen[kind] = preflight(*passes[kind], budget, measure, f"{kind} of {length} tokens")
    finally:
        IN_PREFLIGHT.reset(inside)
    for model in trained:
        model.zero_grad(set_to_none=True)
    for kind, fitting in chosen.items():
        setattr(args, f"{kind}_tokens", fitting * length)
    if rank() == 0:
        sized = [f"--{kind}_tokens {fit * length} ({fit} rows of {length})" for kind, fit in chosen.items()]
        share = f"{PREFLIGHT_MEMORY_SHARE:.0%} of the GPU, AdamW's {pending / 2**30:.1f} GiB counted"
        seconds = time.perf_counter() - start
        print(f"preflight ({seconds:.1f} s): {', '.join(sized)}: the most that peak within {share}")
        print(f"preflight passes, {pass_speeds(timings, length)}")


def logprob_passes(policy, sequence_logprobs, temperature: float, vocab_size: int, amp) -> tuple:
    """The preflight's passes for the script's sequence_logprobs: step 6's forward and backward, step 4's scoring."""

    def update(sequences):
        with amp():
            logp, _ = sequence_logprobs(policy, *sequences, temperature, vocab_size, len(sequences[0]))
        logp.sum().backward()

    def score(sequences):
        policy.eval()
        with torch.no_grad(), amp():
            sequence_logprobs(policy, *sequences, temperature, vocab_size, len(sequences[0]), with_entropy=True)
        policy.train()

    return update, score


def pass_speeds(timings: dict, length: int) -> str:
    """The preflight's passes in tokens per second by rows, and the host's share (high: the GPU waited)."""
    return "; ".join(
        f"{kind}: "
        + ", ".join(
            f"{rows} row{'s' * (rows > 1)} {rows * length / s / 1e3:.1f}k tok/s (host {host:.2f} of {s:.2f} s)"
            for rows, (s, host) in runs.items()
        )
        for kind, runs in timings.items()
    )


def preflight(run, most_rows: int, flags: str, budget: float, measure, what: str) -> int:
    """The most rows (≤ most_rows) whose pass peaks within budget: 1, 2, 4, … while the line through the last
    two peaks says the next fits, then where it meets the budget; each peak the largest rank's. Else stops."""
    peaks, rows = {}, 1

    def line(rows: int) -> float:  # the peak at `rows` on the line through the last two measured
        low, high = sorted(peaks)[-2:]
        return peaks[high] + (rows - high) * (peaks[high] - peaks[low]) / (high - low)

    while True:
        peaks[rows] = all_reduce(float(measure(run, rows)), "max")
        if peaks[rows] > budget or rows >= most_rows:
            break
        following = min(2 * rows, most_rows)
        if len(peaks) >= 2 and line(following) > budget:
            break
        rows = following
    fitting = max((r for r, peak in peaks.items() if peak <= budget), default=0)
    if fitting and fitting < most_rows and len([r for r in peaks if r <= fitting]) >= 2:
        low, high = sorted(r for r in peaks if r <= fitting)[-2:]
        per_row = (peaks[high] - peaks[low]) / (high - low)
        over = min([r for r, peak in peaks.items() if peak > budget] + [most_rows + 1])
        guess = min(fitting + int((budget - peaks[fitting]) // per_row), over - 1) if per_row > 0 else over - 1
        if guess > fitting and all_reduce(float(measure(run, guess)), "max") <= budget:
            fitting = guess
    if not fitting:
        peak = "ran out of memory" if peaks[1] == float("inf") else f"{peaks[1] / 2**30:.1f} GiB at its peak"
        raise SystemExit(
            f"preflight: one row of the {what} does not fit: {peak}, over the "
            f"{budget / 2**30:.1f} GiB left of {PREFLIGHT_MEMORY_SHARE:.0%} of this GPU once AdamW's moments are "
            f"counted. Lower it with {flags} (docs/models.md: memory)."
        )
    return fitting


def cuda_peak(run, rows: int, sequences, device, seconds: dict | None = None) -> float:
    """Peak bytes while run(sequences(rows)) runs, inf if out of memory; seconds[rows]: (pass, host)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    batch = sequences(rows)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        run(batch)
        launched = time.perf_counter() - start  # the host's part: its launches (and any sync in the pass)
        torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start  # the pass, not the release of its memory below
    except RuntimeError as error:  # torch.OutOfMemoryError, or cuBLAS's or cuDNN's failed allocation
        if "out of memory" not in str(error).lower() and "alloc" not in str(error).lower():
            raise
        return float("inf")
    finally:
        torch.cuda.empty_cache()
    if seconds is not None:
        seconds[rows] = elapsed, launched
    return torch.cuda.max_memory_allocated(device)


def local_bytes(tensor) -> int:
    """Bytes of this process's part of a tensor (local_shard)."""
    local = local_shard(tensor)
    return local.numel() * local.element_size()


def turns_of(tokenizer, completion_ids, completion_mask, tool_mask) -> list[dict]:
    """A completion's turns, [{"model": text}, {"tool": text}, …], by tool_mask. (T,) each -> the turns."""
    length = int((completion_mask + tool_mask).sum())
    ids, owner = completion_ids[:length].tolist(), tool_mask[:length].tolist()
    turns, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or owner[t] != owner[start]:
            turns.append({"tool" if owner[start] else "model": tokenizer.decode(ids[start:t])})
            start = t
    return turns


def longest_prompt(tokenizer, task) -> int:
    """Tokens in the task's longest prompt, chat template and tools included."""
    texts = [render_chat(tokenizer, task.messages(problem), tools=task.tools or None) for problem in task.problems]
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def host_numbers(totals: dict) -> dict:
    """The update's 0-d tensor sums read once, after the last micro-batch: no host sync in each."""
    return {key: value.item() if torch.is_tensor(value) else value for key, value in totals.items()}


def all_reduce_metrics(metrics: dict) -> dict:
    """A step's metrics over ranks: the mean of the ranks' values, the maximum of the *_max ones."""
    if not dist.is_initialized():
        return metrics
    return {
        k: all_reduce(v, "max") if "max" in k else all_reduce(v) / world_size() if isinstance(v, (int, float)) else v
        for k, v in metrics.items()
    }


def check_distributed(args, *prompt_counts: int) -> None:
    """Stops a launch whose prompts do not split into K equal shares, or a rank's rows into mini-batches."""
    uneven = [count for count in prompt_counts if count % world_size()]
    if uneven:
        message = (
            f"{uneven[0]} prompts a step do not split over {world_size()} processes: under torchrun "
            f"--batch_size (and dapo.py's --gen_batch_size) must be a multiple of --nproc_per_node × --nnodes."
        )
        raise SystemExit(message if rank() == 0 else 1)
    rows, splits = args.batch_size * args.group_size // world_size(), args.num_mini_batches  # a rank's rows
    if world_size() > 1 and rows % splits:  # a share split unevenly, or into empty mini-batches
        fits = max(d for d in range(1, min(splits, rows) + 1) if rows % d == 0)
        message = (
            f"--num_mini_batches {splits}: each of the {world_size()} processes splits its {rows} rows "
            f"({args.batch_size} × {args.group_size} / {world_size()}) into that many mini-batches, so it must "
            f"divide {rows}: e.g. --num_mini_batches {fits}."
        )
        raise SystemExit(message if rank() == 0 else 1)
    if world_size() > 1 and args.lora_rank:
        raise SystemExit(
            "--lora_rank with torchrun is not supported yet: train LoRA in one process." if rank() == 0 else 1
        )


def shard_model(model, compute_dtype: torch.dtype | None = None, fp32_modules: tuple[str, ...] = ()):
    """FSDP2: a unit per decoder layer and per fp32_modules (kept fp32), then the root. compute_dtype: gathered
    and computed in it, reduced in fp32; gradients summed, each rank's loss being over the global normaliser."""
    if not dist.is_initialized():
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    frozen = not any(p.requires_grad for p in model.parameters())  # the reference: no backward will reshard it
    for name, module in model.named_modules():
        if type(module).__name__.endswith("DecoderLayer"):
            fully_shard(module, mp_policy=precision)
        elif name in fp32_modules:
            fully_shard(module, reshard_after_forward=frozen, mp_policy=MixedPrecisionPolicy())
    fully_shard(model, reshard_after_forward=frozen, mp_policy=precision)  # a trained root stays gathered
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):  # every FSDP unit
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-scaled sum)
    return model


@contextlib.contextmanager
def unsharded(model):
    """Full weights for a rollout: one all-gather a rollout, not a token; ranks may decode unequal lengths."""
    if not dist.is_initialized():
        yield
        return
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)  # the layers as shard_model left them, and the root:
        model.set_reshard_after_forward(not any(p.requires_grad for p in model.parameters()), recurse=False)
        for module in model.modules():
            if hasattr(module, "reshard"):
                module.reshard()


def full_state_dict(model) -> dict | None:
    """Every rank takes part; rank 0 gets the whole model's weights on the CPU, the others None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if rank() == 0 else None


def trainer_state_file() -> str:
    """trainer_state.pt for rank 0, trainer_state-rank<r>.pt for rank r (its AdamW shard and RNG)."""
    return TRAINER_STATE if rank() == 0 else TRAINER_STATE.replace(".pt", f"-rank{rank()}.pt")


def broadcast(value):
    """Rank 0's `value` (any picklable object) on every rank; one process: `value`."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


LAST_BARRIER = []  # the exit barrier's work, freed by the main thread as the interpreter exits


def leave_process_group() -> None:
    """A barrier, then the group destroyed; gloo's work held for the main thread (docs/distributed.md)."""
    if dist.get_backend() == "gloo":
        work = dist.barrier(async_op=True)
        work.wait()
        LAST_BARRIER.append(work)
    else:
        dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# Models and tokenizers


def resolve_model_name(name: str) -> str:
    """--model as typed -> a local directory, a Hub id, or a GGUF file's path (model_source)."""
    if name in TINY_MODELS:
        return str(build_tiny_model(name=name))
    local = Path(name).expanduser()
    if local.is_file():
        if local.suffix != ".gguf":
            raise SystemExit(
                f"--model {name!r} is a file but not a .gguf file. Pass a model directory (config.json, weights "
                "and tokenizer files), a GGUF file, a Hub id or a short name."
            )
        return str(local)
    if local.is_dir():
        ggufs = sorted(local.glob("*.gguf")) if not (local / "config.json").exists() else []
        if len(ggufs) > 1:
            raise SystemExit(
                f"--model {name!r} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)}); "
                "pass the one to load as --model <directory>/<file>.gguf."
            )
        return str(ggufs[0] if ggufs else local)
    if local.suffix == ".gguf":
        raise SystemExit(f"--model {name!r}: no such file; give the path of an existing .gguf file.")
    if name in MODEL_ALIASES:
        return MODEL_ALIASES[name]
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", name):
        return name  # a Hub id such as Qwen/Qwen2.5-1.5B-Instruct
    raise SystemExit(
        f"--model {name!r} is not a local directory, a Hub id of the form 'org/name', {', '.join(TINY_MODELS)}, "
        f"or one of the short names: {', '.join(MODEL_ALIASES)}."
    )


def model_source(path: str) -> tuple[str, dict]:
    """from_pretrained's (path, keywords): a GGUF file via gguf_file=, dequantised (the gguf package)."""
    if not path.endswith(".gguf"):
        return path, {}
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader imports it)
    except ImportError as error:
        raise SystemExit(
            f"--model {path!r} is a GGUF file; reading one needs the gguf package: pip install gguf"
        ) from error
    return str(Path(path).parent), {"gguf_file": Path(path).name}


def dequantised(model):
    """A GGUF model without its quantised mark, which would make save_pretrained refuse it."""
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    return model


def eos_token_ids(model_path: str, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's plus the tokenizer's EOS."""
    ids = []
    try:
        generation_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # the model ships no generation_config.json
        generation_eos = None
    if generation_eos is not None:
        ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise SystemExit(f"{model_path}: neither its generation config nor its tokenizer names an EOS token.")
    return sorted(set(ids))


# Tokens that exist in common vocabularies and never end a completion: good pad tokens.
PAD_CANDIDATES = ["<|endoftext|>", "<|fim_pad|>", "<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>"]


def set_pad_token(tokenizer, eos_ids: list[int]) -> None:
    """Left padding, and a pad token that is not an EOS where one exists (nanoPO masks by position)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in eos_ids:
        return
    vocab = tokenizer.get_vocab()
    for candidate in PAD_CANDIDATES:
        if candidate in vocab and vocab[candidate] not in eos_ids:
            tokenizer.pad_token = candidate
            return
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def check_prompt_format(prompt_format: str) -> list[str]:
    if prompt_format not in PROMPT_FORMATS:
        return [f"--prompt_format {prompt_format!r} is not one of: {', '.join(PROMPT_FORMATS)}."]
    return []


def set_prompt_format(tokenizer, prompt_format: str, name: str) -> None:
    """Sets tokenizer.plain_prompt: auto is the chat template if there is one; chat without one stops."""
    if prompt_format not in PROMPT_FORMATS:
        raise SystemExit(check_prompt_format(prompt_format)[0])
    if prompt_format == "chat" and tokenizer.chat_template is None:
        raise SystemExit(
            f"The tokenizer of {name!r} has no chat template, so --prompt_format chat cannot write its prompts. "
            "Use --prompt_format plain (or auto) for a base model, or add a chat_template to tokenizer_config.json."
        )
    tokenizer.plain_prompt = prompt_format == "plain" or tokenizer.chat_template is None
    if tokenizer.plain_prompt and prompt_format == "auto":
        print(f"{name}: the tokenizer has no chat template; prompts are plain text (--prompt_format plain).")


def render_plain(tokenizer, messages: list[dict]) -> str:
    """A conversation as plain text for a base model: the system text, 'Question: …' and 'Answer: …'."""
    parts = []
    for message in messages:
        if message["role"] == "user":
            parts.append(f"Question: {message['content']}\n")
        elif message["role"] == "assistant":
            parts.append(f"Answer: {message['content']}\n\n")
        else:
            parts.append(f"{message['content']}\n\n")
    bos = tokenizer.bos_token_id is not None and tokenizer("x").input_ids[:1] == [tokenizer.bos_token_id]
    return (tokenizer.bos_token if bos else "") + "".join(parts) + "Answer:"


TOOLS_NOT_SHOWN_FIX = "drop --tools/--tool (a task with tools of its own, such as --task secret, needs such a model)"


def render_chat(
    tokenizer, messages: list[dict], tools: list[Callable] | None = None, *, tools_fix: str = TOOLS_NOT_SHOWN_FIX
) -> str:
    """One conversation through the chat template up to the assistant's turn (or render_plain). Without
    a system role the system text tops the first user message; tools a template ignores stop the run."""
    if getattr(tokenizer, "plain_prompt", False):
        if tools:
            raise SystemExit(
                "Tools need a chat template, to show the model the tools and their answers, and "
                + plain_prompt_advice(tokenizer)
            )
        return render_plain(tokenizer, messages)
    shown = {"tools": tools} if tools else {}  # no tools: the template's own text, not an empty tools section
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **shown)
    except TemplateError:
        if messages[0]["role"] != "system":
            raise
        text = None
    if messages[0]["role"] == "system" and (text is None or messages[0]["content"] not in text):
        system, first, *rest = messages
        folded = {"role": first["role"], "content": f"{system['content']}\n\n{first['content']}"}
        text = tokenizer.apply_chat_template([folded, *rest], add_generation_prompt=True, tokenize=False, **shown)
    if tools and text == render_chat(tokenizer, messages):  # the same prompt as without them
        raise SystemExit(
            f"The chat template of this model does not show the tools {[tool.__name__ for tool in tools]} in its "
            "prompts, so the model could not know it may call them. Use a model whose template takes `tools` "
            f"(Qwen2.5, Qwen3, Llama 3.1; tiny-tools among the tiny ones), or {tools_fix}."
        )
    return text


def check_task_tools(tokenizer, task, max_tool_tokens: int) -> None:
    """Stops, before a run starts, where the template hides the task's tools or answers, or overfills one."""
    if task is None or not task.tools:
        return
    render_chat(tokenizer, task.messages(task.problems[0]), tools=task.tools)
    check_tool_turns(tokenizer)
    around = len(tokenizer(tool_turn_text(tokenizer, [("", "")]), add_special_tokens=False)["input_ids"])
    if around > max_tool_tokens:
        raise SystemExit(too_few_tool_tokens(max_tool_tokens, around))


def load_model(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    prompt_format: str = "auto",
):
    """(model, tokenizer, eos_ids) for --model `name`, prompts rendered in prompt_format."""
    path = resolve_model_name(name)
    if Path(path).is_dir() and not (Path(path) / "config.json").exists() and (Path(path) / ADAPTER_DIR).is_dir():
        raise SystemExit(
            f"--model {name!r} is a LoRA checkpoint: it holds adapters ({ADAPTER_DIR}/), not a model. Only a run's "
            "final/ holds the merged model; to continue training, pass this checkpoint to --resume_from."
        )
    if Path(path).is_dir() and not (Path(path) / "config.json").exists():
        raise SystemExit(
            f"--model {name!r} is a directory without config.json. Point it at a model directory "
            "(one written by save_pretrained, e.g. runs/<run>/final) or use a Hub id."
        )
    if Path(path).is_dir() and not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        raise SystemExit(
            f"--model {name!r}: the directory has a model but no tokenizer files (tokenizer.json, or "
            "tokenizer.model, or vocab.json and merges.txt). Save them beside the weights with "
            "AutoTokenizer.from_pretrained(<base model>).save_pretrained(<this directory>)."
        )
    source, gguf = model_source(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **gguf)
        # In the checkpoint's own dtype, cast to `dtype` below (exact): half the host memory a rank.
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype if gguf else "auto", **gguf)
    except (OSError, ValueError, KeyError, RuntimeError) as error:  # KeyError: a corrupt tokenizer.json
        if "Unrecognized configuration class" in str(error):  # transformers has no causal LM of its kind
            raise SystemExit(not_servable(name, type(error).__name__ + ": " + str(error).splitlines()[0])) from error
        raise SystemExit(
            f"Could not load model {name!r} (resolved to {path!r}): {error}\n"
            "A Hub id needs internet access to huggingface.co, or the model in the local HF cache; "
            "a local path must hold config.json, the weights and the tokenizer files (or be a GGUF file "
            "of an architecture transformers reads)."
        ) from error
    if gguf:
        dequantised(model)
    check_servable(model, name)
    set_prompt_format(tokenizer, prompt_format, name)
    eos_ids = eos_token_ids(source, tokenizer)
    set_pad_token(tokenizer, eos_ids)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device=device, dtype=dtype)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model, tokenizer, eos_ids


SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")  # the attention generate's KV cache and masks serve


def not_servable(name: str, reason: str) -> str:
    return (
        f"--model {name!r} cannot be trained here: {reason}. nanoPO trains decoder-only causal language models "
        f"(AutoModelForCausalLM) whose layers attend over full or sliding windows ({', '.join(SERVED_LAYER_TYPES)}): "
        "Qwen2/2.5/3, Llama, Mistral, Gemma 2/3, Phi-3, OLMo 2, SmolLM3, gpt-oss, Cohere2 and the like "
        "(docs/models.md lists the families tested)."
    )


def check_servable(model, name: str) -> None:
    """Stops on a model generate cannot serve: an encoder-decoder, no LM head, or not windowed attention."""
    config = model.config.get_text_config()
    if getattr(model.config, "is_encoder_decoder", False) or getattr(config, "is_encoder_decoder", False):
        raise SystemExit(not_servable(name, f"{model.config.model_type} is an encoder-decoder model"))
    if model.get_output_embeddings() is None:
        raise SystemExit(not_servable(name, f"{type(model).__name__} has no language-model head"))
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(SERVED_LAYER_TYPES))
    if unknown:
        raise SystemExit(not_servable(name, f"{config.model_type} has layers of type {', '.join(unknown)}"))


def enable_activation_checkpointing(model) -> None:
    """Recompute activations in backward, under either name transformers gives the method."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})  # first parameter under both names


def check_cache_fits(args, task, device: torch.device) -> None:
    """Stops, before any weight loads, where one completion's KV cache outgrows the device's free memory."""
    columns = args.max_new_tokens + (args.max_turns * args.max_tool_tokens if task is not None and task.tools else 0)
    try:
        path, keywords = model_source(resolve_model_name(args.model))
        config = AutoConfig.from_pretrained(path, **keywords).get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        per_column = 2 * config.num_hidden_layers * kv_heads * head_dim * (2 if device.type == "cuda" else 4)
        free = (
            torch.cuda.mem_get_info(device)[0]
            if device.type == "cuda"
            else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        )
    except (Exception, SystemExit):  # no config to read here (a GGUF file without gguf, a Hub id offline, ...)
        return
    if columns * per_column > free:
        tools = (
            f" + --max_turns {args.max_turns} × --max_tool_tokens {args.max_tool_tokens}"
            if columns > args.max_new_tokens
            else ""
        )
        raise SystemExit(
            f"One completion's KV cache would need {columns * per_column / 2**30:,.1f} GiB ({columns:,} positions: "
            f"--max_new_tokens {args.max_new_tokens}{tools}), more than the {free / 2**30:,.1f} GiB free on {device}: "
            "lower " + ("--max_turns or --max_tool_tokens." if tools else "--max_new_tokens.")
        )


def load_policy(args, device: torch.device, dtype: torch.dtype, compute_dtype: torch.dtype | None = None, task=None):
    """(policy, tokenizer, eos_ids): --model's (or --resume_from's) weights, or with LoRA (Hu et al. 2021)
    --model's frozen under adapters W + (α/r)·B·A, B = 0 so it starts as --model (resumed: adapter/)."""
    check_cache_fits(args, task, device)  # before any weight loads
    if task is not None and task.tools and args.max_turns == 0:
        names = ", ".join(tool.__name__ for tool in task.tools)
        raise SystemExit(
            f"--max_turns 0 gives the task's tools ({names}) no turn: a call would end its completion unanswered. "
            "Give --max_turns 1 or more (default 4)."
        )
    if not args.lora_rank:
        policy, tokenizer, eos_ids = load_model(
            args.resume_from or args.model, device, dtype, args.gradient_checkpointing, args.prompt_format
        )
        check_task_tools(tokenizer, task, args.max_tool_tokens)
        return compile_blocks(policy, args.compile), tokenizer, eos_ids
    frozen = frozen_dtype(dtype, compute_dtype)
    model, tokenizer, eos_ids = load_model(args.model, device, frozen, args.gradient_checkpointing, args.prompt_format)
    check_task_tools(tokenizer, task, args.max_tool_tokens)
    saved = Path(args.resume_from) / ADAPTER_DIR if args.resume_from else None
    return compile_blocks(with_adapters(model, args, saved), args.compile), tokenizer, eos_ids


def frozen_dtype(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    """LoRA's frozen weights in the compute dtype: no fp32 master needed, no cast in every forward."""
    return compute_dtype or dtype


def with_adapters(model, args, saved: Path | None = None):
    """`model`, frozen, under new LoRA adapters (B = 0: unchanged at first) or those saved in `saved`."""
    from peft import LoraConfig, PeftModel, get_peft_model

    with warnings.catch_warnings():  # peft reads model.is_gradient_checkpointing, which transformers deprecates
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        if saved is not None:
            return PeftModel.from_pretrained(model, saved, is_trainable=True)
        names = [name.strip() for name in args.lora_targets.split(",") if name.strip()]
        targets = "all-linear" if names == ["all-linear"] else names
        config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=targets, lora_dropout=0.0)
        try:
            return get_peft_model(model, config)
        except ValueError as error:  # peft's: a name that matches no layer of this model
            linear = sorted(
                {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            )
            raise SystemExit(
                f"--lora_targets {args.lora_targets}: {error}. This model's linear layers are named "
                f"{', '.join(linear)}; give some of them, comma separated, or all-linear."
            ) from error


def load_reference(args, policy, device: torch.device, dtype: torch.dtype):
    """π_ref, the starting model: a copy loaded from --model (a resume keeps the true start), or LoRA's off."""
    if args.lora_rank:
        return AdaptersOff(policy)
    reference, _, _ = load_model(args.model, device, dtype)
    return compile_blocks(reference.eval().requires_grad_(False), args.compile)  # --compile: as the policy's


class AdaptersOff:
    """A LoRA policy with its adapters off; a callable, not a module, so nothing changes the policy."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)

    def get_output_embeddings(self):  # the policy's LM head, which the scripts' fp32_lm_head reads
        return self.policy.get_output_embeddings()

    def modules(self):  # what the scripts read off a model (the keyword of its cache), not a way to change it
        return self.policy.modules()

    @property
    def training(self) -> bool:
        return self.policy.training


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def save_merged(policy, directory: Path) -> None:
    """A LoRA policy saved as one full model, W + (α/r)·B·A summed in fp32 on the CPU (the policy unchanged)."""
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    state = {k.replace(".base_layer", ""): v.cpu() for k, v in base.state_dict().items() if "lora_" not in k}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                weight = module.base_layer.weight  # the sum in fp32, stored in the model's own dtype
                merged = weight.float() + module.get_delta_weight(module.active_adapters[0]).float()
                state[f"{name}.weight"] = merged.to(weight.dtype).cpu()
                if name.endswith("lm_head"):  # an adapted LM head is no longer its embedding's tie
                    base.config.tie_word_embeddings = False
    base.save_pretrained(directory, state_dict=state, safe_serialization=True)


# ----------------------------------------------------------------------------------------
# The model's runtime: how it runs fast, called by name; each says why it is exact (docs/speed.md
# measures it). What it needs of a script (the log-prob formula, the KV cache) is passed in.
#   precision   autocast, the LM head's fp32/TF32 product (fp32_lm_head)
#   decode      CUDA graphs, the attention bindings, MoE routing for capture, torch.compile
#   head        log-probs from the hidden states, chunk by chunk (logprob_head, HeadLogprobs)
#   passes      rows laid out and chunked by length, each prompt once per group (forward_completions)


@contextlib.contextmanager
def autocast(device: torch.device, compute_dtype: torch.dtype | None):
    """bf16 autocast where compute_dtype asks for it; a no-op context otherwise."""
    if compute_dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=compute_dtype):
        yield


HEAD_PRECISION = "tf32"  # the LM head's GEMMs on a GPU; "bf16" (bf16 inputs, fp32 sums): bench.py's contender


def head_precision(hidden: torch.Tensor) -> str | None:
    """The precision of the head's GEMMs for these hidden states: HEAD_PRECISION on a GPU, None (fp32) on the CPU."""
    return HEAD_PRECISION if hidden.is_cuda else None


@contextlib.contextmanager
def fp32_lm_head(model, weight: torch.Tensor | None = None):
    """Within it a Linear LM head's logits are fp32 under autocast (its GEMMs in head_precision: TF32 on a GPU),
    not rounded to bf16. weight: the head's cast once for that precision (head_weight), else its own."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or not torch.is_autocast_enabled(head.weight.device.type):
        yield
        return

    def forward(hidden):
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if head.bias is None else head.bias.float()
            precision, read = head_precision(hidden), head.weight.float() if weight is None else weight
            if precision is None:  # the CPU: fp32
                return torch.nn.functional.linear(hidden.float(), read, bias)
            return HeadProduct.apply(hidden.float(), read, bias, precision)

    with forward_replaced(head, forward):
        yield


def head_weight(model) -> torch.Tensor | None:
    """The LM head's weight in bf16 where its GEMMs take bf16 inputs (head_precision) under autocast (else
    fp32_lm_head leaves the head alone): the decode step casts it once a generate call, not once a token. Else
    None, and fp32_lm_head reads the head's own. Under torchrun generate runs on the gathered weights
    (`unsharded`), a Parameter that stays whole through the call; a DTensor shard, no Parameter, gets None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or type(head.weight) is not torch.nn.Parameter:
        return None
    bf16 = torch.is_autocast_enabled(head.weight.device.type) and head_precision(head.weight) == "bf16"
    return head.weight.detach().bfloat16() if bf16 else None


@contextlib.contextmanager
def forward_replaced(module, forward):
    """Within it module.forward is `forward`; after, what it was (a hook library's own wrapper too)."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        del module.forward
        if previous is not None:
            module.forward = previous


def bf16_activations(model):
    """Issue 58's lever 4, a contender no script chooses yet (bench.py --bf16_activations): under autocast the
    activations between the products run in autocast's dtype, as under torchrun's FSDP2, which gathers bf16
    weights. Cast there: the input embedding's output and each RMSNorm's within the layers (the product with
    its fp32 weight, which each product it feeds would cast again; where a norm casts back to its input's
    dtype itself, Gemma's and Olmo2's, the cast is a no-op, and Cohere2's LayerNorm needs none). So the
    residual stream and its adds, the norms, the rotary products (cos and sin take the hidden states' dtype)
    and an MoE block's routing weights (they take its input's) run in bf16; the final norm feeds the fp32
    head as it is. The weights, their gradients and AdamW stay fp32. Without autocast it changes nothing."""

    def cast(module, inputs, output):
        device = output.device.type
        return output.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else output

    layers = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "layers"]
    norms = [m for stack in layers for m in stack.modules() if type(m).__name__.endswith("RMSNorm")]
    for module in [model.get_input_embeddings(), *norms]:
        module.register_forward_hook(cast)
    return model


class HeadProduct(torch.autograd.Function):
    """hidden · Wᵀ + b, fp32 out, its three GEMMs alone in `precision` (head_mm): every other product stays
    exact, and sampler, scorer and update share it, so their log-probs agree."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, precision: str):  # (…, d), (V', d), (V',) or None -> (…, V')
        ctx.save_for_backward(hidden, weight)
        ctx.precision, ctx.with_bias = precision, bias is not None
        return head_linear(hidden, weight, bias, precision)

    @staticmethod
    def backward(ctx, grad):  # (…, V')
        hidden, weight = ctx.saved_tensors
        rows, inputs = grad.reshape(-1, grad.shape[-1]), hidden.reshape(-1, hidden.shape[-1])  # (M, V'), (M, d)
        grad_hidden = grad_weight = None
        with torch.autocast(grad.device.type, enabled=False):  # the forward's fp32 products, wherever called
            if ctx.needs_input_grad[0]:
                grad_hidden = head_mm(rows, weight, ctx.precision).reshape(hidden.shape)  # (…, d)
            if ctx.needs_input_grad[1]:
                grad_weight = head_mm(rows.T, inputs, ctx.precision).to(weight.dtype)  # (V', d)
        grad_bias = rows.sum(0) if ctx.with_bias and ctx.needs_input_grad[2] else None  # (V',)
        return grad_hidden, grad_weight, grad_bias, None


def head_linear(hidden, weight, bias, precision: str) -> torch.Tensor:
    """hidden · Wᵀ + b in `precision` (head_mm), fp32 out. (…, d), (V', d), (V',) or None -> (…, V')."""
    if precision != "bf16":
        with matmul_precision(precision):
            return torch.nn.functional.linear(hidden, weight, bias)
    out = head_mm(hidden.reshape(-1, hidden.shape[-1]), weight.T, precision).reshape(*hidden.shape[:-1], len(weight))
    return out if bias is None else out + bias


def head_mm(a, b, precision: str, into: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b, fp32 out (into: added into it, in place). precision: cuBLAS's for fp32 inputs, "ieee" or "tf32"
    (matmul_precision); or "bf16": a and b rounded to bf16, their products summed in fp32, as a GPU's bf16
    GEMM with an fp32 output runs (torch.mm's out_dtype), which the CPU computes in fp32 from the rounded
    inputs, the same products. (m, k), (k, n) -> (m, n)."""
    if precision != "bf16":
        with matmul_precision(precision):
            return a @ b if into is None else into.addmm_(a, b)
    a, b = a.bfloat16(), b.bfloat16()
    if a.is_cuda:  # CUDA alone has the bf16 GEMM with an fp32 output (and an fp32 `into` from torch 2.10, the floor)
        if into is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(into, a, b, out_dtype=torch.float32, out=into)
    return a.float() @ b.float() if into is None else into.addmm_(a.float(), b.float())


@contextlib.contextmanager
def matmul_precision(precision: str):
    """cuBLAS's precision for fp32 matmuls ("ieee" or "tf32") within it only."""
    previous = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = precision
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous


def cuda_graph(step, pool=None):
    """step() on fixed tensors as a CUDA graph: the function returned replays it, returning its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: lazy set-up (cuBLAS, autocast's casts)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()

    def replay():
        graph.replay()
        return output

    return replay


CAPTURE_FAILED = []  # the error of a CUDA-graph capture that raised: every later decode runs eagerly


def captured_or_none(step, pool):
    """step() captured, or None after one warning if capture fails: eager from then on, the same tokens."""
    if CAPTURE_FAILED:
        return None
    try:
        return cuda_graph(step, pool)
    except (torch.OutOfMemoryError, torch._dynamo.exc.TorchDynamoException):
        raise
    except RuntimeError as error:  # CUDA and capture errors (torch.AcceleratorError is one)
        CAPTURE_FAILED.append(error)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        warnings.warn(
            f"CUDA-graph capture of the decode step failed ({type(error).__name__}: {first_line}); "
            "decoding runs eagerly from now on: the same tokens, slower (docs/speed.md).",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def cache_argument(model) -> str:
    """The keyword the model takes a KV cache by: `cache` from transformers 5.24, else `past_key_values`."""
    inner = next((module for module in model.modules() if isinstance(module, PreTrainedModel)), model)
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def attention_windows(model) -> dict[str, int | None]:
    """Each attention type -> its window (None: all), a mask each, as transformers windows no 4D mask."""
    if getattr(model, "config", None) is None:
        return {"full_attention": None}
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"]
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:  # chunked (Llama 4), linear (Qwen3-Next), state-space layers: not a window over one cache
        raise ValueError(f"{config.model_type} has {sorted(unknown)} layers; generate serves full and sliding ones")
    return {kind: window if kind == "sliding_attention" else None for kind in dict.fromkeys(layer_types)}


def decode_widths(prompt_length: int, max_new_tokens: int, smallest: int = 64) -> list[int]:
    """The masked step's widths, P + 64, P + 128, … to P + max_new_tokens: ≤ twice the filled columns read."""
    widths, new = [], smallest
    while new < max_new_tokens:
        widths.append(prompt_length + new)
        new *= 2
    return widths + [prompt_length + max_new_tokens]


@contextlib.contextmanager
def sdpa_replaced(model, name: str, function):
    """Within it a model that runs sdpa runs `function` (registered as `name`) instead; others keep theirs."""
    AttentionInterface.register(name, function)
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":  # not sdpa, or not a transformers model
        yield
        return
    attention, config._attn_implementation = config._attn_implementation, name
    try:
        yield
    finally:
        config._attn_implementation = attention


def grouped_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **unused):
    """The one-token attention, a KV head's query heads as rows of one query: the same products, K and V
    not copied per head. (n, heads, 1, d), (n, kv heads, S, d) ×2, mask (n, 1, 1, S) -> (n, 1, heads, d)."""
    num_rows, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(num_rows, kv_heads, heads // kv_heads, head_dim)  # head h = kv head h // group
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(num_rows, 1, heads, head_dim), None


def grouped_attention(model):
    """Within it the model's attention layers run grouped_decode_attention (sdpa_replaced)."""
    return sdpa_replaced(model, "nanopo_grouped_decode", grouped_decode_attention)


def varlen_decode_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, used, starts, **unused
):
    """The masked step's attention by flash varlen over a left-aligned cache, row i over its first used[i]
    columns, none past them. (n, heads, 1, d), (n, kv heads, S, d) ×2, starts (n + 1,) -> (n, 1, heads, d)."""
    num_rows, heads, _, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    out = torch.ops.aten._flash_attention_forward(
        query.to(value.dtype).reshape(num_rows, heads, head_dim),  # autocast's fp32 rotary makes it fp32
        key.transpose(1, 2).reshape(num_rows * length, kv_heads, head_dim),  # views of the buffers: no copy
        value.transpose(1, 2).reshape(num_rows * length, kv_heads, head_dim),
        starts,  # row i: query i, …
        starts * length,  # … its keys from column 0 of its own S
        1,
        length,
        0.0,
        False,
        False,
        scale=scaling,
        seqused_k=used,
    )[0]  # (n, heads, d)
    return out.reshape(num_rows, 1, heads, head_dim), None


def varlen_attention(model, used: torch.Tensor):
    """Within it the model's attention layers run varlen_decode_attention (sdpa_replaced)."""
    starts = torch.arange(len(used) + 1, dtype=torch.int32, device=used.device)  # once a step, not a layer
    attention = functools.partial(varlen_decode_attention, used=used, starts=starts)
    return sdpa_replaced(model, "nanopo_varlen_decode", attention)


def varlen_decode(model, cache) -> bool:
    """Whether the one-token step runs varlen_decode_attention: all full sdpa layers, a cache flash takes."""
    config = getattr(model, "config", None)
    return (
        getattr(config, "_attn_implementation", None) == "sdpa"
        and attention_windows(model) == {"full_attention": None}
        and flash_varlen_serves(cache.values[0])
    )


def flash_varlen_serves(values: torch.Tensor) -> bool:
    """Whether flash varlen takes `values`: NVIDIA sm80+, flash SDPA on, bf16/fp16, head size a multiple of 8, ≤ 256."""
    return (
        values.is_cuda
        and torch.version.hip is None
        and values.dtype in (torch.bfloat16, torch.float16)
        and values.shape[-1] % 8 == 0
        and values.shape[-1] <= 256
        and torch.backends.cuda.is_flash_attention_available()
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(values.device) >= (8, 0)
    )


def routing_free_experts(self, hidden_states, top_k_index, top_k_weights):
    """Experts whose shapes do not depend on the routing (a CUDA graph holds them): every token through
    every expert, its top-k summed in transformers' order, at E/k the FLOPs. (n, H), (n, k) ×2 -> (n, H)."""
    up_weight = self.gate_up_proj if self.has_gate else self.up_proj  # (E, 2I or I, H), transposed (E, H, …)
    with torch.autocast(hidden_states.device.type, enabled=False):  # the weights' dtype, as grouped_mm runs
        hidden = hidden_states.to(up_weight.dtype)  # (n, H)
        up = torch.matmul(hidden, up_weight if self.is_transposed else up_weight.transpose(-2, -1))  # (E, n, 2I)
        if self.has_bias:
            up = up + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[:, None]
        inner = self._apply_gate(up) if self.has_gate else self.act_fn(up)  # (E, n, I)
        out = torch.matmul(inner, self.down_proj if self.is_transposed else self.down_proj.transpose(-2, -1))
        if self.has_bias:
            out = out + self.down_proj_bias[:, None]  # (E, n, H)
        if getattr(self, "has_post_expert_norm", False):  # transformers ≥ 5.24's experts may norm each output
            out = self.post_expert_norm(out)
        rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]  # (n, 1)
        chosen = out[top_k_index, rows] * top_k_weights[..., None]  # (n, k, H) in the routing weights' dtype too
        return chosen.sum(dim=1).to(hidden_states.dtype)  # (n, H)


@contextlib.contextmanager
def captured_experts(model):
    """Within it (the captured decode step) the model's experts run routing_free_experts."""
    ALL_EXPERTS_FUNCTIONS.register("nanopo_routing_free", routing_free_experts)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "config")}
    # the attribute behind the property, whose setter would also set every sub-config to this one's value
    saved = {key: config._experts_implementation_internal for key, config in configs.items()}
    for config in configs.values():
        config._experts_implementation_internal = "nanopo_routing_free"
    try:
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation_internal = saved[key]


MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # a block's products of one input


class MergedProducts:
    """The decode step's q, k and v products as one product, and gate and up as one, in every block that
    computes them apart from one input (Phi-3's are one already): a launch and a read of the input, not three.
    The weights are joined once a generate call (they change between calls), in the dtype the product runs in
    (bf16 under autocast, whose cached casts of the prefill are let go first: one bf16 copy, not two), and
    held by the step alone. Within it the first Linear of a group computes the group's product and the others
    return their columns when given the same input tensor, else their own product. Each column is the same
    dot product: the CPU gives the separate products bit for bit. The Linears are MergedLinear for the step:
    one class for every model, so compiled code holds. on: merges(device), else no group."""

    def __init__(self, model, on: bool = True):
        self.groups = []  # [(the Linears, {"sizes", "weight", "bias", "input", "parts"})]
        grouped = set()  # a Linear in one group at most (a layer may share another's)
        if on:  # the prefill's bf16 casts go; the step's first call casts what it still needs
            torch.clear_autocast_cache()
        for module in model.modules() if on else ():
            for names in MERGED:
                linears = [getattr(module, name, None) for name in names]
                if mergeable(linears) and not grouped & {id(linear) for linear in linears}:
                    grouped |= {id(linear) for linear in linears}
                    weight, bias = joined_weights(linears)
                    sizes = [linear.out_features for linear in linears]
                    self.groups.append((linears, dict(sizes=sizes, weight=weight, bias=bias, input=None, parts=())))

    @contextlib.contextmanager
    def within(self):
        """Within it the merged groups' Linears are MergedLinear, each given its group and place in it."""
        try:
            for linears, group in self.groups:
                for index, linear in enumerate(linears):
                    linear.__class__, linear.merged = MergedLinear, (group, index)
            yield
        finally:  # every Linear as it was, whatever stopped the step (an interrupt among them too)
            for linears, group in self.groups:
                group["input"], group["parts"] = None, ()  # no step's tensor held past it
                for linear in linears:
                    linear.__class__ = torch.nn.Linear
                    linear.__dict__.pop("merged", None)


class MergedLinear(torch.nn.Linear):
    """A Linear of a merged group for a decode step (MergedProducts.within): its output through merged_product."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return merged_product(*self.merged, hidden)


def joined_weights(linears: list) -> tuple:
    """The Linears' weights and biases as one, in the dtype autocast would cast them to (none: theirs)."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None if linears[0].bias is None else torch.cat([linear.bias.detach() for linear in linears])
    device = weight.device.type
    if torch.is_autocast_enabled(device) and weight.dtype == torch.float32:  # autocast's own cast, once
        dtype = torch.get_autocast_dtype(device)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    return weight, bias


def merges(device: torch.device) -> bool:
    """Whether the decode step merges its products: on a GPU, where every product is a launch. The CPU pays
    no launch, and its kernels over the merged product's slices cost more (docs/speed.md); under torchrun
    each rank would hold a full copy of the joined weights."""
    return device.type == "cuda" and not dist.is_initialized()


def mergeable(linears: list) -> bool:
    """Plain Linears (no adapter, quantised weight or FSDP shard, no replaced forward) of one input width,
    dtype and device, all with a bias or none."""
    return (
        all(type(linear) is torch.nn.Linear and "forward" not in linear.__dict__ for linear in linears)
        and all(type(linear.weight) is torch.nn.Parameter for linear in linears)  # not a DTensor's shard
        and len({(linear.in_features, linear.weight.dtype, linear.weight.device) for linear in linears}) == 1
        and len({linear.bias is None for linear in linears}) == 1
    )


def merged_product(group: dict, index: int, hidden: torch.Tensor) -> torch.Tensor:
    """The index-th Linear's output: the first computes the group's product, the others take their columns
    of it if their input is the first's, else (an input of its own) they compute theirs alone."""
    if index == 0:
        group["input"] = hidden
        group["parts"] = torch.nn.functional.linear(hidden, group["weight"], group["bias"]).split(group["sizes"], -1)
    elif group["input"] is not hidden:
        start = sum(group["sizes"][:index])
        rows = slice(start, start + group["sizes"][index])
        bias = None if group["bias"] is None else group["bias"][rows]
        return torch.nn.functional.linear(hidden, group["weight"][rows], bias)
    return group["parts"][index]


MASKED = -1e30  # the bias of a position not attended to: exp() of it is 0, finite in bf16 and fp32


def by_type(masks: dict):
    """What a model takes for its attention mask: one for every layer, or one per layer type (a dict)."""
    return masks if len(masks) > 1 else next(iter(masks.values()))


def prefill_mask(model, prompt_mask: torch.Tensor, length: int):
    """The prefill's additive masks (B, 1, P, P), one per attention type: causal, left padding hidden,
    a sliding layer's window applied. length: the cache's columns. prompt_mask (B, P) -> by_type."""
    num_rows, prompt_length = prompt_mask.shape
    device = prompt_mask.device
    causal = torch.ones(prompt_length, prompt_length, dtype=torch.bool, device=device).tril()  # (P, P) keys ≤ query
    visible = torch.zeros(num_rows, prompt_length, prompt_length, dtype=torch.bool, device=device)  # (B, P, P)
    visible[:] = causal & prompt_mask[:, None, :].bool()
    columns = torch.arange(prompt_length, device=device)  # (P,) key columns; a query's column is its row
    return by_type(
        {
            kind: torch.where(visible & (columns[:, None] - columns < (window or length)), 0.0, MASKED)[:, None]
            for kind, window in attention_windows(model).items()
        }
    )


class DecodeStep:
    """generate's one-token step through the model and the script's KV cache, its buffers changed in place
    for a CUDA graph; varlen or grouped attention, the model's own function. prompt_mask (N, P); position (N, 1)."""

    def __init__(self, model, cache, prompt_mask, position, steps: int, pad_id: int, vocab_size: int):
        num_rows, prompt_length = prompt_mask.shape
        device = prompt_mask.device
        length = cache.length  # S: P + max_new_tokens; more as tools' answers come (grow), to P + steps + 1 (varlen)
        self.most = prompt_length + steps + 1  # varlen: no row's slot passes P + steps (a column a token it fills)
        self.model, self.cache, self.vocab_size, self.prompt_length = model, cache, vocab_size, prompt_length
        self.windows = attention_windows(model)  # attention type -> window; a mask per type
        self.cache_name = cache_argument(model)  # the keyword the model takes it by
        self.token_in = torch.full((num_rows, 1), pad_id, device=device)  # (n, 1) the token just sampled
        self.position = position  # (n, 1)
        cache.slots = torch.tensor([prompt_length], device=device)  # (1,) the column its key and value go to
        self.varlen = varlen_decode(model, cache)  # on a GPU: each row's columns from 0, attention over the filled ones
        if self.varlen:
            cache.align_left(prompt_mask)  # slots (N,): each row's own next column
        columns = torch.arange(prompt_length, device=device)  # (P,)
        bias = torch.full((num_rows, 1, 1, length), MASKED, device=device)  # (n, 1, 1, S)
        visible = columns < cache.slots[:, None] if self.varlen else prompt_mask.bool()  # (N, P) the prompt
        bias[:, 0, 0, :prompt_length].masked_fill_(visible, 0.0)
        self.biases = {kind: bias.clone() for kind in self.windows}  # (n, 1, 1, S) each
        for kind, window in self.windows.items():  # the first query, column P, sees columns P-window+1 … P
            if window:
                self.biases[kind][..., : max(prompt_length - window + 1, 0)] = MASKED
        self.widths = [length] if self.varlen else decode_widths(prompt_length, length - prompt_length)
        self.graphs, self.pool = {}, None  # on CUDA: width -> captured step, for the rows decoded now
        if device.type == "cuda" and not torch.distributed.is_initialized():
            self.pool = torch.cuda.graph_pool_handle()
        self.holds = not any(self.windows.values())  # a row may skip a column (a window counts columns)
        self.merged = MergedProducts(model, merges(device))  # q, k, v as one product, gate and up as one
        self.head_weight = head_weight(model)  # a bf16 head's weight, cast once

    def __call__(self, token: torch.Tensor, t: int, held: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's token (n,), sampled at column P + t, in; the logits (n, V) of the next token out. A held
        row (n,) (waiting for its tools, or finished) keeps its position, its column hidden: its token is none."""
        cache = self.cache
        self.token_in.copy_(token[:, None])
        if self.prompt_length + t >= cache.length and not (self.varlen and cache.length >= self.most):
            columns = max(64, (cache.length - self.prompt_length) // 2)  # tools' answers came, or held rows
            self.grow(min(columns, self.most - cache.length) if self.varlen else columns)  # left columns unfilled
        for kind, window in self.windows.items():
            if self.varlen:  # row i's own column (a held row's, filled again at its next step)
                self.biases[kind].scatter_(-1, cache.slots[:, None, None, None], 0.0)
            elif held is not None:  # later tokens attend to this one (column P+t), a held row's not…
                self.biases[kind][:, 0, 0].index_copy_(-1, cache.slots, torch.where(held, MASKED, 0.0)[:, None])
            else:
                self.biases[kind].index_fill_(-1, cache.slots, 0.0)  # later tokens attend to this one (column P+t)…
            if window and self.prompt_length + t >= window:  # …and, in a window, no longer to column P+t-window
                self.biases[kind].index_fill_(-1, cache.slots - window, MASKED)
        width = next((w for w in self.widths if w > self.prompt_length + t), self.widths[-1])  # columns 0 … P+t
        if self.pool is not None and width not in self.graphs:
            self.graphs[width] = captured_or_none(functools.partial(self.forward, width, captured=True), self.pool)
        replay = self.graphs.get(width)  # None: eager, as on the CPU (no CUDA, torchrun, or a capture that failed)
        logits = replay() if replay is not None else self.forward(width)  # (n, V)
        if held is None:
            self.position += 1
            cache.slots += 1
        else:  # a held row keeps its position (varlen: its column too, written again at its next step)
            self.position += (~held).long()[:, None]
            cache.slots += (~held).long() if self.varlen else 1  # ≤ P + t: within the cache (grow)
        return logits

    def grow(self, columns: int) -> None:
        """`columns` more in the cache (zeros) and the masks (hidden): the cache is sized by need, not for
        every tool turn's longest answer (generate), and a held row's column is one no row fills."""
        cache, dim = self.cache, 1 if self.cache.aligned else 2  # (n, S, kv heads, d) varlen, else (n, kv heads, S, d)
        for buffers in (cache.keys, cache.values):
            for layer, b in enumerate(buffers):  # one layer at a time: the peak is the cache and one layer's copy
                buffers[layer] = torch.cat([b, b.new_zeros(*b.shape[:dim], columns, *b.shape[dim + 1 :])], dim)
        self.biases = {kind: torch.nn.functional.pad(b, (0, columns), value=MASKED) for kind, b in self.biases.items()}
        cache.length += columns
        self.widths.append(cache.length)
        self.graphs = {}

    def forward(self, width: int, captured: bool = False) -> torch.Tensor:
        """The model on the step's buffers over `width` columns -> (n, V) fp32 logits."""
        model, cache = self.model, self.cache
        cache.width = width
        experts = captured_experts(model) if captured else contextlib.nullcontext()
        attention = varlen_attention(model, (cache.slots + 1).int()) if self.varlen else grouped_attention(model)
        with attention, fp32_lm_head(model, self.head_weight), experts, self.merged.within(), compiled_decode(model):
            out = model(
                input_ids=self.token_in,
                attention_mask=by_type({kind: bias[..., :width] for kind, bias in self.biases.items()}),
                position_ids=self.position,
                **{self.cache_name: cache},
                use_cache=True,
            )
        return out.logits[:, -1, : self.vocab_size].float()

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows (n',) stay, in smaller buffers and new graphs: finished rows cost nothing."""
        self.token_in, self.position = self.token_in[rows], self.position[rows]
        self.biases = {kind: bias[rows] for kind, bias in self.biases.items()}
        self.cache.keep_rows(rows)
        self.graphs = {}


COMPILED_BLOCKS = ("MLP", "RMSNorm")  # the ends of the class names compile_blocks compiles
COMPILE_BACKEND = "inductor"  # tests: "aot_eager" (traced and differentiated, no kernels generated: seconds on a CPU)
COMPILED = {}  # (block class or function, backend) -> it through torch.compile, shared by every block of the class
DECODE_BACKBONES = weakref.WeakKeyDictionary()  # a model compile_blocks compiled -> what compiled_decode compiles


def compile_blocks(model, on: bool = True):
    """--compile: each dense MLP and RMSNorm block compiled, one code for all layers (compiled_decode's too)."""
    if not on:
        return model
    # A block kind has a variant per weights, grad mode and size-1 input; past dynamo's 8 one runs eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for module in model.modules():
        kind, dense = type(module), not any("expert" in name for name, _ in module.named_modules())
        if kind.__name__.endswith(COMPILED_BLOCKS) and dense and "forward" not in module.__dict__:
            if (kind, COMPILE_BACKEND) not in COMPILED:
                COMPILED[kind, COMPILE_BACKEND] = torch.compile(kind.forward, dynamic=True, backend=COMPILE_BACKEND)
            module.forward = functools.partial(COMPILED[kind, COMPILE_BACKEND], module)  # a copy rebinds it to itself
    inner = next((module for module in model.modules() if isinstance(module, PreTrainedModel)), None)
    backbone = getattr(inner, "base_model", inner)  # the layers without the LM head: Qwen2ForCausalLM's Qwen2Model
    if backbone is not inner and not any("expert" in name for name, _ in model.named_modules()):
        DECODE_BACKBONES[model] = backbone  # not a backbone itself (ppo's critic): it never decodes
    return model


@contextlib.contextmanager
def compiled_decode(model):
    """Within it (--compile's one-token step) the backbone, registered by compile_blocks, runs compiled."""
    backbone = DECODE_BACKBONES.get(model)
    if backbone is None or dist.is_initialized() or "forward" in backbone.__dict__:  # or a hook library's own
        yield
        return
    if (type(backbone), COMPILE_BACKEND) not in COMPILED:
        compiled = torch.compile(type(backbone).forward, dynamic=True, backend=COMPILE_BACKEND)
        COMPILED[type(backbone), COMPILE_BACKEND] = compiled
    blocks = {}  # block -> its compiled forward (compile_blocks'), set aside
    for module in backbone.modules():
        forward = module.__dict__.get("forward")
        if forward is not None and getattr(forward, "func", None) is COMPILED.get((type(module), COMPILE_BACKEND)):
            blocks[module] = module.__dict__.pop("forward")
    backbone.forward = functools.partial(COMPILED[type(backbone), COMPILE_BACKEND], backbone)
    try:
        yield
    except torch._dynamo.exc.TorchDynamoException as error:  # torch.compile's own message, and what to do
        error.add_note("nanoPO: the decode step did not compile (--compile true); --compile false runs it eagerly.")
        raise
    finally:
        del backbone.forward
        for module, forward in blocks.items():
            module.forward = forward


def compiled_for(model, function):
    """`function` compiled for a model compile_blocks registered, else itself: the sampler (fallback_random:
    eager's tokens), the head's chunk math (logprob_head: the formula and logit_gradient, a fused pass or two)."""
    if model not in DECODE_BACKBONES:
        return function
    if (function, COMPILE_BACKEND) not in COMPILED:
        options = {"fallback_random": True} if COMPILE_BACKEND == "inductor" else None
        COMPILED[function, COMPILE_BACKEND] = torch.compile(
            function, dynamic=True, backend=COMPILE_BACKEND, options=options
        )
    return COMPILED[function, COMPILE_BACKEND]


HEAD_CHUNK_BYTES = 2**28  # fp32 logits of one chunk of positions in logprob_head: 256 MB, 442 rows of Qwen's 151,665

PLAIN_HEADS = weakref.WeakKeyDictionary()  # model -> whether its logits are its LM head's output as is (plain_head)


def plain_head(model) -> bool:
    """Whether the logits are the LM head's output unchanged (one probe forward, once per model)."""
    if model not in PLAIN_HEADS:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if getattr(head, "weight", None) is None:  # no head, or not one with a weight of V' rows
            PLAIN_HEADS[model] = False
            return False
        marker = torch.linspace(-100.0, 100.0, head.weight.shape[0], device=head.weight.device)  # (V',)
        with forward_replaced(head, lambda hidden: marker.expand(*hidden.shape[:-1], -1)), torch.no_grad():  # (…, V')
            token = torch.zeros(1, 1, dtype=torch.long, device=head.weight.device)
            logits = model(input_ids=token, use_cache=False).logits  # (1, 1, V')
        PLAIN_HEADS[model] = logits.shape[-1] == len(marker) and torch.equal(logits.float(), marker.expand_as(logits))
    return PLAIN_HEADS[model]


@contextlib.contextmanager
def logprob_head(model, formula, tokens, scale: float, vocab_size: int, with_entropy: bool, entropy_grad: bool):
    """Within it the LM head returns `tokens`' (n, t) log-probs and entropies (n, t, 2) by `formula`, a chunk
    of logits at a time, recomputed in backward: no (n, t, V) logits, and exact, the same product and
    formula. Yields `read`, which turns the model's output into that (n, t, 2)."""
    head = model.get_output_embeddings() if plain_head(model) else None
    formula, gradient = compiled_for(model, formula), compiled_for(model, logit_gradient)  # --compile: fused
    score = functools.partial(
        formula, scale=scale, vocab_size=vocab_size, with_entropy=with_entropy, entropy_grad=entropy_grad
    )
    if head is None:
        yield lambda logits: score(logits, tokens)
        return
    product = head.forward  # fp32_lm_head's fp32 product under autocast, else the head's own
    chunked = []  # whether the completion's positions came through forward below

    def forward(hidden):  # (n, t', d) -> (n, t, 2), or the plain logits of another pass
        if hidden.shape[:-1] not in (tokens.shape, (1, tokens.numel())):  # the prompt pass's one logit: unused
            return product(hidden)
        chunked.append(True)
        rows = max(1, HEAD_CHUNK_BYTES // (4 * vocab_size))  # positions a chunk
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)  # (n·t, d), (n·t,)
        upcast = torch.is_autocast_enabled(flat.device.type)  # fp32_lm_head's product: fp32 whatever the weight's
        fp32 = head.weight.dtype == torch.float32 and (head.bias is None or head.bias.dtype == torch.float32)
        if type(head) is torch.nn.Linear and (fp32 or upcast):  # an fp32 product: its backward written out
            precision = (upcast and head_precision(flat)) or torch.backends.cuda.matmul.fp32_precision  # fp32_lm_head's
            settings = (scale, vocab_size, with_entropy, entropy_grad, precision, rows, formula, gradient)
            out = HeadLogprobs.apply(flat.float(), head.weight, head.bias, targets, *settings)  # (n·t, 2)
            return out.reshape(*tokens.shape, 2)
        chunks = []
        for start in range(0, len(flat), rows):
            piece = lambda h, o: score(product(h), o)  # noqa: E731  (c, d), (c,) -> (c, 2)
            part = (flat[start : start + rows], targets[start : start + rows])
            if torch.is_grad_enabled():
                chunks.append(torch.utils.checkpoint.checkpoint(piece, *part, use_reentrant=False))
            else:
                chunks.append(piece(*part))
        return torch.cat(chunks).reshape(*tokens.shape, 2)  # (n, t, 2)

    with forward_replaced(head, forward):  # the model's "logits" are the (n, t, 2) already, unless it
        yield lambda out: out if chunked else score(out, tokens)  # handed its head other positions


class HeadLogprobs(torch.autograd.Function):
    """log π of `tokens` and the entropy through a Linear head, `rows` at a time, op for op as `formula`;
    backward recomputes each chunk's z in place into dL/dz = g·(onehot − p) − g_H·p·(log p + H), summing
    the weight's gradient in fp32. (M, d) fp32, (V', d), (V',) or None, (M,) -> (M, 2): log π and H."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, tokens, scale, vocab_size, with_entropy, entropy_grad, precision, rows, formula,
        gradient,
    ):  # fmt: skip
        entropy_grad = with_entropy and entropy_grad  # without the entropy its column is a constant 0
        upcast = head_operands(weight, bias, precision)  # fp32 (bf16 for a bf16 head): one copy, not one a chunk
        out = []
        for start in range(0, len(hidden), rows):
            with torch.autocast(hidden.device.type, enabled=False):
                logits = head_linear(hidden[start : start + rows], *upcast, precision)  # (c, V')
            out.append(formula(logits, tokens[start : start + rows], scale, vocab_size, with_entropy, False))
        out = torch.cat(out)  # (M, 2)
        ctx.save_for_backward(hidden, weight, bias, tokens, out)  # out: its own, whatever is done to the copy
        ctx.settings = scale, vocab_size, entropy_grad, precision, rows, gradient
        return out.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable  # its in-place backward builds no graph
    def backward(ctx, grad):  # (M, 2): d loss / d log π, d loss / d H
        with torch.autocast(grad.device.type, enabled=False):  # the forward's fp32 products, wherever called
            return HeadLogprobs.gradients(ctx, grad)

    @staticmethod
    def gradients(ctx, grad):
        hidden, stored, stored_bias, tokens, out = ctx.saved_tensors
        scale, vocab_size, entropy_grad, precision, rows, gradient = ctx.settings
        weight, bias = head_operands(stored, stored_bias, precision)  # as forward read them
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # (M, d)
        grad_weight = torch.zeros_like(stored, dtype=torch.float32) if ctx.needs_input_grad[1] else None  # (V', d)
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None  # None: frozen
        kept_weight = weight[:vocab_size]  # (V, d): ids past the tokenizer get no gradient
        for start in range(0, len(hidden), rows):
            part = slice(start, start + rows)
            z = head_linear(hidden[part], weight, bias, precision)[:, :vocab_size]  # (c, V)
            dz = gradient(z, tokens[part], out[part], grad[part], scale, entropy_grad)  # (c, V)
            if grad_hidden is not None:
                grad_hidden[part] = head_mm(dz, kept_weight, precision)  # (c, d)
            if grad_weight is not None:
                head_mm(dz.T, hidden[part], precision, into=grad_weight[:vocab_size])  # (V, d), summed in place
            if grad_bias is not None:
                grad_bias[:vocab_size] += dz.sum(0)
        grad_weight = None if grad_weight is None else grad_weight.to(stored.dtype)  # summed in fp32, rounded once
        grad_bias = None if grad_bias is None else grad_bias.to(stored_bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None, None


def head_operands(weight, bias, precision: str) -> tuple:
    """The head's weight and bias as its GEMMs read them: fp32, the weight bf16 for a bf16 head (head_mm)."""
    return weight.to(torch.bfloat16 if precision == "bf16" else torch.float32), None if bias is None else bias.float()


def logit_gradient(z, tokens, out, grad, scale: float, entropy_grad: bool):
    """dL/dz of a chunk from its logits z (c, V) recomputed (overwritten: one (c, V) buffer), the forward's
    out (c, 2) (log π, H) and grad (c, 2): (g·(onehot − p) − g_H·p·(log p + H)) / τ. HeadLogprobs' backward."""
    g, logp, entropy = grad[:, :1], out[:, :1], out[:, 1:]  # (c, 1) each
    if scale != 1.0:
        z.div_(scale)
    log_p = z.sub_(z.gather(-1, tokens[:, None]) - logp)  # log p = z − logsumexp = z − (z_token − log π_token)
    if entropy_grad:  # − p·(g + g_H·(log p + H))
        p = log_p.exp()
        dz = log_p.add_(entropy).mul_(grad[:, 1:]).add_(g).mul_(p).neg_()
    else:  # − g·p
        dz = log_p.exp_().mul_(-g)
    dz.scatter_add_(-1, tokens[:, None], g)  # + g at the token
    if scale != 1.0:
        dz.div_(scale)
    return dz


@dataclass(frozen=True)
class Layout:
    """A chunk's host-side facts, read for a batch at once (chunks_of): no host sync a micro-batch."""

    prompt: int
    completion: int
    prompts: int
    shortest: int
    tokens: int  # the real tokens, each run's prompt once: packed_completions' pass


def chunks_of(order, prompt_ids, prompt_mask, completion_mask, rows: int, tokens: int = 0) -> list[tuple]:
    """`order` in chunks with their Layouts: `rows` at a time, or as many as keep rows × columns within
    `tokens` (torchrun: the same rows on all ranks), else 4. One host sync. -> [(rows (m,), Layout)]."""
    multiple = shape_multiple(order.device)
    starts = new_prompts(prompt_ids[order], prompt_mask[order])  # (n,) where a run of one prompt starts
    facts = torch.stack([prompt_mask.sum(-1)[order], completion_mask.sum(-1)[order], starts.long()]).tolist()
    prompt_lengths, completion_lengths, new = facts  # (n,) each, in order: the one host sync
    widths = (prompt_mask.shape[1], completion_mask.shape[1])  # P, T
    kept = [  # (n,) the (prompt, completion) columns trim_padding keeps of each row alone
        tuple(min(-(-max(length, 1) // multiple) * multiple, width) for length, width in zip(lengths, widths))
        for lengths in zip(prompt_lengths, completion_lengths)
    ]
    size = rows or (0 if tokens else 4)  # rows a chunk; 0: by tokens
    if not size and world_size() > 1:
        size = max(1, tokens // all_reduce(max(map(sum, kept)), "max"))
    if size:
        spans = [(start, min(start + size, len(kept))) for start in range(0, len(kept), size)]
    else:
        spans, start, prompt, completion = [], 0, 0, 0
        for i, (row_prompt, row_completion) in enumerate(kept):
            prompt, completion = max(prompt, row_prompt), max(completion, row_completion)
            if i > start and (i + 1 - start) * (prompt + completion) > tokens:  # row i starts the next chunk
                spans.append((start, i))
                start, prompt, completion = i, row_prompt, row_completion
        spans.append((start, len(kept)))
    return [
        (
            order[start:end],
            Layout(
                prompt=max(p for p, _ in kept[start:end]),
                completion=max(t for _, t in kept[start:end]),
                prompts=1 + sum(new[start + 1 : end]),  # a chunk's first row starts a run
                shortest=min(prompt_lengths[start:end]),
                tokens=sum(completion_lengths[start:end])
                + sum(prompt_lengths[i] for i in range(start, end) if i == start or new[i]),
            ),
        )
        for start, end in spans
    ]


def new_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Where a run of rows sharing a prompt starts. (n, P), (n, P) -> (n,) bool, no host sync."""
    starts = torch.ones(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)
    starts[1:] = ((prompt_ids[1:] != prompt_ids[:-1]) | (prompt_mask[1:] != prompt_mask[:-1])).any(-1)
    return starts


def length_order(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """A group's rows together, the groups by longest completion, longest first. (N, P), (N, P), (N, T) -> (N,)."""
    lengths = completion_mask.sum(-1)  # (N,)
    prompts = torch.cat([prompt_ids, prompt_mask], dim=-1)  # (N, 2P) a prompt is its ids and its padding
    _, group = torch.unique(prompts, dim=0, return_inverse=True)  # (N,) each row's prompt
    longest = torch.zeros(len(lengths), dtype=lengths.dtype, device=lengths.device)
    longest = longest.scatter_reduce(0, group, lengths, "amax")[group]  # (N,) its group's longest completion
    order = lengths.argsort(descending=True, stable=True)  # three stable sorts, the last one's key first:
    order = order[group[order].argsort(stable=True)]  # the rows of a group together, longest first
    return order[longest[order].argsort(descending=True, stable=True)]  # the groups by their longest


def trim_padding(prompt_ids, prompt_mask, completion_ids, completion_mask, layout: Layout):
    """The chunk without the columns that are padding in every row (as its Layout keeps). Exact: no row
    attends to them, and positions count real tokens only. (n, P), (n, P), (n, T), (n, T) -> (n, p), (n, t)."""
    first = prompt_ids.shape[1] - layout.prompt  # the first prompt column kept
    kept = layout.completion
    return prompt_ids[:, first:], prompt_mask[:, first:], completion_ids[:, :kept], completion_mask[:, :kept]


def shape_multiple(device: torch.device) -> int:
    """trim_padding's column multiple: 64 on CUDA, so chunks share a few kernel shapes; 1 elsewhere."""
    return 64 if device.type == "cuda" else 1


def forward_completions(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, output: str = "logits", share: bool = True,
    layout: Layout | None = None,
):  # fmt: skip
    """The model's `output` (logits, or last_hidden_state) at the t positions predicting the completion:
    (n, p), (n, p), (n, t), (n, t) -> (n, t, ·). Rows sharing a prompt run it once (but its last token) into
    a cache their passes attend to: P + G·T positions, not G·(P + T), exact up to float reassociation. One
    plain pass where nothing is shared, a prompt is one token, checkpointing trains, or share=False."""
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (n, p+t)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # same positions as in generate
    num_prompt, kept = prompt_ids.shape[1], completion_ids.shape[1]  # p, t
    keep = {"logits_to_keep": kept} if output == "logits" else {}  # only what predicts a completion token
    starts = new_prompts(prompt_ids, prompt_mask)  # (n,) where a run of rows sharing a prompt starts
    lengths = prompt_mask.sum(-1)  # (n,) tokens in each row's prompt
    if layout:
        prompts, shortest = layout.prompts, layout.shortest
    else:
        prompts, shortest = torch.stack([starts.sum(), lengths.min()]).tolist()
    checkpointed = model.training and any(getattr(layer, "gradient_checkpointing", False) for layer in model.modules())
    if not share or prompts == len(prompt_ids) or shortest < 2 or checkpointed:
        ids = torch.cat([prompt_ids, completion_ids], dim=1)[:, :-1]  # (n, p-1+t) the last token predicts nothing
        mask, positions = attention_mask[:, :-1], position_ids[:, :-1]
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **keep)
        return out[output][:, -kept:]  # (n, t, ·)
    run = starts.cumsum(0) - 1  # (n,) each row's prompt: the run it is in
    first = torch.zeros(prompts, dtype=torch.long, device=run.device)  # (b,) each prompt's first row
    first = first.scatter_reduce(0, run, torch.arange(len(run), device=run.device), "amin", include_self=False)
    distinct, distinct_mask = prompt_ids[first], prompt_mask[first]  # (b, p) the b distinct prompts, a row each
    prompt_pass = {  # each distinct prompt but its last token, once: its keys and values
        "input_ids": distinct[:, :-1],
        "attention_mask": distinct_mask[:, :-1],
        "position_ids": (distinct_mask[:, :-1].cumsum(-1) - 1).clamp(min=0),
    }
    cache_name = cache_argument(model)
    prompt_out = model(
        **prompt_pass, use_cache=True, **({"logits_to_keep": 1} if keep else {})
    )  # no logit is needed: the fewest the head computes
    cache = prompt_out[cache_name]
    cache.batch_select_indices(run)  # each row gets its prompt's keys and values: (n, kv heads, p-1, d)
    out = model(  # the prompt's last token, then the completion but its last token
        input_ids=torch.cat([prompt_ids[:, -1:], completion_ids[:, :-1]], dim=1),
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, num_prompt - 1 : -1],
        use_cache=True,
        **{cache_name: cache},
        **keep,
    )[output]  # (n, t, ·)
    if torch.is_grad_enabled():  # FSDP2 gathers a layer again for backward only if its forward's output is in
        out[:, :1] += 0 * prompt_out[output].sum()  # the loss: the prompt pass's joins, at weight 0, in place
    return out


def packed_completions(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, output: str = "logits", layout=None
):  # fmt: skip
    """forward_completions' contract in one pass with no padding (packed_layout): each run of rows sharing a
    prompt is its prompt once, then each row's completion, under one mask (packed_visible). Exact up to float
    reassociation; layout: the chunk's (chunks_of), its count of tokens read with the batch's, no host sync.
    (n, p), (n, p), (n, t), (n, t) -> (n, t, ·)."""
    ids, facts, where = packed_layout(prompt_ids, prompt_mask, completion_ids, completion_mask, layout)
    keep = {"logits_to_keep": where.reshape(-1)} if output == "logits" else {}  # only what predicts a token
    flex = flex_serves(model, prompt_ids.device)
    masks = {  # one per attention type: a BlockMask for FlexAttention, else additive (1, 1, L, L) for the model's own
        kind: packed_mask(facts, window, flex) for kind, window in attention_windows(model).items()
    }
    binding = sdpa_replaced(model, "nanopo_packed", packed_attention) if flex else contextlib.nullcontext()
    with binding:
        out = model(
            input_ids=ids[None],
            attention_mask=by_type(masks),
            position_ids=facts["position"][None],
            use_cache=False,
            **keep,
        )[output]  # (1, n·t, ·) logits, or (1, L, ·) hidden states
    if output == "logits":
        return out.reshape(*where.shape, -1)  # (n, t, ·); logprob_head's (n, t, 2) as it is
    return out[0, where]  # (n, t, ·)


def packed_layout(prompt_ids, prompt_mask, completion_ids, completion_mask, layout: Layout | None = None) -> tuple:
    """The packed pass's tokens (L,), their facts (L,) each (run: the prompt's run of rows; owner: the row whose
    completion it is, -1 in a prompt; position: as generate's), and the place predicting each completion token
    (n, t): the last token before it, the prompt's last for the first (a masked column is not in the pass)."""
    num_rows, num_prompt = prompt_ids.shape
    starts = new_prompts(prompt_ids, prompt_mask)  # (n,) where a run of rows sharing a prompt starts
    run = starts.cumsum(0) - 1  # (n,)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (n, p+t)
    kept = attention_mask != 0  # a new tensor (the masks may be bool)
    kept[:, :num_prompt] &= starts[:, None]  # a run's prompt once, in its first row
    flat = kept.flatten()  # (L,) the kept columns, row by row; their count read for the batch (chunks_of), or a sync
    places = (torch.nonzero_static(flat, size=layout.tokens) if layout else flat.nonzero()).squeeze(1)
    order = torch.full(kept.shape, -1, device=kept.device)  # (n, p+t) each kept column's place in the pass
    order.view(-1)[places] = torch.arange(len(places), device=kept.device)
    rows = torch.arange(num_rows, device=run.device)  # (n,)
    first = torch.zeros_like(run).scatter_reduce(0, run, rows, "amin", include_self=False)  # (runs,) first rows
    order[:, :num_prompt] = order[first[run], :num_prompt]  # a row's prompt: its run's
    owner = rows[:, None].expand_as(kept).clone()  # (n, p+t)
    owner[:, :num_prompt] = -1
    columns = dict(run=run[:, None].expand_as(kept), owner=owner, position=attention_mask.cumsum(-1) - 1)
    facts = {name: column.flatten()[places] for name, column in columns.items()}  # (L,) each
    ids = torch.cat([prompt_ids, completion_ids], dim=1).flatten()[places]  # (L,)
    before = order.cummax(1).values  # (n, p+t) the last kept place at or before each column: a hole is skipped
    return ids, facts, before[:, num_prompt - 1 : -1].clamp(min=0)


def packed_visible(facts: dict, query, key, window: int | None):
    """Whether packed place `key` is visible to place `query`: the same run, the prompt or the query's own
    completion, not later, and within the window (positions count a row's tokens). Tensors broadcast."""
    run, owner, position = facts["run"], facts["owner"], facts["position"]
    visible = (key <= query) & (run[key] == run[query]) & ((owner[key] < 0) | (owner[key] == owner[query]))
    if window:
        visible &= position[query] - position[key] < window
    return visible


def packed_mask(facts: dict, window: int | None, flex: bool):
    """packed_visible as FlexAttention's BlockMask (flex: blocks wholly hidden are skipped), else as an
    additive (1, 1, L, L) mask the model's own attention takes."""
    length, device = len(facts["run"]), facts["run"].device
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        visible = lambda batch, head, query, key: packed_visible(facts, query, key, window)  # noqa: E731
        return on_gpu_compiled(create_block_mask, device)(visible, None, None, length, length, device=device)
    places = torch.arange(length, device=device)
    visible = packed_visible(facts, places[:, None], places[None, :], window)  # (L, L)
    return torch.where(visible, 0.0, MASKED)[None, None]


def flex_serves(model, device: torch.device) -> bool:
    """Whether packed_completions runs FlexAttention: a model on sdpa, on a GPU (on a CPU flex has no backward)."""
    return device.type == "cuda" and getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **unused):
    """packed_completions' attention on a GPU: FlexAttention, compiled, over the BlockMask.
    (1, heads, L, d), (1, kv heads, L, d) ×2 -> (1, L, heads, d)."""
    from torch.nn.attention.flex_attention import flex_attention

    taken = [name for name in ("softcap", "s_aux") if unused.get(name) is not None] + ["dropout"] * (dropout > 0)
    if taken:  # sdpa models pass none of these; one that does is not what this attention computes
        raise ValueError(f"the packed pass's FlexAttention does not apply {', '.join(taken)}: use forward_completions")
    dtype = value.dtype  # autocast's fp32 rotary makes the query and key fp32
    flex = on_gpu_compiled(flex_attention, query.device)
    out = flex(query.to(dtype), key.to(dtype), value, block_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def on_gpu_compiled(function, device: torch.device):
    """`function` through TorchInductor on a GPU (FlexAttention's kernels are generated), else itself."""
    if device.type != "cuda":
        return function
    if (function, "inductor") not in COMPILED:
        COMPILED[function, "inductor"] = torch.compile(function, dynamic=True)
    return COMPILED[function, "inductor"]


# ----------------------------------------------------------------------------------------
# The tiny models (TINY_MODELS, each described in docs/models.md): random models of a few hundred
# thousand parameters and a byte-level BPE trained here, so that tests and CPU runs download nothing.

TINY_VERSION = 1  # bump when anything below changes; the cache directory is keyed by it
TINY_VOCAB = 384  # tokenizer size; the embedding is padded to 448 rows, like Qwen's
TINY_EMBED_ROWS = 448
TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_SPECIAL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|finetune_right_pad_id|>",
]  # fmt: skip
LLAMA_DEFAULT_SYSTEM = "You are a helpful assistant."
LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    f"{{% else %}}{{% set system = '{LLAMA_DEFAULT_SYSTEM}' %}}{{% endif %}}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' + system + '<|eot_id|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
NO_SYSTEM_TEMPLATE = (  # the shape of Gemma's: user and model turns only
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# tiny-tools' call token: the secret task's whole call and the turn's end (parse_tool_calls reads it as any call)
TINY_SECRET_CALL = '<tool_call>\n{"name": "secret_digit", "arguments": {}}\n</tool_call><|im_end|>'
TINY_TOOL_TOKENS = ["<tool_response>", "</tool_response>", TINY_SECRET_CALL]
# ChatML, the tools by name in a system turn and each answer as a user turn (Qwen2.5's shape; docs/tools.md).
TOOLS_TEMPLATE = (
    "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else none %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}{% if system is not none %}{{ system + '\n\n' }}{% endif %}"
    "{{ '<tools>' }}{% for tool in tools %}{{ ' ' + tool['function']['name'] }}{% endfor %}"
    "{{ ' </tools><|im_end|>\n' }}"
    "{% if system is not none %}{% set messages = messages[1:] %}{% endif %}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"  # an assistant's calls, as Qwen2.5 writes them
    "{{ '<tool_call>\n' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_MODELS = ("tiny", "tiny-llama", "tiny-llama-nosystem", "tiny-base", "tiny-tools")  # tiny-base: no chat template


def _tiny_corpus(seed: int = 0, lines: int = 3000) -> list[str]:
    """Text the tiny tokenizer learns its merges from: arithmetic, tags and English filler."""
    rng = random.Random(seed)
    words = (
        "the a to of and is in that it for you with as on be at this we have answer think "
        "numbers equation target using each number once create make solve step first then "
        "reply digit one two three four five six seven eight nine zero question result"
    ).split()
    corpus = []
    for _ in range(lines):
        nums = [str(rng.randint(1, 99)) for _ in range(rng.randint(3, 4))]
        ops = [rng.choice("+-*/") for _ in nums[1:]]
        expression = nums[0] + "".join(f" {op} {n}" for op, n in zip(ops, nums[1:]))
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        corpus.append(f"<think> {sentence} </think> <answer> {expression} </answer> {sentence.capitalize()}.")
    return corpus


def build_tiny_model(cache_dir: str | None = None, name: str = "tiny") -> Path:
    """Builds a tiny model (one of TINY_MODELS) once into a cache directory; returns its path."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    root = Path(cache_dir or os.environ.get("NANOPO_CACHE", Path.home() / ".cache" / "nanopo"))
    path = root / f"{name}-v{TINY_VERSION}"
    if (path / "config.json").exists():
        return path
    qwen = name in ("tiny", "tiny-base", "tiny-tools")
    special = TINY_SPECIAL if qwen else LLAMA_SPECIAL

    bpe = Tokenizer(models.BPE())
    # Digits one per token (as in Qwen's and Llama 3's tokenizers), then GPT-2 style byte-level pieces.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tiny_corpus(), trainer=trainer)
    shape = dict(
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    if qwen:
        template = {"tiny": CHATML_TEMPLATE, "tiny-tools": TOOLS_TEMPLATE}.get(name)  # tiny-base has none
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template
        )
        tokenizer.chat_template = template
        if name == "tiny-tools":  # ids TINY_VOCAB onwards, in rows the padded embedding already has
            tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in TINY_TOOL_TOKENS])
        stop_tokens = ("<|im_end|>", "<|endoftext|>") + ((TINY_SECRET_CALL,) if name == "tiny-tools" else ())
        config = Qwen2Config(
            vocab_size=TINY_EMBED_ROWS,
            **shape,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
    else:  # no pad token: load_model's set_pad_token must pick <|finetune_right_pad_id|>
        template = LLAMA_TEMPLATE if name == "tiny-llama" else NO_SYSTEM_TEMPLATE
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=template
        )
        tokenizer.chat_template = template
        stop_tokens = ("<|eot_id|>", "<|end_of_text|>")
        config = LlamaConfig(
            vocab_size=len(tokenizer),  # no padded rows, unlike Qwen
            **shape,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|eot_id|>"),
        )
    with torch.random.fork_rng(devices=[]):  # a fixed init that leaves the caller's RNG untouched
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config) if qwen else LlamaForCausalLM(config)
    generation = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in stop_tokens],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )

    # Written into a temporary directory renamed into place: never half-written. Not save_pretrained,
    # which under torchrun writes on rank 0 alone, leaving another rank's copy empty.
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
    model.config.architectures, model.config.dtype = [type(model).__name__], torch.float32  # as save_pretrained records
    model.config.save_pretrained(staging)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # the embedding's, as transformers saves it
    weights = {key: value for key, value in model.state_dict().items() if key not in tied}
    safetensors.torch.save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(staging)
    generation.save_pretrained(staging)
    try:
        staging.rename(path)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(staging)
    return path


# ----------------------------------------------------------------------------------------
# The training loop's harness: what train() calls around the algorithm.


def prompt_indices(step: int, batch_size: int, num_problems: int, seed: int) -> list[int]:
    """A step's B problem indices from a shuffle per epoch: a function of (step, seed), so resumable."""
    indices, permutations = [], {}
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, position = divmod(k, num_problems)
        if epoch not in permutations:
            permutations[epoch] = random.Random(seed * 1_000_003 + epoch).sample(range(num_problems), num_problems)
        indices.append(permutations[epoch][position])
    return indices


def tool_limits(args) -> dict:
    """rollout's limits on tool turns, from the flags."""
    names = ("max_turns", "max_tool_tokens", "tool_timeout", "tool_workers")
    return {name: getattr(args, name) for name in names}


def whole_groups(order: torch.Tensor, group_size: int) -> torch.Tensor:
    """A group's rows together, the groups in the order their first row comes in the random `order`: by
    symmetry a uniformly random order of groups, from the same random numbers. (N,) -> (N,)."""
    position = torch.empty_like(order)
    position[order] = torch.arange(len(order), device=order.device)  # where each row comes in `order`
    groups = position.view(-1, group_size).amin(dim=-1).argsort()  # (N/G,) by their first row
    return (groups[:, None] * group_size + torch.arange(group_size, device=order.device)).flatten()


def optimizer_step(model, optimizer, max_grad_norm: float, skip: bool = False) -> float:
    """Clips, steps (skip: momentum alone must not move θ), frees the gradients; -> the norm before clip."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item()
    if not skip:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def accumulate(totals: dict, stats: dict) -> None:
    """Adds a micro-batch's statistics into totals: sums (float64), maxima for *_max."""
    for key, value in stats.items():
        if torch.is_tensor(value) and value.is_floating_point():
            value = value.double()
        if not key.endswith("_max"):
            totals[key] = totals.get(key, 0) + value
        elif key not in totals:
            totals[key] = value
        elif torch.is_tensor(value) or torch.is_tensor(totals[key]):
            totals[key] = torch.maximum(torch.as_tensor(totals[key]), torch.as_tensor(value))
        else:
            totals[key] = max(totals[key], value)


@torch.no_grad()
def loss_stats(
    ratio: torch.Tensor,  # (n, T)
    advantages: torch.Tensor,  # (n, 1) or (n, T)
    loss_mask: torch.Tensor,  # (n, T)
    eps_low: float,
    eps_high: float,
    dual_clipped: torch.Tensor,  # (n, T) bool, the tokens dual-clip bounded
    kl: torch.Tensor | None = None,  # (n, T) the KL term's per-token estimate
    is_weight: torch.Tensor | None = None,  # (n, T) truncated IS weights
    clips_weight: bool = False,  # CISPO: the clip bounds its weight, whatever the sign of Â
    cut: torch.Tensor | None = None,  # (n, T) bool, DPPO: the tokens its trust region dropped, in place of the clip's
) -> dict:
    """The loss's statistics over loss_mask, 0-d tensor sums (maxima: *_max) that accumulate over micro-batches."""
    valid = loss_mask.bool()
    low, high = (ratio < 1 - eps_low), (ratio > 1 + eps_high)
    if not clips_weight:  # the clipped surrogate binds only where it cuts the gradient
        low, high = low & (advantages < 0), high & (advantages > 0)
    if cut is not None:  # DPPO's region: a probability that fell (Â ≤ 0) or rose (Â > 0) too far
        low, high = cut & (advantages <= 0), cut & (advantages > 0)
    stats = {
        "tokens": valid.sum(),
        "clip_low": (valid & low).sum(),
        "clip_high": (valid & high).sum(),
        "clip_dual": (valid & dual_clipped).sum(),
        "ratio_max": torch.where(valid.any(), ratio.masked_fill(~valid, -torch.inf).max(), 1.0),  # 1: no token
    }
    if kl is not None:
        stats["kl"] = (kl * loss_mask.to(kl.dtype)).sum()
    if is_weight is not None:
        stats |= tis_stats(is_weight, valid)
    return stats


def tis_stats(is_weight: torch.Tensor, valid: torch.Tensor) -> dict:
    """The sum and max of the truncated IS weights over the valid tokens (0-d tensors)."""
    return {
        "tis_weight": (is_weight * valid).sum(),
        "tis_weight_max": torch.where(valid.any(), is_weight.masked_fill(~valid, -torch.inf).max(), 1.0),  # C: capped
    }


def step_metrics(batch, entropy: torch.Tensor, old_logp: torch.Tensor, group_size: int) -> dict:
    """Statistics of a step's batch (a script's Rollout), with step 4's entropy and old_logp (N, T)."""
    mask = batch.completion_mask.bool()
    lengths = batch.completion_mask.sum(-1).float()  # (N,)
    rewards, scores = batch.rewards, batch.scores
    grouped = rewards.view(-1, group_size)  # (B, G)
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "reward/accuracy": sum(s.correct for s in scores) / len(scores),
        "reward/format": sum(s.formatted for s in scores) / len(scores),
        "reward/fn_failed": sum(s.failed for s in scores) / len(scores),  # --reward_fn raised, timed out, no number
        "reward/zero_std_groups": (grouped.max(-1).values == grouped.min(-1).values).float().mean().item(),
        "completion/length_mean": lengths.mean().item(),
        "completion/length_max": lengths.max().item(),
        "completion/truncated": batch.truncated.float().mean().item(),
        "policy/entropy": entropy[mask].mean().item(),
        # Sampler and scorer must agree, or every ratio is off before any update: ~1e-6 in fp32, more in bf16.
        "policy/sample_logp_diff": (batch.sample_logp - old_logp)[mask].abs().mean().item(),
        "policy/sample_logp_diff_max": (batch.sample_logp - old_logp)[mask].abs().max().item(),
    } | tool_metrics(batch)


def tool_metrics(*batches) -> dict:
    """tools/*: calls, turns, calls past --max_turns per completion, failed calls and the tools' tokens."""
    if batches[0].tool_counts is None:
        return {}
    counts = torch.cat([batch.tool_counts for batch in batches]).float()  # (completions, 4)
    calls, failed, turns, over_budget = counts.sum(0).tolist()
    environment = sum(batch.tool_mask.sum().item() for batch in batches)
    model = sum(batch.completion_mask.sum().item() for batch in batches)
    return {
        "tools/calls": calls / len(counts),
        "tools/errors": failed / max(calls, 1),
        "tools/turns": turns / len(counts),
        "tools/over_budget": over_budget / len(counts),  # calls past --max_turns, not run
        "tools/env_share": environment / max(environment + model, 1),
    }


def is_mask_metrics(update: dict) -> dict:
    """is_mask/*: the shares of tokens and completions masked IS took out of the loss this step."""
    if "masked_tokens" not in update:
        return {}
    return {
        "is_mask/token_fraction": update["masked_tokens"] / max(update["tokens"] + update["masked_tokens"], 1),
        "is_mask/sequence_fraction": update["masked_sequences"] / max(update["sequences"], 1),
    }


def opsm_metrics(update: dict) -> dict:
    """opsm/sequence_fraction: the share of completions off-policy masking took out this step."""
    if "opsm_masked" not in update:
        return {}
    return {"opsm/sequence_fraction": update["opsm_masked"] / max(update["opsm_sequences"], 1)}


def top_share(
    values: torch.Tensor,
    valid: torch.Tensor,
    share: float,
    reduce=all_reduce,
    wanted: int = 0,
    rank_index: int | None = None,
):
    """Exactly k = ⌈share·count⌉ (or `wanted`) valid tokens, the largest over every rank; ties go to the
    earliest, rank 0's first, so K ranks take what one takes. The k-th value by bisection over the fp32
    bits as integers: exact in ≤ 33 counts. values, valid (n, T) -> (n, T) bool."""
    valid = valid.bool()
    bits = values[valid].float().view(torch.int32).long()  # (tokens,) sign bit, then magnitude
    order = torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # (tokens,) ordered as the values; −0 = +0
    count = reduce(order.numel())
    wanted = wanted or share_of(share, count)
    if wanted >= count:
        return valid
    low = reduce(order.min().item() if order.numel() else 2**31, "min")  # count(≥ low) ≥ wanted
    high = reduce(order.max().item() if order.numel() else -(2**31), "max") + 1  # count(≥ high) < wanted
    while high - low > 1:
        middle = (low + high) // 2
        if reduce(int((order >= middle).sum().item())) >= wanted:
            low = middle
        else:
            high = middle
    above, tied = order > low, order == low  # (tokens,) each; low is the k-th largest value's
    ties_wanted = wanted - reduce(int(above.sum().item()))  # ≥ 1 of the tied tokens, the earliest
    here = rank() if rank_index is None else rank_index
    ties_by_rank = torch.zeros(reduce(1), dtype=torch.float64)  # (K,) each rank's tied tokens
    ties_by_rank[here] = tied.sum().item()
    earlier = int(reduce(ties_by_rank)[:here].sum().item())  # tied tokens on the ranks before this one
    kept = torch.zeros_like(valid)
    kept[valid] = above | (tied & (tied.cumsum(0) + earlier <= ties_wanted))
    return kept


def share_of(share: float, count: int) -> int:
    """⌈share·count⌉, rounded to 9 places first: 0.07·100 is 7.000000000000001 in floats."""
    return math.ceil(round(share * count, 9))


def evaluate_heldout(
    rollout, policy, tokenizer, eos_ids, task, max_new_tokens: int, batch_size: int, amp=contextlib.nullcontext, **tools
):
    """The eval/ metrics of greedy decoding on `task`'s held-out problems: no random numbers drawn."""
    start = time.perf_counter()
    scores, lengths, truncations, batches = [], [], [], []
    python_random = random.getstate()  # a tool may draw from it (the secret task's): training's draws stay
    for first in range(0, len(task.problems), batch_size):
        problems = task.problems[first : first + batch_size]
        batch = rollout(  # greedy: one completion per problem, temperature 0
            policy, tokenizer, eos_ids, task, problems, group_size=1, max_new_tokens=max_new_tokens,
            temperature=0.0, top_p=1.0, amp=amp, **tools,
        )  # fmt: skip
        scores += batch.scores
        lengths += batch.completion_mask.sum(-1).tolist()
        truncations += batch.truncated.tolist()
        batches.append(batch)
    random.setstate(python_random)
    tools = {f"eval/{name}": value for name, value in tool_metrics(*batches).items()}  # with tools: eval/tools/*
    return tools | {
        "eval/accuracy": sum(s.strict for s in scores) / len(scores),  # the answer where the prompt asks
        "eval/reward": sum(s.reward for s in scores) / len(scores),
        "eval/format": sum(s.formatted for s in scores) / len(scores),
        "eval/length_mean": sum(lengths) / len(lengths),
        "eval/truncated": sum(truncations) / len(truncations),
        "eval/seconds": time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------------------
# Runs on disk: runs/<algo>-<task>-<model>-<time>/ with args.json, metrics.jsonl, samples.jsonl, checkpoints.


def make_run_dir(args, algo: str, task: str | None = None) -> Path:
    """Creates runs/<algo>-<task>-<model>-<time>/ with args.json (model runs/x/final: x-final)."""
    model_path = Path(args.model.rstrip("/"))
    model_tag = model_path.name
    if model_tag == "final" or model_tag.startswith("step-"):
        model_tag = f"{model_path.parent.name}-{model_tag}"
    task = task or args.task
    stamp = time.strftime("%Y%m%d-%H%M%S")
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    path, suffix = Path(args.output_dir) / f"{algo}-{task}-{model_tag}-{stamp}", 1
    while True:  # two runs started in the same second, even by two processes, get two directories
        try:
            path.mkdir()
            break
        except FileExistsError:
            suffix += 1
            path = Path(args.output_dir) / f"{algo}-{task}-{model_tag}-{stamp}-{suffix}"
    record_args(path, args)
    return path


def make_optimizer(model, lr: float | None, args) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable weights and its linear warm-up; lr None: FULL_LR, or LORA_LR with LoRA."""
    if lr is None:
        lr = LORA_LR if args.lora_rank else FULL_LR
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, args.adam_beta2), weight_decay=args.weight_decay)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    return optimizer, warmup


# Settings a resumed run must share with the run it continues; a script adds its own (same_on_resume).
SAME_ON_RESUME = ("model", "task", "dataset", "num_problems", "seed", "batch_size", "group_size")
SAME_ON_RESUME += ("lora_rank", "lora_alpha", "lora_targets")  # the adapters saved must fit the run
SAME_ON_RESUME += ("data_file", "data_split", "prompt_key", "answer_key", "eval_data_file")  # --task file's rows


class Run:
    """What a training loop does besides the algorithm: one run on disk, new or resumed.

        run = Run(args, "grpo", policy, tokenizer, resumable={"optimizer": optimizer, ...}, evaluate=evaluate)
        with run:                         # Ctrl-C: one line naming the newest checkpoint, exit 130
            for step in run.steps():      # start_step … max_steps-1, with a progress bar
                ...                       # the algorithm: rollout, log-probs, advantages, update
                run.end_step(step, metrics, seconds, batch)  # evaluate when due, log, save when due
            run.save_final()
        return run.dir

    --resume_from continues in the checkpoint's directory: `resumable`, `state` and the RNG states come
    back, the logs lose the later steps. Only the newest checkpoint keeps the trainer state (the fp32
    masters where compute_dtype is not the weights') and resume_only files (write_extra's, ppo's critic)."""

    def __init__(
        self,
        args,
        algo: str,
        policy,
        tokenizer,
        *,
        resumable: dict,
        evaluate,
        same_on_resume: tuple[str, ...] = (),
        state: dict | None = None,
        write_extra=None,
        resume_only: tuple[str, ...] = (),
        compute_dtype: torch.dtype | None = None,
        reward_key: str = "reward/mean",
    ):
        self.args, self.algo, self.policy, self.tokenizer = args, algo, policy, tokenizer
        self.resumable, self.evaluate, self.write_extra = resumable, evaluate, write_extra
        self.resume_only, self.save_dtype = resume_only, compute_dtype or next(policy.parameters()).dtype
        # fp32 masters under bf16 autocast: the checkpoint's bf16 weights alone would not resume exactly
        self.keep_masters = not is_lora(policy) and self.save_dtype != next(policy.parameters()).dtype
        self.state, self.reward_key = dict(state or {}), reward_key
        self.newest_checkpoint: Path | None = None
        self.gap_warned = False  # check_sampler_gap warns once a run
        self.start_step, self.progress, self.trackers = 0, None, []
        self.steps_done = 0  # steps whose metrics row is written (a resume starts at its checkpoint's)
        if not args.resume_from:
            self.dir = broadcast(make_run_dir(args, algo) if rank() == 0 else None)
            try:
                self.trackers = open_trackers(args, self.dir, algo) if rank() == 0 else []
            except SystemExit:  # a tracker that does not start: the run never did, and its new directory goes
                shutil.rmtree(self.dir, ignore_errors=True)
                raise
            return
        saved = load_trainer_state(args.resume_from, vars(args), SAME_ON_RESUME + same_on_resume, trainer_state_file())
        if saved.get("world_size", 1) != world_size():  # each rank's AdamW shard fits that many ranks only
            raise SystemExit(processes_differ(args.resume_from, saved.get("world_size", 1), world_size()))
        for name, thing in resumable.items():
            if name not in saved:  # e.g. the moving reference of --ref_ema_decay, in a run saved without it
                raise SystemExit(
                    f"{args.resume_from} holds no saved {name}: resume with the settings it was saved with."
                )
            thing.load_state_dict(saved[name])
        self.state = {name: saved[name] for name in self.state}  # KeyError: a checkpoint of another script
        if self.keep_masters:  # the fp32 weights, over the bf16 ones the policy was loaded from
            if "master_weights" not in saved:
                raise SystemExit(
                    f"{args.resume_from} holds no fp32 master weights: resume with the --dtype it ran with."
                )
            set_master_weights(policy, saved["master_weights"])
        set_rng_states(saved["rng"])
        self.start_step = self.steps_done = saved["step"]
        self.newest_checkpoint = Path(args.resume_from)
        self.dir = self.newest_checkpoint.parent
        barrier()  # every rank has read the checkpoint before rank 0 writes beside it
        if rank() == 0:
            for log in ("metrics.jsonl", "samples.jsonl"):  # drop what ran after the checkpoint
                truncate_jsonl(self.dir / log, last_step=self.start_step)
            record_args(self.dir, args, resumed_at=self.start_step)  # the arguments the run goes on with
            self.trackers = open_trackers(args, self.dir, algo, resumed_at=self.start_step)

    def steps(self):
        """The steps still to run, 0-based, as a progress bar over all max_steps."""
        total = self.args.max_steps
        steps = range(self.start_step, total)
        if rank() == 0:  # where to look while it runs, not only after a Ctrl-C
            resumed = f", resumed at step {self.start_step}" if self.args.resume_from else ""
            print(f"{self.algo}: run directory {self.dir}{resumed}", flush=True)
        self.progress = tqdm(steps, initial=self.start_step, total=total, desc=self.algo, disable=rank() > 0)
        return self.progress

    def end_step(self, step: int, metrics: dict, seconds: dict, batch=None) -> None:
        """Steps 7-9 after step `step` (0-based; logged as step + 1): 7. evaluate when due; 8. log the
        metrics, and samples of `batch` every sample_every steps; 9. a checkpoint every save_every steps."""
        args, done = self.args, step + 1
        metrics = {"step": done, **metrics, **{f"time/{phase}": value for phase, value in seconds.items()}}
        if args.eval_every and (done % args.eval_every == 0 or done == args.max_steps):
            with unsharded(self.policy):  # under torchrun each rank evaluates every problem
                metrics |= self.evaluate()
        if rank() == 0:  # the metrics are every rank's already (all_reduce_metrics)
            append_jsonl(self.dir / "metrics.jsonl", metrics)
            for tracker in self.trackers:  # --report_to: the same row, with its step
                tracker.log(metrics, done)
        self.steps_done = done
        self.check_sampler_gap(metrics)
        if self.progress is not None and self.reward_key in metrics:
            shown = {"reward": f"{metrics[self.reward_key]:.3f}"}
            if "completion/length_mean" in metrics:
                shown["len"] = f"{metrics['completion/length_mean']:.0f}"
            self.progress.set_postfix(shown)
        if batch is not None and args.sample_every and step % args.sample_every == 0 and rank() == 0:
            samples = []
            for i in range(0, min(args.num_samples * args.group_size, len(batch.texts)), args.group_size):
                prompt = self.tokenizer.decode(batch.prompt_ids[i][batch.prompt_mask[i].bool()])
                record = {"step": done, "prompt": prompt, "completion": batch.texts[i]}
                if getattr(batch, "tool_counts", None) is not None:  # with tools: who wrote what, turn by turn
                    record["turns"] = turns_of(
                        self.tokenizer, batch.completion_ids[i], batch.completion_mask[i], batch.tool_mask[i]
                    )
                samples.append({**record, "reward": batch.scores[i].reward})
                append_jsonl(self.dir / "samples.jsonl", samples[-1])
            for tracker in self.trackers:
                tracker.log_samples(samples, done)
        if args.save_every and done % args.save_every == 0 and done < args.max_steps:
            self.save(f"step-{done:06d}", done)

    def check_sampler_gap(self, metrics: dict) -> None:
        """Warns once when policy/sample_logp_diff passes SAMPLER_GAP_BOUND, which no correct run reaches."""
        gap = metrics.get("policy/sample_logp_diff")
        fp32 = self.save_dtype == torch.float32  # the dtype the model computes in
        bound = SAMPLER_GAP_BOUND["fp32" if fp32 else "bf16"]
        if gap is None or gap <= bound or self.gap_warned or rank() != 0:
            return
        self.gap_warned = True
        warnings.warn(
            f"policy/sample_logp_diff = {gap:.3g} at step {metrics['step']}: the sampler's log-probs differ from "
            f"the trainer's by more than any correct {'fp32' if fp32 else 'bf16'} run ({bound:g}). generate is not "
            "sampling from the model it trains, so every ratio is off before any update: a model family whose "
            "attention generate does not reproduce, or a kernel that differs. docs/models.md says which "
            "families are checked; tests/families.py checks one.",
            RuntimeWarning,
            stacklevel=2,
        )

    def save_final(self) -> None:
        self.save("final", self.args.max_steps)

    def save(self, name: str, step: int) -> None:
        """A checkpoint with the trainer state; the one before keeps only its weights."""
        trainer_state = {"step": step, **self.state, **{k: v.state_dict() for k, v in self.resumable.items()}}
        trainer_state |= {"rng": rng_states(), "args": vars(self.args), "world_size": world_size(), "algo": self.algo}
        if self.keep_masters:
            trainer_state["master_weights"] = master_weights(self.policy)
        with interrupts_deferred():  # Ctrl-C names a checkpoint that is whole and holds the trainer state
            save_checkpoint(
                self.dir / name, self.policy, self.tokenizer, trainer_state, extra=self.write_extra,
                final=name == "final", dtype=self.save_dtype,
            )  # fmt: skip
            older, self.newest_checkpoint = self.newest_checkpoint, self.dir / name
            if older is not None and older != self.newest_checkpoint and rank() == 0:
                drop_trainer_state(older, self.resume_only)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> None:
        for tracker in self.trackers:  # flushed and closed however the run ends
            tracker.close(failed=kind is not None)
        self.trackers = []
        if kind is KeyboardInterrupt:  # one line naming the newest checkpoint, not a traceback
            if self.progress is not None:
                self.progress.close()
            stop_interrupted(f"{self.algo}.py", self.newest_checkpoint, self.steps_done)
        if kind is not None and issubclass(kind, torch.OutOfMemoryError):  # one message, whichever rank ran out
            if self.progress is not None:
                self.progress.close()
            print(out_of_memory_message(error, self.newest_checkpoint, f"{self.algo}.py"), file=sys.stderr)
            raise SystemExit(1) from None
        if kind is None and dist.is_initialized():  # a finished run under torchrun leaves in order
            leave_process_group()


# ----------------------------------------------------------------------------------------
# Experiment trackers (--report_to): metrics.jsonl stays the record, a tracker gets a copy


TRACKERS = ("tensorboard", "wandb")


def trackers_named(text: str) -> list[str]:
    """--report_to -> the tracker names; a ValueError names an unknown one."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if names == ["none"]:
        return []
    unknown = [name for name in names if name not in TRACKERS]
    if unknown or not names:
        raise ValueError(
            f"--report_to {text!r}: {', '.join(unknown) or 'nothing'} is not a tracker. Use none, "
            f"{', '.join(TRACKERS)}, or several comma-separated (tensorboard,wandb)."
        )
    return list(dict.fromkeys(names))  # each once, in order


def open_trackers(args, run_dir: Path, algo: str, resumed_at: int | None = None) -> list:
    """The trackers --report_to asks for (rank 0 only), each with the run's arguments as its config."""
    kinds = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}
    return [kinds[name](args, Path(run_dir), algo, resumed_at) for name in trackers_named(args.report_to)]


def missing_tracker(name: str, package: str, stop: bool = True) -> str:
    """The message for a tracker whose library is not installed; stop: exit with it."""
    message = (
        f"--report_to {name} needs the {package} package, which is not installed: pip install {package} "
        f"(it is in requirements.txt), or leave {name} out of --report_to."
    )
    if stop:
        raise SystemExit(message)
    return message


def numeric(metrics: dict) -> dict:
    """The metrics a tracker plots: numbers only (the step is the tracker's own axis)."""
    return {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}


def markdown_table(rows: list[dict]) -> str:
    """Rows of equal keys as a Markdown table for TensorBoard's text tab, `|` and line breaks escaped."""

    def cell(value):
        return re.sub(r"\r\n|\r|\n", "<br>", str(value).replace("|", "\\|"))

    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row.values()) + " |" for row in rows])


class TensorBoardTracker:
    """Event files in <run dir>/tensorboard/; a resume purges the events after its checkpoint's step."""

    def __init__(self, args, run_dir: Path, algo: str, resumed_at: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        except ImportError:
            missing_tracker("tensorboard", "tensorboard")
        purge = None if resumed_at is None else resumed_at + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        config = [{"argument": f"--{k}", "value": v} for k, v in dataclasses.asdict(args).items()]
        self.writer.add_text("args", markdown_table(config), global_step=resumed_at or 0)

    def log(self, metrics: dict, step: int) -> None:
        for key, value in numeric(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_samples(self, samples: list[dict], step: int) -> None:
        if samples:
            self.writer.add_text("samples", markdown_table(samples), global_step=step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named after the run directory; a resumed one is `<run dir>-from-step-<k>` (steps go up)."""

    def __init__(self, args, run_dir: Path, algo: str, resumed_at: int | None = None):
        try:
            import wandb
        except ImportError:
            missing_tracker("wandb", "wandb")
        self.wandb = wandb
        name = run_dir.name if resumed_at is None else f"{run_dir.name}-from-step-{resumed_at}"
        config = {**dataclasses.asdict(args), "algo": algo, "resumed_at": resumed_at}
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "nanoPO"), name=name, dir=str(run_dir), config=config
            )
        except Exception as error:  # no login, no network, a wrong entity: wandb's own words, and the ways out
            raise SystemExit(
                f"--report_to wandb: W&B did not start a run ({type(error).__name__}: {error}). Log in (`wandb "
                "login`), or set WANDB_MODE=offline (written under the run directory; `wandb sync` uploads it "
                "later), or drop wandb from --report_to."
            ) from error

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(numeric(metrics), step=step)

    def log_samples(self, samples: list[dict], step: int) -> None:
        if samples:
            columns = list(samples[0])
            table = self.wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in samples])
            self.run.log({"samples": table}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a crashed or interrupted run shows as failed


def append_jsonl(path: Path, record: dict) -> None:
    """One JSON object a line; opened per write so the file is always complete on disk."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def save_checkpoint(
    path: Path, model, tokenizer, trainer_state: dict, extra=None, final: bool = False, dtype: torch.dtype | None = None
) -> None:
    """A checkpoint (LoRA: adapter/, merged when final), renamed into place: whole or absent."""
    path = Path(path)
    staging = broadcast(Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-")) if rank() == 0 else None)
    if is_lora(model):
        model.save_pretrained(staging / ADAPTER_DIR, safe_serialization=True)
        if final:
            save_merged(model, staging)
    else:
        save_full_model(model, staging, dtype)
    if rank() == 0:
        tokenizer.save_pretrained(staging)
    torch.save(trainer_state, staging / trainer_state_file())  # under torchrun, one file a rank
    if extra is not None:
        extra(staging)
    barrier()  # every rank's files are in before the rename
    if rank() > 0:
        barrier()
        return
    if path.exists():
        old = path.with_name(f".{path.name}-old")
        path.rename(old)
        staging.rename(path)
        shutil.rmtree(old)
    else:
        staging.rename(path)
    barrier()


def save_full_model(model, directory: Path, dtype: torch.dtype | None = None) -> None:
    """save_pretrained's format in `dtype`; under torchrun rank 0 writes the gathered weights."""
    own = next(model.parameters()).dtype
    if not dist.is_initialized() and dtype in (None, own):
        model.save_pretrained(directory, safe_serialization=True)
        return
    weights = full_state_dict(model) if dist.is_initialized() else model.state_dict()
    if rank() > 0:
        return
    for name in tied_copies(model):  # written once, as save_pretrained writes a tied model: these
        weights.pop(name, None)  # gathered or cast tensors no longer share storage, and it would write both
    if dtype not in (None, own):  # one tensor at a time, so a GPU holds one bf16 copy of a weight at most
        weights = {k: (v.to(dtype) if v.is_floating_point() else v).cpu() for k, v in weights.items()}
    model.save_pretrained(directory, state_dict=weights, safe_serialization=True)
    config = json.loads((Path(directory) / "config.json").read_text())
    config["architectures"] = [name.removeprefix("FSDP") for name in config.get("architectures") or []]
    if dtype not in (None, own):
        config["dtype"] = str(dtype).removeprefix("torch.")
    (Path(directory) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def tied_copies(model) -> set[str]:
    """The names under which a parameter appears a second time (tied embeddings)."""
    seen, copies = set(), set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            copies.add(name)
        seen.add(id(parameter))
    return copies


def local_shard(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (a DTensor); a plain parameter is its own."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def master_weights(model) -> dict:
    """The trained weights as they are (fp32), this rank's shards under torchrun, on the CPU."""
    return {name: local_shard(p).detach().cpu() for name, p in model.named_parameters() if p.requires_grad}


def set_master_weights(model, weights: dict) -> None:
    """Writes master_weights' tensors back into the model (the same ranks' shards)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                local_shard(p).copy_(weights[name])


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def output_dir_problems(output_dir: str) -> list[str]:
    """What stops --output_dir: a file where it, or a folder above it, would be."""
    path = Path(output_dir)
    existing = next(p for p in (path, *path.parents) if p.exists())  # "." or "/" at the latest
    if existing.is_dir():
        return []
    return [f"--output_dir {output_dir}: {existing} is a file, not a directory: give a directory, new or existing."]


def trainer_state_globals() -> list:
    """What a trainer state needs beyond weights_only's own: numpy's RNG key; nothing that could run code."""
    return [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_trainer_state(checkpoint, path: Path, mmap: bool = False) -> dict:
    """The trainer state at `path`, read as data only; anything else stops, its code not run."""
    if dist.is_available():
        import torch.distributed.tensor  # noqa: F401  a torchrun run's optimizer state holds DTensors

    try:
        with torch.serialization.safe_globals(trainer_state_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+) was not|but got (.+?)\s*$", str(error), re.MULTILINE)
        what = f" ({found[1] or found[2]})" if found else ""
        raise SystemExit(
            f"--resume_from {checkpoint}: {path} holds something other than a trainer state{what}, so it "
            "was not loaded: a trainer state is read as data only (tensors, numbers, strings, lists, dicts "
            "and the RNG states), never run as code. Resume only from a checkpoint a run of nanoPO wrote."
        ) from None


def resume_problems(args, algo: str) -> list[str]:
    """What stops --resume_from, found before a model loads (the state memory-mapped, its tensors unread)."""
    checkpoint = Path(args.resume_from)
    if not checkpoint.is_dir():
        return [
            f"--resume_from {checkpoint}: no such directory. Give a checkpoint: runs/<run>/final or runs/<run>/step-…"
        ]
    if not (checkpoint / TRAINER_STATE).exists():
        return [no_trainer_state(checkpoint)]
    try:
        state = read_trainer_state(checkpoint, checkpoint / TRAINER_STATE, mmap=True)
    except SystemExit as refused:  # not a trainer state: listed with the other problems, its code not run
        return [str(refused)]
    saved = state.get("args", {})
    written_by = state.get("algo") or written_by_script(saved)
    if written_by != algo:
        return [
            f"--resume_from {checkpoint} was written by {written_by}.py: resume it with {written_by}.py, or start a "
            f"new {algo}.py run from its weights with --model {checkpoint}."
        ]
    saved_by, launched = state.get("world_size", 1), int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's count
    if saved_by != launched:  # each rank's AdamW shard fits that many ranks only
        return [processes_differ(checkpoint, saved_by, launched)]
    if state["step"] >= args.max_steps:
        return [
            f"--resume_from {checkpoint} is at step {state['step']} (its run: --max_steps {saved.get('max_steps')}); "
            f"--max_steps {args.max_steps} leaves nothing to train: give --max_steps above {state['step']}."
        ]
    return []


def processes_differ(checkpoint, saved_by: int, now: int) -> str:
    """The message for a checkpoint saved by another number of processes than this launch's."""
    processes = f"{saved_by} process{'es' * (saved_by != 1)}"
    return f"--resume_from {checkpoint} was saved by {processes}: resume with as many (now {now})."


def written_by_script(saved_args: dict) -> str:
    """The script whose arguments these are, by the arguments only that script has."""
    return "ppo" if "critic_lr" in saved_args else "dapo" if "dynamic_sampling" in saved_args else "grpo"


def no_trainer_state(checkpoint) -> str:
    """The message for a --resume_from directory without the trainer state."""
    if Path(checkpoint).name == "final":  # the newest checkpoint, its trainer state deleted (--study_prune)
        return (
            f"--resume_from {checkpoint}: no {TRAINER_STATE} there, and a run's final/ is its newest checkpoint: "
            "its trainer state was deleted (evaluate.py --study_prune does), so it cannot resume. Start a new run "
            f"from its weights: --model {checkpoint}."
        )
    return (
        f"--resume_from {checkpoint}: no {TRAINER_STATE} there. Only the newest checkpoint of a run "
        "keeps it: point --resume_from at that one (runs/<run>/final or the last step-…)."
    )


def load_trainer_state(
    checkpoint: str, args: dict | None = None, must_match: tuple[str, ...] = (), filename: str = TRAINER_STATE
) -> dict:
    """A checkpoint's trainer state; stops if absent or `args` differ in a `must_match` field."""
    path = Path(checkpoint) / filename
    if not path.exists():
        raise SystemExit(no_trainer_state(checkpoint))
    state = read_trainer_state(checkpoint, path)
    saved = state.get("args", {})
    different = [f"--{k} {saved[k]!r} (now {args[k]!r})" for k in must_match if k in saved and saved[k] != args[k]]
    if different:
        raise SystemExit(
            f"--resume_from {checkpoint}: the run was started with " + ", ".join(different) + ". "
            "Resume with the same values, or start a new run from these weights with --model."
        )
    return state


def drop_trainer_state(checkpoint: Path, resume_only: tuple[str, ...] = ()) -> None:
    """Deletes a checkpoint's trainer state (every rank's) and resume_only files, keeping its weights."""
    for path in Path(checkpoint).glob(TRAINER_STATE.replace(".pt", "*.pt")):
        path.unlink(missing_ok=True)
    for name in resume_only:
        target = Path(checkpoint) / name
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keeps the records with step <= last_step, rewritten through a temporary file."""
    if not Path(path).exists():
        return
    kept = [r for r in read_jsonl(path) if r["step"] <= last_step]
    staging = Path(path).with_name(f".{Path(path).name}.tmp")
    staging.write_text("".join(json.dumps(r) + "\n" for r in kept))
    staging.replace(path)
