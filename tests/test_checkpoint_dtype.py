"""Checkpoints of the GPU recipe (fp32 master weights, bf16 autocast), run on the CPU: the
scripts' precision is forced to (fp32 weights, bf16 autocast), which CPU autocast supports.
What a GPU run writes is then checked here, where CI can run it: weights in bf16 (what users
load, half the disk), the fp32 masters only in the newest checkpoint's trainer state, PPO's
critic only in the newest checkpoint, and a resumed run that continues bit for bit."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import common
import grpo
import ppo
from conftest import crash_and_resume, trainer_state


def gpu_precision(monkeypatch, script):
    monkeypatch.setattr(common, "resolve_precision", lambda dtype, device: (torch.float32, torch.bfloat16))


def stored_dtypes(checkpoint) -> set:
    with safe_open(checkpoint / "model.safetensors", "pt") as weights:
        return {weights.get_slice(name).get_dtype() for name in weights.keys()}


@pytest.mark.parametrize("script", [grpo, ppo], ids=["grpo", "ppo"])
def test_bf16_checkpoints_keep_fp32_masters_for_an_exact_resume(script, tmp_path, monkeypatch):
    gpu_precision(monkeypatch, script)
    settings = dict(model="tiny", task="digit", lr=3e-3, max_new_tokens=2, batch_size=4, group_size=4, max_steps=3)
    settings |= {"critic_lr": 3e-3, "num_mini_batches": 1} if script is ppo else {}
    straight, resumed = crash_and_resume(script, tmp_path, monkeypatch, **settings)
    for checkpoint in (resumed / "step-000002", resumed / "final"):
        assert stored_dtypes(checkpoint) == {"BF16"}  # every weight in bf16 on disk
        with safe_open(checkpoint / "model.safetensors", "pt") as weights:  # the tied head written once, as
            assert "lm_head.weight" not in weights.keys()  # save_pretrained does (it was a second 0.47 GB at 1.5B)
        assert json.loads((checkpoint / "config.json").read_text())["dtype"] == "bfloat16"
    # The newest checkpoint alone keeps what resuming needs; an older one is weights only.
    assert not (resumed / "step-000002" / "trainer_state.pt").exists()
    assert not (resumed / "step-000002" / ppo.CRITIC_DIR).exists()
    assert (resumed / "final" / ppo.CRITIC_DIR).exists() == (script is ppo)
    states = [trainer_state(run / "final" / "trainer_state.pt") for run in (straight, resumed)]
    masters = [state["master_weights"] for state in states]
    assert {v.dtype for v in masters[0].values()} == {torch.float32}
    # Resuming from step 2's bf16 weights plus its fp32 masters ends where the straight run ends, bit for bit;
    # from the bf16 weights alone it would not (the masters carry the updates bf16 rounds away).
    assert masters[0].keys() == masters[1].keys()
    assert all(torch.equal(masters[0][k], masters[1][k]) for k in masters[0])
    saved = AutoModelForCausalLM.from_pretrained(straight / "final", dtype=torch.float32).state_dict()
    for name, master in masters[0].items():  # the bf16 weights on disk are the masters rounded
        assert torch.equal(saved[name], master.to(torch.bfloat16).float()), name
    assert any(not torch.equal(master.to(torch.bfloat16).float(), master) for master in masters[0].values())


def test_a_bf16_checkpoint_without_masters_stops_with_a_message(tmp_path, monkeypatch):
    gpu_precision(monkeypatch, grpo)
    settings = dict(model="tiny", task="digit", max_new_tokens=2, batch_size=2, group_size=2, max_steps=1)
    run = grpo.train(grpo.Args(output_dir=str(tmp_path), save_every=0, **settings))
    state = trainer_state(run / "final" / "trainer_state.pt")
    del state["master_weights"]
    torch.save(state, run / "final" / "trainer_state.pt")
    with pytest.raises(SystemExit, match="no fp32 master weights"):
        grpo.train(grpo.Args(output_dir=str(tmp_path), resume_from=str(run / "final"), **{**settings, "max_steps": 2}))


@pytest.mark.parametrize("script", [grpo, ppo], ids=["grpo", "ppo"])
def test_lora_keeps_its_frozen_weights_in_the_compute_dtype(script, tmp_path, monkeypatch):
    # The GPU recipe with LoRA: the frozen weights never change, so they are held in bf16 (no
    # fp32 master; autocast would cast a frozen fp32 weight again every forward pass), the
    # adapters (and PPO's value head) train in fp32, and a resume still continues bit for bit.
    import common

    gpu_precision(monkeypatch, script)
    seen = {}
    real_load_policy = common.load_policy

    def spy_policy(*args, **kwargs):
        loaded = real_load_policy(*args, **kwargs)  # (policy, tokenizer, eos_ids)
        seen["policy"] = loaded[0]
        return loaded

    monkeypatch.setattr(common, "load_policy", spy_policy)
    settings = dict(model="tiny", task="digit", lr=3e-3, max_new_tokens=2, batch_size=4, group_size=4, max_steps=3)
    settings |= dict(lora_rank=4, beta=0.0) | ({"critic_lr": 3e-3, "num_mini_batches": 1} if script is ppo else {})
    if script is ppo:
        real_load_critic = ppo.load_critic

        def spy_critic(*args, **kwargs):
            seen["critic"] = real_load_critic(*args, **kwargs)
            return seen["critic"]

        monkeypatch.setattr(ppo, "load_critic", spy_critic)
    straight, resumed = crash_and_resume(script, tmp_path, monkeypatch, **settings)
    for name, model in seen.items():
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        trained = {p.dtype for p in model.parameters() if p.requires_grad}
        assert frozen == {torch.bfloat16} and trained == {torch.float32}, name
    assert common.is_lora(seen["policy"])
    for run in (straight, resumed):
        assert stored_dtypes(run / "final") == {"BF16"}  # the merged policy
    a, b = (AutoModelForCausalLM.from_pretrained(run / "final").state_dict() for run in (straight, resumed))
    assert all(torch.equal(a[name], b[name]) for name in a)
