"""The planner's CUDA lines: NCCL communicators per rank, the allocator cache carried between
phases, pinned host memory per node, and the 7B config's `rlhf plan` output."""

from pathlib import Path

import pytest

from rlhf.config import load_config
from rlhf.config.schema import OffloadConfig, ParallelConfig
from rlhf.engine.offload import HOST_ALIGN, PAGE_BYTES
from rlhf.models.config import ModelArgs
from rlhf.plan.advice import plan_with_advice
from rlhf.plan.inputs import GIB, RoleSpec
from rlhf.plan.memory import (
    NCCL_NVLS_BYTES,
    NCCL_PEER_BYTES,
    NCCL_SPLIT_BYTES,
    NCCL_WORLD_BYTES,
    Communicator,
    carry_cache,
    communicator_bytes,
    communicators,
    plan_job,
)
from rlhf.plan.report import format_plan

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MULTIGPU = CONFIGS / "qwen2.5-7b_ppo_multigpu.yaml"
MODELS = (CONFIGS / "models",)


def _spec(name, *, tp=1, pp=1, world=8, trains=True, tied=False, vpp=1):
    args = ModelArgs.from_hf_config(dict(
        model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=tied))
    return RoleSpec(name=name, head="lm", args=args, parallel=ParallelConfig(tp=tp, pp=pp, vpp=vpp),
                    world_size=world, colocated=True, dtype=None, trains=trains,
                    recompute="none", tokens=16, shards=1, offload=OffloadConfig())


def test_a_rank_holds_a_communicator_for_every_distinct_group_its_meshes_create():
    actor = _spec("actor", tp=2, pp=2, tied=True)  # dp 2 over 8 ranks
    ref = _spec("ref", tp=2, trains=False)  # dp 4; its tp (and mp) pairs are the actor's tp
    comms = communicators([actor, ref], pool_size=8, vllm_tp=2)
    # rank 0: tp (0,1), pp (0,2) (the tied-embedding pair is the same ranks), dp (0,4),
    # mp (0,1,2,3), the ref's dp (0,2,4,6) and its one-rank pp group, the world, vLLM's tp
    names = {c.name: c.ranks for c in comms[0]}
    assert names == {"world": tuple(range(8)), "actor tp": (0, 1), "actor pp": (0, 2),
                     "actor dp": (0, 4), "actor mp": (0, 1, 2, 3), "ref dp": (0, 2, 4, 6),
                     "one-rank": (0,), "vllm tp": (0, 1)}
    assert len(comms) == 8 and all(len(c) == 8 for c in comms.values())
    assert [c.name for c in comms[0] if not c.split] == ["world", "vllm tp"]
    (alone,) = communicators([_spec("actor", world=1)], pool_size=1)[0]
    assert alone == Communicator("world", (0,), split=False)  # bound to the GPU at init
    interleaved = communicators([_spec("actor", pp=4, world=4, vpp=2)], pool_size=4)
    # the pipeline's send/recv go over the pp group (here the world): no pair of their own;
    # the first and last stage's embedding group exists, tied or not
    assert [(c.name, c.ranks) for c in interleaved[0]] == [
        ("world", (0, 1, 2, 3)), ("one-rank", (0,)), ("actor embedding", (0, 3))]


def test_a_communicator_takes_its_own_state_plus_peer_or_nvls_buffers():
    def size(ranks, *, split=True, nvls=True, ranks_per_node=8):
        return communicator_bytes(Communicator("x", ranks, split=split),
                                  ranks_per_node=ranks_per_node, nvls=nvls)

    assert size((0,)) == NCCL_SPLIT_BYTES and size((0,), split=False) == NCCL_WORLD_BYTES
    assert size((0, 1)) == NCCL_SPLIT_BYTES + NCCL_NVLS_BYTES
    assert size((0, 1), nvls=False) == NCCL_SPLIT_BYTES + NCCL_PEER_BYTES
    # one rank on each node: NVLS has nothing to multicast within a node
    assert size((0, 8)) == NCCL_SPLIT_BYTES + NCCL_PEER_BYTES
    assert size((0, 4, 8, 12), split=False) == NCCL_WORLD_BYTES + NCCL_NVLS_BYTES
    assert NCCL_PEER_BYTES < NCCL_NVLS_BYTES


def test_the_allocator_cache_is_carried_until_a_wake_or_a_phase_that_needs_it():
    phases = {
        "sync": {"actor weights": 10, "cuda context": 5},
        "generate": {"actor weights": 10, "vllm kv_cache": 50, "cuda context": 5},
        "forward actor": {"actor weights": 10, "actor forward": 20, "cuda context": 5},
        "update critic": {"actor weights": 10, "critic activations": 60, "cuda context": 5},
        "update actor": {"actor weights": 10, "actor activations": 30, "cuda context": 5},
    }
    out, emptied = carry_cache(phases, device_bytes=100)
    # vLLM's KV cache is not PyTorch's: nothing of it is carried into forward actor
    assert "allocator cache" not in out["forward actor"]
    assert out["update actor"]["allocator cache"] == 30  # the critic's 60 less the actor's 30
    assert emptied == ("sync", "generate")
    out, emptied = carry_cache(phases, device_bytes=60)  # carrying would not fit: emptied
    assert "allocator cache" not in out["update actor"] and emptied[-1] == "update actor"


