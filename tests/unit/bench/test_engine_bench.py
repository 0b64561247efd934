"""`rlhf bench engine` on the CPU, small: one training step timed, memory against the planner,
the offload round trip, bf16 and fp32 log-probs against transformers and an fp64 reference."""

import pytest

pytestmark = pytest.mark.timeout(600)


def test_bench_engine_prints_speed_memory_against_the_plan_and_logprob_agreement(bench_lines):
    lines = {x["kind"]: x for x in bench_lines(
        "engine", "--size", "tiny", "--layers", "2", "--tokens", "256", "--seq-len", "64",
        "--micro-batches", "2", "--steps", "1")}
    assert set(lines) == {"config", "step", "memory", "offload", "logprobs"}
    assert lines["config"]["device"] == "cpu" and lines["config"]["tokens_per_step"] == 512
    step = lines["step"]
    assert step["tokens_per_s"] > 0 and step["peak_source"].startswith("measured")
    assert 0 < step["mfu"] == pytest.approx(
        step["model_tflops_per_s"] / step["peak_tflops_per_s"], rel=0.05, abs=1e-3)
    memory = lines["memory"]
    assert memory["held_state_bytes"] == memory["planned_state_bytes"]  # exact
    # the activation estimate (flash attention) is within 30% of what the CPU path saves
    assert 0.7 < memory["activation_ratio"] < 1.3
    assert step["attention_kernel"] == "sdpa_split" and step["micro_batches"] == 2
    assert 0 < step["forward_backward_s"] and 0 < step["optimizer_step_s"]
    offload = lines["offload"]
    assert offload["bytes"] == memory["held_state_bytes"] and offload["bit_exact_samples"]
    assert offload["pinned"] is False and offload["to_host_gb_per_s"] > 0
    assert offload["plain_to_device_gb_per_s"] > 0
    logprobs = lines["logprobs"]
    assert logprobs["tokens"] == 4 * (64 - 16)  # every response token of one micro-batch
    assert 0 <= logprobs["mean_abs_diff"] <= logprobs["max_abs_diff"] < 0.05  # bf16 rounding
    # Against the fp64 reference: both bf16 runs are bf16-noisy, fp32 is exact to ~1e-6.
    for pair in ("engine_bf16_vs_transformers_fp64", "transformers_bf16_vs_transformers_fp64"):
        assert 0 < logprobs[pair]["max_abs_diff"] < 0.05
    assert logprobs["engine_fp32_vs_transformers_fp64"]["max_abs_diff"] < 1e-4


def test_bench_engine_profiles_a_step_on_request(bench_lines):
    lines = {x["kind"]: x for x in bench_lines(
        "engine", "--size", "tiny", "--layers", "2", "--tokens", "128", "--seq-len", "64",
        "--micro-batches", "1", "--steps", "1", "--no-logprobs", "--no-offload", "--profile", "5")}
    profile = lines["profile"]
    assert profile["time"] == "cpu" and len(profile["top"]) == 5
    times = [row["ms"] for row in profile["top"]]
    assert times == sorted(times, reverse=True) and 0 < sum(times) <= profile["total_ms"]
    assert any(row["name"] in ("aten::mm", "aten::addmm", "aten::bmm") for row in profile["top"])
    split = profile["split_ms"]
    assert list(split) == ["matmul", "attention", "elementwise", "comms", "idle"]
    assert split["matmul"] > 0 and split["attention"] > 0 and split["elementwise"] > 0
    assert split["comms"] == 0  # one rank
    busy = split["matmul"] + split["attention"] + split["elementwise"]
    assert busy == pytest.approx(profile["total_ms"], rel=1e-3, abs=0.01)
    assert busy + split["idle"] == pytest.approx(max(profile["wall_ms"], busy), rel=1e-3,
                                                 abs=0.01)


@pytest.mark.parametrize("name,cls", [
    ("aten::mm", "matmul"), ("aten::_grouped_mm", "matmul"), ("sm90_xmma_gemm_bf16", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("flash_fwd_kernel", "attention"), ("c10d::allreduce_", "comms"),
    ("ncclDevKernel_AllGather_RING_LL", "comms"), ("gloo:all_to_all", "comms"),
    ("aten::mul", "elementwise"), ("aten::_fused_adamw_", "elementwise"),
    ("aten::embedding_dense_backward", "elementwise")])
def test_profile_split_classes(name, cls):
    from rlhf.bench.engine import op_class

    assert op_class(name) == cls
