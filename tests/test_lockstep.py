"""The three training scripts keep their shared functions character for character identical
(DESIGN.md, 'Lockstep'), so a fix lands everywhere at once and `diff grpo.py dapo.py` shows
only what the algorithm changes."""

import ast
import itertools

import pytest

from conftest import ROOT

SCRIPTS = ["grpo.py", "dapo.py", "ppo.py"]
# Functions that must read the same wherever they appear.
SHARED = [
    "prompt_indices",
    "encode_prompts",
    "top_p_filter",
    "generate",
    "sequence_logprobs",
    "kl_k3",
    "step_metrics",
]


def functions(script: str) -> dict[str, str]:
    source = (ROOT / script).read_text()
    tree = ast.parse(source)
    return {node.name: ast.get_source_segment(source, node) for node in tree.body if isinstance(node, ast.FunctionDef)}


def present_scripts() -> list[str]:
    return [s for s in SCRIPTS if (ROOT / s).exists()]


def test_grpo_defines_every_shared_function():
    defined = functions("grpo.py")
    assert [name for name in SHARED if name not in defined] == []


@pytest.mark.parametrize("pair", list(itertools.combinations(SCRIPTS, 2)), ids="-vs-".join)
def test_shared_functions_are_identical(pair):
    if not all(script in present_scripts() for script in pair):
        pytest.skip(f"{' or '.join(pair)} not written yet")
    first, second = (functions(script) for script in pair)
    for name in SHARED:
        if name in first and name in second:
            assert first[name] == second[name], f"{name} differs between {pair[0]} and {pair[1]}"
