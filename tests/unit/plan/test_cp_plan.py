"""The planner at cp > 1: a rank runs its 1/cp share of each micro-batch's tokens, its attention
holds the keys and values its query chunks read from the gathered stream, and ZeRO-1 splits
the dense state over dp x cp, as the engine does."""

import dataclasses
from pathlib import Path

from rlhf.config import load_config
from rlhf.plan.advice import plan_with_advice, with_overrides
from rlhf.plan.inputs import hardware, role_specs
from rlhf.plan.memory import communicators, layer_activation_bytes, plan_job, stage_memory

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
CP2 = ["actor.parallel.cp=2"]  # with shared prompts, the default
# model.tiny's shapes, never a model a quickstart run wrote under outputs/ (CI runs one first)
TINY = f"model.path={Path(__file__).resolve().parent / 'no-model-here'}"


def _actor(*overrides):
    cfg = load_config(QUICKSTART, [TINY, *overrides])
    return next(s for s in role_specs(cfg, hardware(cfg)) if s.name == "actor")


def test_cp_splits_tokens_and_zero1_over_dp_times_cp():
    plain, split = _actor(), _actor(*CP2)
    assert (plain.layout.dp, plain.layout.cp, split.layout.dp, split.layout.cp) == (2, 1, 1, 2)
    assert split.rank_tokens == plain.tokens // 2 and plain.rank_tokens == plain.tokens
    assert split.shards == plain.shards == 2  # dp x cp ranks either way
    assert stage_memory(split)[0].state == stage_memory(plain)[0].state  # weights unsplit


def test_routed_experts_zero1_over_edp_times_cp_and_its_communicator():
    moe = ["model.tiny.arch=qwen3_moe", "trainer.ranks_per_node=8", "actor.parallel.ep=2"]
    plain, split = _actor(*moe), _actor(*moe, *CP2)
    assert (plain.layout.edp, split.layout.edp, split.layout.cp) == (4, 2, 2)
    assert split.expert_shards == plain.expert_shards == 4  # edp x cp ranks either way
    # the engine's group of them is one more communicator per rank, only at ep > 1 and cp > 1
    assert "edp_cp" in split.layout.mesh_axes() and "edp_cp" not in plain.layout.mesh_axes()
    names = {c.name for c in communicators([split], pool_size=8)[0]}
    assert "actor edp_cp" in names


def test_activations_halve_plus_the_gathered_keys_and_values():
    plain, split = _actor(), _actor(*CP2)
    args, d = plain.args, plain.dtype.itemsize  # tp = 1
    kv = args.num_kv_heads * args.head_dim
    # rank r reads (r + 1) c + (2 cp - r) c = 5 c keys and values for its 2 c queries at cp=2
    assert (layer_activation_bytes(split, "none") - layer_activation_bytes(plain, "none")
            == d * 2 * kv * 5 / 2)
    (one,), (two,) = stage_memory(plain), stage_memory(split)
    extra = args.num_layers * split.rank_tokens * d * 2 * kv * 5 / 2  # one micro-batch at pp=1
    assert abs(two.activations - (one.activations / 2 + extra)) <= 1
    assert one.activations / 2 < two.activations < one.activations
    head = dataclasses.replace(plain, tokens=plain.tokens // 2)
    assert two.logits == stage_memory(head)[0].logits  # the head runs the local tokens only


def test_advice_for_a_long_sequence_that_does_not_fit_names_cp():
    cfg = load_config(QUICKSTART, [TINY, "actor.max_tokens_per_micro_batch=65536",
                                   "critic.max_tokens_per_micro_batch=2048"])
    plan = plan_job(cfg)
    tight = load_config(QUICKSTART, [TINY, "actor.max_tokens_per_micro_batch=65536",
                                     "critic.max_tokens_per_micro_batch=2048",
                                     f"trainer.device_memory_gb={plan.peak * 0.9 / 2**30:.3f}"])
    plan, advice = plan_with_advice(tight)
    assert not plan.fits
    by_change = {a.overrides: a for a in advice}
    cp = by_change[("actor.parallel.cp=2",)]  # shared prompts stay on
    assert cp.fits and cp.peak < plan.peak
    assert with_overrides(tight, cp.overrides).actor.parallel.cp == 2


def test_the_long_context_example_fits_its_stated_memory_only_with_cp():
    example = QUICKSTART.parent / "long_context.yaml"
    plan, _ = plan_with_advice(load_config(example))  # as shipped: cp=2
    assert plan.fits
    plan, advice = plan_with_advice(load_config(example, ["actor.parallel.cp=1",
                                                          "ref.parallel.cp=1"]))
    assert not plan.fits
    assert ("actor.parallel.cp=2",) in [a.overrides for a in advice if a.fits]
