"""A LoRA job on Ray with its colocated vLLM: the syncs send the adapter only, the engine samples
with it (the post-sync log-prob check passes at a float32 tolerance), and an adapter withheld
from vLLM stops the job instead of training on the base's samples. One vLLM start per rank."""

import pytest
import torch
from safetensors.torch import load_file

from rlhf.controller import Dispatch, register
from rlhf.rollout.sampling import LogprobGapError
from rlhf.trainer.jobs import RoleGroups, job_workers, load_tokenizer
from rlhf.trainer.metrics import read_metrics
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.trainer.jobs import TINY, job_config, make_assets
from workers.actor import ActorWorker

pytestmark = [pytest.mark.timeout(400), pytest.mark.vllm]

RANK = 8
GAP = 1e-3  # float32: a synced engine is within ~1e-5; the base is far beyond this
# A random tiny model never answers right; a length score varies within every group, so the
# advantages, and with them the updates, are not zero.
REWARD = """
def length(*, prompt, response, ground_truth, extra):
    return len(response) / 10.0
"""


class WithholdingActor(ActorWorker):
    """The actor, with a switch that sends vLLM an all-zero adapter (the base) from then on:
    the failure of an adapter that never reaches the rollout engine."""

    withheld = False

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def withhold_adapter(self) -> None:
        self.withheld = True

    def export_weights(self):
        buckets = super().export_weights()
        if not self.withheld:
            return buckets
        return ([(name, torch.zeros_like(t)) for name, t in bucket] for bucket in buckets)


def adapter_bytes() -> int:
    """fp32 bytes of rank-RANK factors on every linear layer of the tiny model."""
    h, kv = TINY.hidden_size, TINY.num_kv_heads * (TINY.hidden_size // TINY.num_heads)
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, TINY.intermediate_size),
              (h, TINY.intermediate_size), (TINY.intermediate_size, h)]  # (in, out)
    return 4 * TINY.num_layers * sum(RANK * (i + o) for i, o in shapes)


def test_lora_job_syncs_the_adapter_only_and_a_withheld_adapter_stops_it(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    (tmp_path / "length_reward.py").write_text(REWARD)
    cfg = job_config(
        assets, tmp_path / "lora-run",
        actor={"lora": {"r": RANK, "lora_alpha": 16.0}, "optim": {"lr": 5.0e-2}},
        algorithm={"adv_estimator": "grpo", "kl_in_reward": False},
        rollout={"n": 4, "max_logprob_gap_p99": GAP},
        reward={"functions": [{"path": f"{tmp_path / 'length_reward.py'}:length"}]},
        trainer={"total_steps": 3, "ranks_per_node": 1})
    roles, role_configs = job_workers(cfg)
    roles["actor"] = (WithholdingActor, roles["actor"][1])
    groups = RoleGroups(cfg, roles, job_name="lora-test", role_configs=role_configs)
    try:
        trainer = PPOTrainer(cfg, groups.views, tokenizer=load_tokenizer(cfg.model.path),
                             job_name="lora-test", progress=False)

        def after(step):
            if step == 2:  # steps 1-2 synced for real; step 3 gets the base
                groups.views["actor"].withhold_adapter()

        with pytest.raises(LogprobGapError, match="max_logprob_gap_p99"):
            trainer.fit(after_step=after)
    finally:
        groups.shutdown()

    records = {r["step"]: r for r in read_metrics(cfg.trainer.output_dir)}
    assert sorted(records) == [1, 2]  # step 3 stopped before it was logged
    first, second = records[1], records[2]
    assert first["sync/skipped"] == 1.0  # vLLM loaded model.path: the zero-B adapter is the base
    full = sum(t.numel() * t.element_size()
               for t in load_file(f"{cfg.model.path}/model.safetensors").values())
    assert second["sync/skipped"] == 0.0
    assert second["sync/bytes"] == adapter_bytes()  # per replica: the factors only
    assert second["sync/full_bytes"] == full
    assert second["actor/grad_norm"] > 0  # the policy moved: step 3's zero adapter is the base
    assert second["rollout/logprob_gap_max"] < GAP  # the adapter reached vLLM and is used
