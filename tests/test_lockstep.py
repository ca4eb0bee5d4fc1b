"""The three training scripts keep what they share character for character identical, so a fix
lands everywhere at once and `diff grpo.py dapo.py` shows only what the algorithm changes.

Two rules:
- a top-level function or class whose name appears in two scripts reads the same in both,
  unless DIFFERS_BY_DESIGN names it with the reason. A function that differs gets a name of
  its own (dapo_loss, ppo_loss) or an entry there; silent drift fails here.
- an Args field that two scripts share has the same default and the same --help text in both,
  unless ARGS_DIFFER_BY_DESIGN names it with the reason."""

import ast
import dataclasses
import itertools

import pytest

import dapo
import grpo
import ppo
from conftest import ROOT

SCRIPTS = {"grpo.py": grpo, "dapo.py": dapo, "ppo.py": ppo}
# Every script defines these, identically: sampling, generation, scoring and held-out
# evaluation are not where the algorithms differ.
SHARED = [
    "encode_prompts",
    "sample",
    "top_p_filter",
    "KVCache",
    "token_logprobs",
    "generate",
    "Rollout",
    "rollout",
    "sequence_logprobs",
    "old_and_ref_logprobs",
    "kl_k3",
    "clipped_surrogate",
    "dual_clip",
    "micro_batches",
    # truncated and masked importance sampling: the sampler-trainer gap is not the algorithm either
    "tis_weights",
    "importance_mask",
    "masked_importance",
]
# Shared by grpo.py and dapo.py only (ppo.py has neither CISPO nor T1's techniques).
SHARED_GRPO_DAPO = [
    "cispo_objective", "on_policy", "corrected", "kl_estimate",
    "sampler_logp",
]  # fmt: skip
# Same name, different body on purpose: the reason is the algorithm.
DIFFERS_BY_DESIGN = {
    "Args": "each script has its own hyperparameters (shared fields: test_shared_args_fields_agree)",
    "check_args": "each script validates its own hyperparameters",
    "train": "the training loop is the algorithm",
    "policy_backward": "each objective normalises and batches its loss differently",
    "on_policy": "PPO counts its epochs K (--ppo_epochs), GRPO and DAPO their iterations μ (--num_iterations)",
    "clip_range": "GRPO's ε is symmetric with GSPO's own; DAPO's is clip-higher's ε_low, ε_high",
    "variant_objective": "GRPO has GSPO's and GPG's objectives, which DAPO does not take",
    "update_metrics": "each objective logs its own update statistics",
}
# Args fields that two scripts share with a different default or help, and why.
ARGS_DIFFER_BY_DESIGN = {
    "loss_type": "GRPO's variants (grpo, dr_grpo, gspo, gpg, cispo) against DAPO's surrogate or cispo",
    "beta": "the KL term differs: k3 in GRPO's loss (β 0.01), none in DAPO (β 0), k1 in PPO's per-token reward",
    "eps_high": "DAPO's clip-higher default (0.28); PPO's is symmetric (0.2) unless the VAPO recipe raises it",
    "entropy_coef": "GRPO's and DAPO's bonus is T1's; PPO's is PPO Eq. 9's c_2",
    "group_size": "PPO allows G = 1: its critic, not the group, is the baseline",
    "lr": "PPO's --lr is the actor's; its critic has --critic_lr",
    "warmup_steps": "PPO's actor warms up over the steps it trains, which the value warm-up delays",
    "max_steps": "a DAPO step trains on at most B·G completions: dynamic sampling may keep fewer",
    "num_mini_batches": "DAPO splits fewer kept groups near-evenly; PPO steps actor and critic per mini-batch (4)",
}


