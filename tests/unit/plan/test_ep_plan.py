"""The planner at ep > 1: each rank holds E / ep experts per MoE layer (from the meta build with
`apply_ep`), and its optimizer state is split as the engine splits it: dense parameters over
dp, routed experts over the expert-data-parallel group."""

import dataclasses

import torch

from rlhf.config.schema import OffloadConfig, ParallelConfig
from rlhf.engine.zero import state_bytes
from rlhf.plan.inputs import RoleSpec
from rlhf.plan.memory import stage_memory
from rlhf.plan.shapes import stage_shapes
from tests.unit.plan.test_moe_plan import ARGS


def test_each_rank_holds_its_share_of_the_experts():
    (full,) = stage_shapes(ARGS, ParallelConfig(), head="lm", dtype=torch.float32)
    (half,) = stage_shapes(ARGS, ParallelConfig(ep=2), head="lm", dtype=torch.float32)
    experts = {p.name for p in half if p.expert}
    assert experts == {p.name for p in half if ".mlp.experts." in p.name}
    assert {n.split(".experts.")[1].split(".")[0] for n in experts} == {"0", "1", "2", "3"}
    assert len([p for p in full if p.expert]) == 2 * len(experts)  # 8 experts, 4 held
    dense = {p.name: p.shape for p in full if not p.expert}
    assert dense == {p.name: p.shape for p in half if not p.expert}  # routers included


def test_state_bytes_split_dense_over_dp_and_experts_over_edp():
    parallel = ParallelConfig(ep=2)
    spec = RoleSpec(name="actor", head="lm", args=ARGS, parallel=parallel, world_size=8,
                    colocated=True, dtype=torch.bfloat16, trains=True, recompute="none",
                    tokens=256, shards=8, offload=OffloadConfig(), expert_shards=4)
    (shapes,) = stage_shapes(ARGS, parallel, head="lm", dtype=torch.bfloat16)
    dense = state_bytes([p.numel for p in shapes if not p.expert], param_bytes=2, shards=8)
    experts = state_bytes([p.numel for p in shapes if p.expert], param_bytes=2, shards=4)
    (stage,) = stage_memory(spec)
    assert stage.state == {k: dense[k] + experts[k] for k in dense}
    # ZeRO-1 over all 8 dp ranks would under-count the experts' masters and moments
    together = state_bytes([p.numel for p in shapes], param_bytes=2, shards=8)
    assert stage.state["optimizer"] > together["optimizer"]
    one = stage_memory(dataclasses.replace(spec, parallel=ParallelConfig()))[0]
    assert one.state["weights"] > stage.state["weights"]  # every expert on every rank


def test_vllm_holds_every_expert_whatever_the_ep(tmp_path):
    from rlhf.config import load_config
    from rlhf.plan.inputs import hardware, role_specs
    from rlhf.plan.memory import vllm_bytes

    def vllm_weights(ep):
        # model.path in an empty folder: the quickstart's own sft_model (dense), which exists
        # once the quickstart ran, would win over model.tiny.
        cfg = load_config("configs/quickstart.yaml", [f"model.path={tmp_path / 'model'}",
                                                      "model.tiny.arch=qwen3_moe",
                                                      f"actor.parallel.ep={ep}"])
        hw = hardware(cfg)
        actor = next(s for s in role_specs(cfg, hw) if s.name == "actor")
        return vllm_bytes(cfg, hw, actor)["weights"]

    assert vllm_weights(2) == vllm_weights(1)