def test_7b_plan_shows_head_ops_cache_communicators_and_host_memory_and_fits():
    cfg = load_config(MULTIGPU, ["trainer.nnodes=2"])  # a dp group that spans two nodes
    plan, advice = plan_with_advice(cfg, model_dirs=MODELS)
    assert plan.fits and plan.host_source == "trainer.host_memory_gb"
    text = format_plan(plan, advice, title=str(MULTIGPU))
    for line in ("head workspace by op (update, last stage): logits", "logits grad",
                 "softmax chunk", "nccl actor tp", "nccl vllm tp", "cuda context",
                 "vllm residual", "allocator cache (reserved but free",
                 "pinned host memory per node", "critic optimizer"):
        assert line in text, line
    rank0 = next(d for d in plan.devices if 0 in d.ranks)
    nccl = {k: v for k, v in rank0.phases["sync"].items() if k.startswith("nccl ")}
    # 2 nodes of 8: the actor's dp pair (0, 8) spans both, its tp four share node 0 (NVLS)
    assert nccl["nccl actor dp"] == NCCL_SPLIT_BYTES + NCCL_PEER_BYTES
    assert nccl["nccl actor tp"] == NCCL_SPLIT_BYTES + NCCL_NVLS_BYTES
    assert nccl["nccl world"] == NCCL_WORLD_BYTES + NCCL_NVLS_BYTES
    assert nccl["nccl one-rank"] == NCCL_SPLIT_BYTES and len(nccl) >= 9
    off = plan_job(load_config(MULTIGPU, ["trainer.nnodes=2", "trainer.nccl_nvls=false"]),
                   model_dirs=MODELS)
    rank0_off = next(d for d in off.devices if 0 in d.ranks)
    saved = rank0.total("sync") - rank0_off.total("sync")
    # vLLM's tp communicator is inside its measured residual (rollout.sleep_residual_gb), so
    # what NVLS adds there only moves bytes from the residual's line to the communicator's
    local = sum(1 for k, v in nccl.items()
                if v > NCCL_WORLD_BYTES + NCCL_PEER_BYTES and k != "nccl vllm tp")
    assert saved == local * (NCCL_NVLS_BYTES - NCCL_PEER_BYTES) > 0
    # the critic's freed update is carried into the actor's (not emptied: it fits)
    assert rank0.phases["update actor"].get("allocator cache", 0) > GIB
    # the offloaded critic (params, grads, optimizer) and ref (params) pin their copies:
    # 8 ranks a node, one rank's shard of each
    node = plan.host[0]
    critic = plan.stages["critic"][0]
    assert node.pinned["critic optimizer"] == 8 * critic.host_buffer["optimizer"]
    # one flat buffer of the two moments, each aligned, in whole pages: the state and a page
    extra = critic.host_buffer["optimizer"] - critic.state["optimizer"]
    assert 0 <= extra < 2 * HOST_ALIGN + 2 * PAGE_BYTES  # and the spare page
    assert set(node.pinned) == {"critic weights", "critic grads", "critic masters",
                                "critic optimizer", "ref weights"}


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_shipped_7b_config_leaves_a_tenth_of_every_gpu_free_in_every_phase(nodes):
    """As shipped (8 GPUs) and on two nodes: every phase of every device within 90%."""
    cfg = load_config(MULTIGPU, [f"trainer.nnodes={nodes}"])
    assert cfg.trainer.pool_size == 8 * nodes and cfg.rollout.tp == 2
    plan = plan_job(cfg, model_dirs=MODELS)
    assert plan.host_fits
    for device in plan.devices:
        for phase in device.phases:
            assert device.total(phase) <= 0.9 * plan.hardware.device_bytes, (device.ranks, phase)
    # the KV cache holds the 512 sequences of 2,048 tokens it was sized for: 56 KiB a token
    # (28 layers, K and V, 4 kv heads of 128, bf16), split over the replica's 2 ranks
    need = 512 * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens) * 28 * 2 * 4 * 128 * 2
    assert need / 2 <= plan.vllm["kv_cache"] <= 1.2 * need / 2


def test_pinned_copies_beyond_a_nodes_ram_do_not_fit_and_advice_offloads_less():
    cfg = load_config(MULTIGPU, ["trainer.host_memory_gb=200"])
    plan, advice = plan_with_advice(cfg, model_dirs=MODELS)
    assert not plan.host_fits and not plan.fits
    assert plan.peak <= plan.hardware.device_bytes  # the GPUs alone would fit
    fixes = [a.overrides for a in advice if a.fits]
    assert any(o[0].endswith("=false") and ".offload." in o[0] for o in fixes), fixes
    assert "pinned host copies exceed" in format_plan(plan, advice, title="x")
    detected = plan_job(load_config(MULTIGPU, ["trainer.host_memory_gb=null"]),
                        model_dirs=MODELS)
    assert detected.host_source.startswith("detected RAM")


def test_a_tied_head_at_pp1_has_its_workspace_counted():
    """At pp=1 with tied embeddings the LM head multiplies by the embedding's weight: its
    log-prob workspace is the untied head's (it used to be counted as nothing)."""
    import torch

    from rlhf.config.schema import OffloadConfig, ParallelConfig, TinyModelConfig
    from rlhf.demo.tiny_model import tiny_hf_config
    from rlhf.models.config import ModelArgs
    from rlhf.plan.inputs import RoleSpec
    from rlhf.plan.memory import stage_memory

    def head_bytes(tied: bool) -> int:
        args = ModelArgs.from_hf_config(tiny_hf_config(TinyModelConfig(tie_embeddings=tied),
                                                   bos_id=0, eos_id=1, pad_id=2).to_dict())
        spec = RoleSpec(name="actor", head="lm", args=args, parallel=ParallelConfig(), world_size=1,
                        colocated=True, dtype=torch.bfloat16, trains=True, recompute="none",
                        tokens=1024, shards=1, offload=OffloadConfig())
        (stage,) = stage_memory(spec)
        return sum(stage.head.values())

    assert head_bytes(tied=True) == head_bytes(tied=False) > 0