def definitions(script: str) -> dict[str, str]:
    """Top-level functions and classes of a script: name -> source text."""
    source = (ROOT / script).read_text()
    lines = source.encode().splitlines(keepends=True)  # the AST's column offsets count UTF-8 bytes
    nodes = (node for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef)))
    # ast.get_source_segment's text, sliced from lines split once (it splits the file anew per call:
    # seconds for a script's ~90 definitions, a minute for the file)
    return {
        node.name: (
            lines[node.lineno - 1][node.col_offset :]
            + b"".join(lines[node.lineno : node.end_lineno - 1])
            + lines[node.end_lineno - 1][: node.end_col_offset]
            if node.end_lineno > node.lineno
            else lines[node.lineno - 1][node.col_offset : node.end_col_offset]
        ).decode()
        for node in nodes
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_defines_every_shared_function(script):
    defined = definitions(script)
    assert [name for name in SHARED if name not in defined] == []


def test_grpo_and_dapo_define_their_shared_functions():
    for script in ("grpo.py", "dapo.py"):
        assert [name for name in SHARED_GRPO_DAPO if name not in definitions(script)] == []


@pytest.mark.parametrize("pair", list(itertools.combinations(SCRIPTS, 2)), ids="-vs-".join)
def test_same_name_means_same_text(pair):
    first, second = (definitions(script) for script in pair)
    common = sorted(set(first) & set(second) - set(DIFFERS_BY_DESIGN))
    assert set(SHARED) <= set(common)
    drifted = [name for name in common if first[name] != second[name]]
    assert drifted == [], f"{drifted} differ between {pair[0]} and {pair[1]}: change both, or rename one"


def args_fields(script: str) -> dict[str, tuple]:
    return {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(SCRIPTS[script].Args)}


@pytest.mark.parametrize("pair", list(itertools.combinations(SCRIPTS, 2)), ids="-vs-".join)
def test_shared_args_fields_agree(pair):
    first, second = (args_fields(script) for script in pair)
    shared = sorted(set(first) & set(second) - set(ARGS_DIFFER_BY_DESIGN))
    drifted = [f"--{name}: {first[name]} vs {second[name]}" for name in shared if first[name] != second[name]]
    assert drifted == [], f"{pair[0]} and {pair[1]} disagree on {drifted}: make them agree, or say why here"


def test_every_difference_by_design_is_a_real_difference():
    # An entry whose field or function has become the same everywhere is stale: remove it.
    fields = [args_fields(script) for script in SCRIPTS]
    for name in ARGS_DIFFER_BY_DESIGN:
        values = {f[name] for f in fields if name in f}
        assert len(values) > 1, f"--{name} now agrees in every script: drop it from ARGS_DIFFER_BY_DESIGN"
    sources = [definitions(script) for script in SCRIPTS]
    for name in DIFFERS_BY_DESIGN:
        texts = {s[name] for s in sources if name in s}
        assert len(texts) > 1, f"{name} is now the same in every script: drop it from DIFFERS_BY_DESIGN"


def test_the_scripts_take_the_same_names_from_common():
    # What a script takes from common.py (common.X, or imported) is the same in all three, less what
    # PPO's critic loads and saves with, and GRPO's and DAPO's techniques that PPO lacks: the run
    # harness, the model's runtime, loading and seeding are not the algorithm.
    used = {}
    for script in SCRIPTS:
        tree = ast.parse((ROOT / script).read_text())
        used[script] = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "common"
        }
        used[script] |= {
            alias.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "common" for alias in n.names
        }
    ppo_only = {"enable_activation_checkpointing", "resolve_model_name", "with_adapters", "is_lora", "ADAPTER_DIR"}
    ppo_only |= {"FULL_LR", "LORA_LR"}  # the critic's default learning rate is 10× the actor's
    ppo_only |= {"full_state_dict", "rank"}  # under torchrun the critic's weights are gathered to rank 0
    ppo_only |= {"model_source", "dequantised"}  # the critic's backbone from a GGUF file
    ppo_only |= {"frozen_dtype"}  # a LoRA critic's frozen backbone in the compute dtype, as the policy's
    ppo_only |= {"compile_blocks"}  # --compile: the critic's backbone, as the policy's (load_policy)
    ppo_only |= {"check_is_mask"}  # GRPO and DAPO check it inside check_technique_args
    grpo_dapo_only = {"check_technique_args", "top_share", "share_of", "opsm_metrics"}  # their techniques
    grpo_dapo_only |= {"logprob_passes"}  # the preflight's passes; PPO's add the critic's (actor_critic_passes)
    dapo_only = {"tool_metrics"}  # dynamic sampling's tools/* over every round (sampling_metrics)
    assert used["grpo.py"] == used["dapo.py"] - dapo_only
    assert used["grpo.py"] - grpo_dapo_only == used["ppo.py"] - ppo_only


def test_evaluate_takes_the_tools_flags_as_the_scripts_do():
    # evaluate.py --tools … benchmarks a model as training rolled it out: the same flags, defaults and help
    import evaluate

    tool_flags = ("tools", "tool", "max_turns", "max_tool_tokens", "tool_timeout")
    evaluated = {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(evaluate.Args)}
    assert {name: evaluated.get(name) for name in tool_flags} == {
        name: args_fields("grpo.py")[name] for name in tool_flags
    }
