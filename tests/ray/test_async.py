"""Rollouts on their own ranks (rollout.placement separate) and one-step-off-policy training,
end to end through run_train on the tiny arithmetic job: separate placement samples exactly
what colocated samples (same seed, same weights, also after a weight transfer), the one-step
loop trains on samples one version old with ratios against that version, and a resumed async
run repeats an uninterrupted one (both through PPOTrainer on one set of worker groups)."""

import shutil

import pytest

from rlhf.trainer.jobs import RoleGroups, job_workers, load_tokenizer, run_train
from rlhf.trainer.metrics import read_metrics
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm]

GRPO = {"adv_estimator": "grpo", "kl_in_reward": False, "use_kl_loss": True,
        "kl_loss_coef": 0.01}
SEPARATE = {"placement": "separate", "world_size": 1}


# A random tiny model never answers right; a length score varies within every group, so the
# advantages, and with them the updates, are not zero.
REWARD = """
def length(*, prompt, response, ground_truth, extra):
    return len(response) / 10.0
"""


def _job(assets, out, *, rollout=None, trainer=None):
    reward = out.parent / "length_reward.py"
    reward.write_text(REWARD)
    return job_config(assets, out, algorithm=GRPO, actor={"ppo_mini_batch_size": 4},
                      rollout=rollout or {},
                      reward={"functions": [{"path": f"{reward}:length"}]},
                      trainer={"ranks_per_node": 1, "save_every": 0, **(trainer or {})})


def _same(a: dict, b: dict, keys, tol=1e-6):
    for key in keys:
        assert abs(a[key] - b[key]) <= tol * max(1.0, abs(a[key])), (key, a[key], b[key])


def test_separate_placement_samples_and_syncs_like_colocated(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    runs = {}
    for name, rollout in (("colocated", {}), ("separate", SEPARATE)):
        cfg = _job(assets, tmp_path / name, rollout=rollout,
                   trainer={"total_steps": 3, "val_every": 2})
        run_train(cfg, progress=False)
        runs[name] = read_metrics(cfg.trainer.output_dir)
    colocated, separate = runs["colocated"], runs["separate"]
    assert [r["step"] for r in separate] == [0, 1, 2, 3]
    # Steps 2 and 3 sample after a sync: the same responses need the same weights in vLLM.
    for a, b in zip(colocated, separate):
        if a["step"] == 0 or a["step"] == 2:
            _same(a, b, ["val/accuracy", "val/response_length"])
        if a["step"] == 0:
            continue
        _same(a, b, ["response_length/mean", "reward/mean", "actor/pg_loss"])
        _same(a, b, ["rollout/logprob_gap_mean", "rollout/logprob_gap_max"], tol=1e-5)
        assert b["rollout/logprob_gap_max"] < 2e-4
    step2, step3 = separate[2], separate[3]
    assert step2["sync/bytes"] > 0 and step2["transfer/bytes"] == step2["sync/bytes"]
    assert step2["sync/gb_per_s"] > 0 and step2["sync/skipped"] == 0.0
    assert step3["sync/skipped"] == 1.0  # step 2's validation already sent version 2


def test_one_step_trains_on_the_previous_version_and_resumes_exactly(ray_cluster, tmp_path):
    assets = make_assets(tmp_path)
    async_run = {"async_mode": "one_step", "total_steps": 4}
    whole = _job(assets, tmp_path / "whole", rollout=SEPARATE,
                 trainer={**async_run, "save_every": 2})
    roles, role_configs = job_workers(whole)
    groups = RoleGroups(whole, roles, job_name="async-test", role_configs=role_configs)
    try:
        records = _fit(whole, groups)
        # Resume from step 2's checkpoint (it holds batch 3, in flight) in a fresh folder, on
        # the same workers (as test_trainer_ppo's resume): they hold step-4 weights, the
        # rollout pool too, so the resume must restore step 2's and sync them to the pool.
        resumed = _job(assets, tmp_path / "resumed", rollout=SEPARATE,
                       trainer={**async_run, "resume": str(tmp_path / "whole/checkpoints/step_2")})
        again = _fit(resumed, groups)
    finally:
        groups.shutdown()
    assert read_metrics(whole.trainer.output_dir) == records
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    first, later = records[0], records[1:]
    assert first["async/staleness_0"] == 1.0 and first["async/policy_version"] == 0
    assert abs(first["actor/approx_kl"]) < 1e-8  # version 0 samples, trained at version 0
    for r in later:
        assert r["async/staleness_1"] == 1.0 and r["async/dropped_samples"] == 0
        assert r["async/policy_version"] == r["step"] - 1
        # old log-probs are the sampling version's (k-2): the ratio sees one update
        assert abs(r["actor/approx_kl"]) > 1e-4  # measured: about 1e-3 (step 1: 2e-14)
    # the last step submits nothing, so the pool's idle time is known up to step 3
    assert {"async/rollout_idle_s", "timing/wait_rollout", "rollout/seconds"} <= set(later[1])
    assert later[1]["async/rollout_idle_s"] >= 0

    assert read_metrics(resumed.trainer.output_dir) == again
    assert [r["step"] for r in again] == [3, 4]
    for a, b in zip(records[2:], again):
        keys = [k for k in a if k.startswith(("actor/", "reward/", "response_length",
                                               "async/staleness", "rollout/logprob"))]
        assert keys
        _same(a, b, keys, tol=1e-5)
    shutil.rmtree(tmp_path / "whole", ignore_errors=True)


def _fit(cfg, groups):
    return PPOTrainer(cfg, groups.views, tokenizer=load_tokenizer(cfg.model.path),
                      job_name="async-test", progress=False).fit()


def test_bounded_staleness_syncs_only_past_the_bound_and_recompute_ratios_start_at_one(
        ray_cluster, tmp_path):
    """max_staleness 2: the rollout pool keeps its weights until a batch would be trained more
    than two versions after them (one sync in five steps); with async_old_log_probs recompute
    the ratio's denominator is the trainer's weights, so the single mini-batch update starts
    on-policy (no KL) while the rollout log-probs drift from them as samples grow stale."""
    assets = make_assets(tmp_path)
    cfg = _job(assets, tmp_path / "bounded", rollout=SEPARATE,
               trainer={"async_mode": "bounded", "max_staleness": 2,
                        "async_old_log_probs": "recompute", "total_steps": 5})
    run_train(cfg, progress=False)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    # versions sampled: 0 0 0 2 2 (the sync at step 3 sends version 2), trained at 0 1 2 3 4
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 2.0, 1.0, 2.0]
    assert [r["async/policy_version"] for r in records] == [0.0, 1.0, 2.0, 3.0, 4.0]
    # (the last step submits nothing, so it reports no sync)
    assert [r.get("sync/skipped") for r in records] == [1.0, 1.0, 0.0, 1.0, None]
    assert records[2]["sync/bytes"] > 0
    assert all(r["async/dropped_samples"] == 0 for r in records)
    for r in records:
        assert abs(r["actor/approx_kl"]) < 1e-6, r  # old = current weights: ratio 1
    gap = [r["rollout/logprob_gap_mean"] for r in records]
    assert records[0]["rollout/logprob_gap_max"] < 2e-4  # version 0 sampled and trained
    # measured 1e-7, 0.079, 0.126, 0.039, 0.060: two versions apart drift more than one
    assert gap[1] > 1e-3 and gap[2] > gap[1] and gap[4] > gap[3] > 1e-3


