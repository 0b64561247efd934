"""`rlhf bench gap`: the planted faults change the tensors they name and nothing else. Its run
end to end (bf16 on a tiny Qwen2) is in tests/unit/rollout/test_rollout_bench.py, in the
interpreter the other vLLM benchmarks share."""

import torch

from rlhf.bench.gap import CASES


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.self_attn.{p}_proj.{kind}" for i in range(2) for p in "qkvo"
             for kind in ("weight", "bias") if not (p == "o" and kind == "bias")]
    return {n: torch.randn(4, generator=gen) for n in names + ["model.norm.weight"]}


def _changed(case: str, layer: int) -> set[str]:
    weights = _weights()
    planted = CASES[case](dict(weights), layer)
    assert planted.keys() == weights.keys()
    return {n for n in weights if not torch.equal(planted[n], weights[n])}


def test_each_fault_changes_only_the_tensors_it_names():
    assert _changed("healthy", 1) == set()
    assert _changed("withheld", 1) == {n for n in _weights() if n.startswith("model.layers.1.")}
    assert _changed("swapped", 0) == {f"model.layers.0.self_attn.{p}_proj.{kind}"
                                      for p in "kv" for kind in ("weight", "bias")}
    swapped = CASES["swapped"](_weights(), 0)
    assert torch.equal(swapped["model.layers.0.self_attn.k_proj.weight"],
                       _weights()["model.layers.0.self_attn.v_proj.weight"])
    assert _changed("bias_dropped", 1) == {f"model.layers.1.self_attn.{p}_proj.bias"
                                           for p in "qkv"}
    assert not CASES["bias_dropped"](_weights(), 1)["model.layers.1.self_attn.q_proj.bias"].any()
