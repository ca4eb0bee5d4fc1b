"""bench.py --profile: the FLOP and byte formulas against values computed by hand on a toy
model, the host-sync counter against functions whose syncs are known, and one phase profiled."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import bench


def toy_model():
    # hidden d = 4, one layer, 2 query heads on 1 KV head of head_dim 2, MLP width 4, V = 8 rows,
    # the LM head not tied to the embedding. Parameters of the layer, by hand:
    #   q_proj 4·4 + 4 (bias) = 20, k_proj 4·2 + 2 = 10, v_proj 10, o_proj 4·4 = 16,
    #   gate, up, down 3 · 4·4 = 48, two RMSNorms 2·4 = 8                         -> 112
    # plus the final norm 4: body = 116 (what 2·params·tokens multiplies); the embedding 8·4 = 32
    # and the head 8·4 = 32 are not in it: all parameters = 180.
    config = Qwen2Config(
        hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=4,
        vocab_size=8, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def toy_batch():
    # Two prompts: A of p = 3 real tokens (left padded to P = 4) with two completions of ℓ = 2
    # and 1; B of p = 4 with one completion of ℓ = 3 (T = 3).
    prompt_ids = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [1, 2, 3, 4]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    return prompt_ids, prompt_mask, completion_mask


def test_model_shape_by_hand():
    shape = bench.model_shape(toy_model())
    assert shape == dict(body=116, parameters=180, layers=1, heads=2, kv_heads=1, head_dim=2, hidden=4, head_rows=8)
    assert bench.model_shape(toy_model(), head_rows=1)["head_rows"] == 1  # a critic's value head


def test_token_counts_by_hand():
    # Scoring (sequence_logprobs, the update): each distinct prompt once (3 + 4 tokens), each
    # completion's ℓ tokens (2 + 1 + 3); completion token j of a row sits at position p + j and
    # attends to p + j + 1 keys, a prompt token at k to k + 1:
    #   keys = prompts 3·4/2 + 4·5/2 = 16; rows Σ_j (p+j+1): (4+5) + 4 + (5+6+7) = 31   -> 47
    #   scored positions: one per completion token = 6
    counts = bench.token_counts(*toy_batch())
    assert counts == dict(tokens=13, keys=47, scored=6, steps=3, decode_keys=31)
    # Decode (generate): the prompts prefilled (7 tokens, 16 keys, one scored position each);
    # then each row feeds ℓ − 1 tokens = 1, 0, 2, token j ≥ 1 fed at position p + j − 1 over
    # p + j keys: row 1: 4; row 3: 5 + 6 = 11 -> decode keys 15; steps = max ℓ − 1 = 2.
    counts = bench.token_counts(*toy_batch(), decode=True)
    assert counts == dict(tokens=10, keys=31, scored=5, steps=2, decode_keys=15)


def test_flops_and_bytes_by_hand():
    # forward FLOPs = 2·body·tokens + 4·layers·heads·head_dim·keys + 2·d·head_rows·scored
    #               = 232·tokens + 16·keys + 64·scored.
    # Scoring: 232·13 + 16·47 + 64·6 = 3016 + 752 + 384 = 4152. Decode: 2320 + 496 + 320 = 3136.
    # Bytes, bf16 (2 bytes): the weights are 180·2 = 360 bytes; a key column (K and V of one
    # position, every layer and KV head) 1·1·2·2·2 = 8 bytes.
    #   decode: weights once for the prefill and once per step (1 + 2), and the decode keys read:
    #           3·360 + 15·8 = 1200
    #   score, two models (policy and reference), one chunk: one pass each over the weights:
    #           2 · 4152 FLOPs = 8304, 2 · 1 · 360 = 720 bytes
    #   train, micro-batches of 2: 3 · 4152 = 12456 FLOPs; ceil(3/2) = 2 micro-batches, 3 weight
    #           reads each: 3·2·360 = 2160 bytes
    shape, batch = bench.model_shape(toy_model()), toy_batch()
    assert bench.forward_flops(shape, bench.token_counts(*batch)) == 4152
    assert bench.forward_flops(shape, bench.token_counts(*batch, decode=True)) == 3136
    assert bench.phase_work("decode", shape, batch, element_bytes=2) == (3136, 1200)
    assert bench.phase_work("score", shape, batch, element_bytes=2, passes=1, models=2) == (8304, 720)
    assert bench.phase_work("train", shape, batch, element_bytes=2, passes=2) == (12456, 2160)
    # The passes as the scripts cut the 3 rows: 2 rows at a time, 2 passes; 8 at a time, 1; by tokens,
    # a budget of one row's tokens (or less), one pass a row.
    prompt_ids, prompt_mask, completion_mask = batch
    assert [bench.passes_of(batch, rows, 0) for rows in (2, 8)] == [2, 1]
    assert bench.passes_of(batch, 0, 1) == len(prompt_ids) == 3
    # A value head (head_rows 1) adds 2·4·1 per scored position instead of 64: 3016 + 752 + 48
    critic = bench.model_shape(toy_model(), head_rows=1)
    assert bench.phase_work("score", critic, batch, element_bytes=4, passes=1) == (3816, 720)


def test_host_syncs_counted_from_the_profiler():
    # Three .item() calls: three syncs (aten::item calls aten::_local_scalar_dense: one sync, not
    # two); bool() of a tensor one more (aten::is_nonzero -> item -> _local_scalar_dense); nonzero
    # one (its output size is read on the host); elementwise work none.
    x = torch.randn(64, 64)

    def three_items():
        for _ in range(3):
            (x @ x).sum().item()
        return x * 2 + 1

    def five():
        three_items()
        bool(x.sum() > 0)
        return torch.nonzero(x > 0)

    assert bench.profiled(three_items, torch.device("cpu"))[1]["host syncs"] == 3
    assert bench.profiled(five, torch.device("cpu"))[1]["host syncs"] == 5
    assert bench.profiled(lambda: x * 2 + 1, torch.device("cpu"))[1]["host syncs"] == 0
    assert bench.profiled(lambda: torch.unique(x.round()), torch.device("cpu"))[1]["host syncs"] == 1
    # torch._assert_async reads its value on the CPU (aten::item inside it), but on CUDA it
    # asserts on the device without a sync: not counted (transformers' masks call it every pass).
    assert bench.profiled(lambda: torch._assert_async(x.sum() != 0), torch.device("cpu"))[1]["host syncs"] == 0


def test_profiled_measures_one_call():
    x = torch.randn(128, 128)
    result, measured = bench.profiled(lambda: x @ x, torch.device("cpu"))
    assert torch.equal(result, x @ x)
    assert measured["wall s"] > 0 and 0 < measured["busy s"] <= measured["wall s"] * 1.5
    assert "aten::mm" in measured["ops"] and measured["ops"]["aten::mm"][1] == 1  # (µs, calls)


def test_the_peak_mfu_is_measured_against(monkeypatch):
    # --peak_tflops wins; otherwise the GPU's name picks the dense bf16 peak (an H100 SXM5 is
    # the "H100 80GB HBM3": 989 TFLOP/s); on the CPU there is none, and MFU stays empty.
    args = bench.Args()
    assert bench.peak_flops(args, torch.device("cpu"))[0] is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peak, source = bench.peak_flops(args, torch.device("cuda"))
    assert peak == 989e12 and "989" in source
    assert bench.peak_flops(bench.Args(peak_tflops=100), torch.device("cpu"))[0] == 100e12


@pytest.mark.cuda
@pytest.mark.xdist_group("cuda")  # with the rest of the tier (tests/test_cuda.py)
def test_profiled_on_cuda():
    # On a GPU: the busy time is the kernels' (no aten op carries device time of its own, so
    # nothing is counted twice), each .item() is one host sync and at least one runtime sync.
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(512, 512, device=device)

    def three_items():
        for _ in range(3):
            (x @ x).sum().item()

    _, measured = bench.profiled(three_items, device)
    assert measured["host syncs"] == 3 and measured["CUDA syncs"] >= 3
    assert measured["launches"] >= 6 and 0 < measured["sync wait s"] <= measured["wall s"]  # 3 products, 3 sums
    assert 0 < measured["busy s"] <= measured["wall s"]
    assert measured["ops"] and not any(name.startswith("aten::") for name in measured["ops"])
    assert measured["peak GB"] > 0


def test_the_events_read_as_torch_reads_them():
    # bench reads kineto's raw events (torch's FunctionEvents cost ~140 µs an event to build):
    # per op, its self CPU time and calls must be what torch's own events() say, over a forward
    # and backward pass and a decode of the toy model.
    from torch.profiler import profile, record_function

    import grpo

    model, (prompt_ids, prompt_mask, _) = toy_model(), toy_batch()
    with profile() as profiler:
        with record_function(bench.PHASE_RANGE):
            model(input_ids=prompt_ids, attention_mask=prompt_mask).logits.sum().backward()
            grpo.generate(model.eval(), prompt_ids, prompt_mask, 4, [], 0, 8)
    theirs = {}
    for event in profiler.events():
        if event.name != bench.PHASE_RANGE:
            total, calls = theirs.get(event.name, (0.0, 0))
            theirs[event.name] = (total + event.self_cpu_time_total, calls + 1)
    mine = bench.summarise(bench.read_events(profiler), cuda=False)
    assert set(mine["ops"]) == set(theirs) and len(theirs) > 30
    for name, (us, calls) in theirs.items():
        assert mine["ops"][name][1] == calls and abs(mine["ops"][name][0] - us) < 1e-3, name
    assert abs(mine["busy s"] - sum(us for us, _ in theirs.values()) / 1e6) < 1e-6


def test_kernels_are_grouped_by_kind():
    # Kernel names as the H100 profile of a grpo.py step printed them (bench.py --profile grpo,
    # torch 2.11): cuDNN's attention names wgmma too, so attention is matched first; the LM head's
    # TF32 GEMM (f32f32_tf32f32 in its name) apart from the bf16 ones; NCCL's all-reduce is not a
    # reduction kernel; a CPU op by its aten name.
    names = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128": "attention",
        "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1": "matrix products, fp32 inputs",
        "nvjet_sm90_tst_72x64_64x12_2x1_v_bz_TNN": "matrix products",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at::Tens": (
            "copies and casts"
        ),
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float": (
            "reductions, softmax, norms"
        ),
        "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array": "elementwise",
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int>": (
            "indexing, gathers, sorts"
        ),
        "Memset (Device)": "fills",
        "aten::mm": "matrix products",
        "aten::_to_copy": "copies and casts",
        "aten::mul": "elementwise",
        "aten::add_": "elementwise",
        "aten::empty": "other",  # an allocation, no kernel
        "aten::exponential_": "random numbers",
        # Whole names, as the profiler gives them before the report cuts them to 100 characters:
        # PyTorch's elementwise templates name "nocast" and their loaders "...WithCast": not copies.
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor"
        "<float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, "
        "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)"
        "::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float"
        ", at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor"
        "<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1})": (
            "elementwise"
        ),
        "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>, "
        "4, TrivialOffsetCalculator<2, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
        "at::native::memory::LoadWithCast<2>, at::native::memory::StoreWithCast<1> >(int, "
        "at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>, TrivialOffsetCalculator<2, unsigned int>, "
        "TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<2>, "
        "at::native::memory::StoreWithCast<1>)": "elementwise",
        "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, "
        "at::native::templates::cuda::normal_and_transform<float, float, 4, at::CUDAGeneratorImpl*>": (
            "random numbers"  # not a norm
        ),
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, __nv_bfloat16>": (
            "matrix products"  # the second half of a split-K GEMM, not a reduction of the model's
        ),
        "ncclDevKernel_AllReduce_Sum_f32": "communication",
        "void cub::DeviceScanKernel<float>": "other",
    }
    assert {name: bench.kernel_kind(name) for name in names} == names
    # The table: busy time summed by kind, largest first, each kind's share and µs a call.
    profiles = bench.Profiles(torch.device("cpu"), 1e9, None, {}, lambda: None)
    ops = {"aten::mm": (600.0, 2), "aten::addmm": (200.0, 2), "aten::mul": (150.0, 3), "aten::_to_copy": (50.0, 5)}
    rows = profiles.kinds("grpo", "update", {"ops": ops})
    assert [(r["kind"], r["ms"], r["calls"]) for r in rows] == [
        ("matrix products", 0.8, 4), ("elementwise", 0.15, 3), ("copies and casts", 0.05, 5)
    ]  # fmt: skip
    assert [r["of busy"] for r in rows] == [0.8, 0.15, 0.05] and rows[0]["µs a call"] == 200.0


def test_the_host_side_of_the_device_time_is_summed():
    # Events as read_events gives them, (name, on the device, start ns, end ns, thread), by hand:
    # the phase's range 0-1000 ns; two kernel launches and a stream synchronise of 300 ns inside
    # it, a synchronise of 50 ns and a launch after it (bench's own, outside the phase); two
    # kernels of 100 and 200 ns on the device. Busy 300 ns, 1 CUDA sync, 300 ns waited, 2 launches.
    events = [
        (bench.PHASE_RANGE, False, 0, 1000, 1),
        ("cudaLaunchKernel", False, 10, 20, 1),
        ("cudaLaunchKernelExC", False, 30, 40, 1),
        ("cudaStreamSynchronize", False, 100, 400, 1),
        ("cudaStreamSynchronize", False, 1100, 1150, 1),
        ("cudaLaunchKernel", False, 1200, 1210, 1),
        ("gemm_kernel", True, 50, 150, 7),
        ("elementwise_kernel", True, 150, 350, 7),
    ]
    measured = bench.summarise(events, cuda=True)
    assert measured["busy s"] == pytest.approx(300e-9) and measured["CUDA syncs"] == 1
    assert measured["sync wait s"] == pytest.approx(300e-9) and measured["launches"] == 2


def test_only_the_phases_named_are_profiled():
    # --profile_phases update: one grpo.py step of the tiny model, whose update alone runs under the
    # profiler (a row in the profile and its kinds); the rollout and scoring run as they are, their
    # time still in the step's time/* metrics. A phase no script has is refused before anything runs.
    args = bench.Args(profile="grpo", profile_phases="update", train_batch_size=2, group_size=2, max_new_tokens=4)
    device = torch.device("cpu")
    report = {}
    profiles = bench.Profiles(device, 1e9, None, report, lambda: None)
    step = bench.profile_script(args, "grpo", bench.bench_directory(args, device), device, 4, profiles)
    assert [(row["run"], row["phase"]) for row in report["profile"]] == [("grpo", "update")]
    assert {row["phase"] for row in report["profile_kinds"]} == {"update"}
    assert step["time/generate"] > 0 and step["time/update"] > 0
    with pytest.raises(SystemExit, match="--profile_phases update,backward: backward is none of generate"):
        bench.main(bench.Args(profile="grpo", profile_phases="update,backward", output=""))
    with pytest.raises(SystemExit, match="--profile_phases names the phases --profile profiles"):
        bench.main(bench.Args(profile_phases="update", sampler_rows=4, output=""))  # before the sampler runs
