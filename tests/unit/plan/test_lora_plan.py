"""The memory planner with LoRA: the base is frozen (grads, fp32 masters and Adam moments for
the adapters only) and the reference comes from the actor's base (no ref role)."""

from rlhf.config import load_config
from rlhf.plan.memory import plan_job
from rlhf.plan.report import format_plan, model_dirs

PATH = "configs/qwen2.5-7b_ppo_multigpu.yaml"


def test_planner_counts_grads_and_optimizer_for_adapters_only_and_no_ref_role():
    path = PATH
    full = plan_job(load_config(path, []), model_dirs=model_dirs(path))
    lora = plan_job(load_config(path, ["actor.lora.r=16"]), model_dirs=model_dirs(path))
    assert "ref" in full.roles and "ref" not in lora.roles and lora.ref_from_actor
    a, b = full.stages["actor"][0].state, lora.stages["actor"][0].state
    assert b["weights"] > a["weights"]  # the base plus the adapters
    for kind in ("grads", "masters", "optimizer"):
        assert b[kind] < a[kind] / 50, kind
    assert lora.peak < full.peak
    text = format_plan(lora, [], title=path)
    assert "lora r=16 (base frozen" in text and "ref: none built" in text