def test_a_tp2_actor_feeds_two_rollout_ranks_within_the_log_prob_tolerance(ray_cluster, tmp_path):
    """Both actor ranks export (TP all-gathers), rank 0 sends, both rollout ranks receive every
    tensor: after the transfer vLLM scores the samples as the trainer does."""
    assets = make_assets(tmp_path)
    cfg = job_config(assets, tmp_path / "tp2", algorithm=GRPO,
                     actor={"ppo_mini_batch_size": 4, "parallel": {"tp": 2}},
                     rollout={"placement": "separate", "world_size": 2},
                     trainer={"ranks_per_node": 2, "total_steps": 2, "save_every": 0})
    run_train(cfg, progress=False)
    records = read_metrics(cfg.trainer.output_dir)
    step2 = records[-1]
    assert step2["sync/skipped"] == 0.0 and step2["sync/bytes"] == step2["transfer/bytes"]
    assert step2["rollout/logprob_gap_max"] < 2e-4


def test_streaming_continues_samples_across_updates_and_resumes_exactly(ray_cluster, tmp_path):
    """async_mode streaming on a rollout rank of its own: 12-token responses in 3-token
    segments, so samples in flight meet each weight update and continue under the new
    version; every token within max_staleness 1 of the version that trains it; and a run
    resumed from step 2's checkpoint (its stream: samples in flight, the buffer, the fates)
    trains step 3 exactly as the uninterrupted run does."""
    assets = make_assets(tmp_path)
    # validation at step 2 samples on the pool behind the segment in flight, with version 2
    streaming = {"async_mode": "streaming", "stream_segment_tokens": 3, "total_steps": 3,
                 "max_staleness": 1, "stream_slots": 12, "val_every": 2}
    rollout = {**SEPARATE, "max_new_tokens": 12}
    whole = _job(assets, tmp_path / "whole", rollout=rollout,
                 trainer={**streaming, "save_every": 2})
    roles, role_configs = job_workers(whole)
    groups = RoleGroups(whole, roles, job_name="stream-test", role_configs=role_configs)
    try:
        records = _fit(whole, groups)
        resumed = _job(assets, tmp_path / "resumed", rollout=rollout,
                       trainer={**streaming, "resume": str(tmp_path / "whole/checkpoints/step_2")})
        again = _fit(resumed, groups)
    finally:
        groups.shutdown()
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 0: validation before training
    records = records[1:]
    first, later = records[0], records[1:]
    assert later[0]["sync/skipped"] == 0.0 and later[0]["sync/bytes"] > 0
    assert "val/accuracy" in later[0] and later[1]["sync/skipped"] == 1.0  # version 2 was sent
    assert first["async/token_staleness_0"] == 1.0 and first["async/interrupted_samples"] == 0
    for r in later:
        # segments sampled by the previous version, continued under this step's weights
        assert r["async/interrupted_samples"] > 0, r
        assert 0 < r["async/token_staleness_1"] < 1 and r["async/token_staleness_p100"] == 1
        assert r["async/dropped_samples"] == 0
        assert r["async/policy_version"] == r["step"] - 1
        assert 3 < r["response_length/mean"] <= 12  # most run past a segment (measured 11.75)
    assert [r["step"] for r in again] == [3]
    keys = [k for k in records[2] if k.startswith(("actor/", "reward/", "response_length",
                                                   "async/token_staleness", "rollout/logprob"))]
    _same(records[2], again[0], keys, tol=1e-5)
    shutil.rmtree(tmp_path / "whole", ignore_errors=True)
