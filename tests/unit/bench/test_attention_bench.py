"""`rlhf bench attention` on the CPU: the kernels pick_kernel can choose here, each against the
fp32 reference in values and grads, with and without a shared prefix."""

import argparse

import torch

from rlhf.bench import attention as bench_attention
from rlhf.models.attention import sdpa_split


def _args(**over):
    parser = argparse.ArgumentParser()
    bench_attention.add_arguments(parser)
    return parser.parse_args(["--heads", "8", "--kv-heads", "2", "--head-dim", "16",
                              "--device", "cpu", *over.get("argv", [])])


def test_cpu_runs_sdpa_split_in_fp32_and_bf16_and_it_agrees():
    lines = bench_attention.bench(_args())
    assert {(x["kernel"], x["dtype"], x["shared_prefix"]) for x in lines} == {
        ("sdpa_split", d, s) for d in ("float32", "bfloat16") for s in (False, True)}
    assert all(x["passed"] and x["chosen"] for x in lines), lines
    fp32 = [x for x in lines if x["dtype"] == "float32"]
    assert all(max(x["relative_error"].values()) < 1e-5 for x in fp32)


def test_a_wrong_kernel_fails_the_agreement():
    def off_by_one(q, k, v, **kw):  # drops the shared prefix and shifts the output
        kw["prefix"] = None
        return sdpa_split(q, k, v, **kw).roll(1, dims=0)

    line = bench_attention.agreement(off_by_one, torch.float32, torch.device("cpu"),
                                     shared=True, args=_args())
    assert not line["passed"] and line["relative_error"]["out"] > 0.1


def test_speed_shapes_cover_the_tokens():
    assert bench_attention.speed_lengths(8192, 1024, "equal") == [1024] * 8
    mixed = bench_attention.speed_lengths(8192, 1024, "mixed")
    assert sum(mixed) == 8192 and len(set(mixed)) > 3 and max(mixed) < 2048


def test_kernels_on_cuda_include_torch_varlen_where_torch_has_it(monkeypatch):
    from rlhf.models import attention
    from rlhf.models.varlen_kernels import torch_varlen

    monkeypatch.setattr(bench_attention, "torch_varlen_fn", lambda: object())
    monkeypatch.setattr(bench_attention, "_flash_fn", lambda: None)
    found = bench_attention.kernels(torch.device("cuda"))
    assert found["torch_varlen"][0] is torch_varlen
    assert found["sdpa_split"][1] == (torch.float32, torch.bfloat16, torch.float16)
    assert "flash_varlen" not in found and attention.sdpa_split is found["sdpa_split"][0]
