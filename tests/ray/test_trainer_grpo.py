"""GRPO (no critic, KL loss) end to end, and a reward function that fails mid-run: the job
stops with a message naming the function, the last checkpoint intact (written in the
background, completed as the run stops). Both jobs run on one
set of worker groups, the second from a checkpoint of the groups' start."""

import json
from pathlib import Path

import pytest

from rlhf.errors import RLHFError
from rlhf.trainer.checkpoint import CheckpointManager
from rlhf.trainer.jobs import RoleGroups, job_workers, load_tokenizer
from rlhf.trainer.metrics import read_metrics
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(300)

REWARD = '''
def exact_or_explode(*, prompt, response, ground_truth, extra):
    if extra.get("explode"):
        raise ValueError("reward backend unreachable")
    return float(response.strip() == str(ground_truth))
'''
GRPO = {"adv_estimator": "grpo", "kl_in_reward": False, "use_kl_loss": True,
        "kl_loss_coef": 0.01}


def explosive_train_file(src: str, dst: Path, *, first_bad: int) -> str:
    """The rows of `src`, the ones from `first_bad` on marked to make the reward fail."""
    rows = [json.loads(line) for line in Path(src).read_text().splitlines()]
    for i, row in enumerate(rows):
        row["explode"] = i >= first_bad
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(dst)


@pytest.fixture(scope="module")
def groups(ray_cluster, tmp_path_factory):
    """The GRPO job's worker groups (actor with its rollout, reference) and a checkpoint of
    their start: each test restores it, so its job starts as on fresh groups. The mini-batch
    size reaches the workers in the driver's batch split, so the tests' configs may differ
    in it; everything else the workers read is the same."""
    root = tmp_path_factory.mktemp("grpo")
    assets = make_assets(root)
    cfg = job_config(assets, root / "start", algorithm=GRPO)
    roles, role_configs = job_workers(cfg)
    groups = RoleGroups(cfg, roles, job_name="grpo-test", role_configs=role_configs)
    try:
        start = str(root / "start-ckpt")
        groups.views["actor"].save_checkpoint(start)
        yield groups, assets, start
    finally:
        groups.shutdown()


def fit(groups, cfg):
    groups, _, start = groups
    groups.views["actor"].load_checkpoint(start)
    return PPOTrainer(cfg, groups.views, tokenizer=load_tokenizer(cfg.model.path),
                      job_name="grpo-test", progress=False).fit()


def test_grpo_steps_then_a_failing_reward_stops_the_job(groups, tmp_path):
    assets = groups[1]
    (tmp_path / "reward.py").write_text(REWARD)
    # Unshuffled batches of 4: steps 1 and 2 see rows 0-7, step 3 meets row 8.
    train = explosive_train_file(assets["train"], tmp_path / "train.jsonl", first_bad=8)
    cfg = job_config(
        assets, tmp_path / "grpo-run", algorithm=GRPO,
        reward={"functions": [{"path": f"{tmp_path / 'reward.py'}:exact_or_explode"}]},
        data={"train_files": [train], "shuffle": False},
        trainer={"total_steps": 3, "save_every": 1, "val_every": 2, "async_checkpoint": True})
    with pytest.raises(RLHFError, match="exact_or_explode") as info:
        fit(groups, cfg)
    assert "reward backend unreachable" in str(info.value)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert {"actor/pg_loss", "actor/kl_loss", "actor/kl_ref", "actor/approx_kl",
                "reward/mean", "timing/old_log_prob"} <= set(r)
        assert not any(k.startswith("critic/") for k in r)
    assert "val/accuracy" in records[2]
    ckpt = CheckpointManager(cfg.trainer.output_dir)
    assert [s for s, _ in ckpt.checkpoints()] == [1, 2]
    assert ckpt.load_state(ckpt.latest())["step"] == 2
    assert sorted(p.name for p in ckpt.latest().iterdir()) == ["actor", "manifest.json",
                                                               "trainer_state.pt"]
    assert not list(ckpt.root.glob(".step_*"))


def test_on_policy_grpo_takes_old_log_probs_from_the_update(groups, tmp_path):
    """One PPO epoch of one mini-batch and no KL in the reward: no separate old-log-prob pass,
    yet the metrics that read old log-probs (log-prob gap, entropy, KL to the reference) stay."""
    cfg = job_config(groups[1], tmp_path / "fused-run", actor={"ppo_mini_batch_size": 4},
                     algorithm=GRPO, trainer={"total_steps": 2, "save_every": 0})
    fit(groups, cfg)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert "timing/old_log_prob" not in r
        assert {"rollout/logprob_gap_mean", "rollout/entropy", "actor/kl_ref",
                "actor/approx_kl", "timing/update_actor"} <= set(r)
        assert abs(r["actor/approx_kl"]) < 1e-6 and r["actor/clipfrac"] == 0.0  # on-policy
    # vLLM samples from the policy the trainer scores: the gap is rounding only
    assert records[0]["rollout/logprob_gap_mean"] < 1e-3
    assert records[0]["actor/kl_ref"] == 0.0 and records[1]["actor/kl_ref"] != 0.0


# A verl reward file, unchanged; it fails the job unless verl's arguments reach it intact.
VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "arith" or extra_info["split"] not in ("train", "test"):
        raise ValueError(f"verl arguments lost: {data_source!r}, {extra_info!r}")
    return {"score": float(solution_str.strip() == ground_truth), "verl_rows": 1.0}
'''


def verl_parquet(src: str, dst: Path, split: str) -> str:
    """The rows of `src` in verl's layout: a chat prompt, the answer under reward_model."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in Path(src).read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist([
        {"data_source": row["data_source"], "ability": "math",
         "prompt": [{"role": "user", "content": row["prompt"]}],
         "reward_model": {"style": "rule", "ground_truth": row["ground_truth"]},
         "extra_info": {"split": split, "index": i}} for i, row in enumerate(rows)]), dst)
    return str(dst)


def test_verl_rows_and_reward_run_unchanged_with_sampled_validation(groups, tmp_path):
    assets = groups[1]
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    cfg = job_config(
        assets, tmp_path / "verl-run", algorithm=GRPO,
        reward={"functions": [{"path": f"{tmp_path / 'verl_reward.py'}:compute_score"}]},
        data={"train_files": [verl_parquet(assets["train"], tmp_path / "train.parquet", "train")],
              "val_files": [verl_parquet(assets["val"], tmp_path / "val.parquet", "test")],
              "ground_truth_key": "reward_model.ground_truth"},
        trainer={"total_steps": 3, "save_every": 0, "val_every": 3, "val_before_train": False,
                 "val_sampling": {"n": 4, "temperature": 1.0}})
    fit(groups, cfg)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["reward/compute_score/verl_rows"] == 1.0 for r in records)
    val = records[-1]
    assert val["val/accuracy"] == val["val/reward_mean@greedy"]
    passes = [val[f"val/pass@{k}"] for k in (1, 2, 4)]
    assert 0.0 <= passes[0] <= passes[1] <= passes[2] <= 1.0
    assert val["val/pass@1"] == pytest.approx(val["val/reward_mean@sampled"])  # 0/1 rewards


def test_a_step_with_cost_model_micro_batching(groups, tmp_path):
    """trainer.micro_batching=cost_model as `rlhf train` runs it: the job's cost model file
    loaded (fingerprints checked), every role's passes cut by it, the fallback metric logged."""
    from rlhf.data.cost_model import CostModelFile, PhaseCost, RoleCost, StageCost
    from rlhf.plan import profile as prof

    cfg = job_config(groups[1], tmp_path / "cost-run", algorithm=GRPO,
                     trainer={"total_steps": 1, "save_every": 0,
                              "micro_batching": "cost_model"})
    with pytest.raises(ValueError, match="run `rlhf profile"):
        prof.load_cost_models(cfg)
    stage = StageCost({"const": 1e-3, "tokens": 1e-5}, {"tokens": 1.0})
    phases = {ph: PhaseCost((stage,), {}) for ph in ("forward", "forward_backward")}
    CostModelFile({key: RoleCost(fp, phases) for key, (_, fp) in
                   prof.job_fingerprints(cfg).items()}).save(prof.cost_model_path(cfg))
    groups_, _, start = groups
    groups_.views["actor"].load_checkpoint(start)
    PPOTrainer(cfg, groups_.views, tokenizer=load_tokenizer(cfg.model.path), job_name="grpo-test",
               progress=False, cost_models=prof.load_cost_models(cfg)).fit()
    (record,) = read_metrics(cfg.trainer.output_dir)
    assert 0.0 <= record["plan/token_budget_fallback"] <= 1.0
    assert record["actor/pg_loss"] == record["actor/pg_loss"]  # finite, not NaN


# ---- seeing a run: its timeline, its sample tables, its report page in a browser ----------

LENGTH_REWARD = Path(__file__).resolve().parents[2] / "examples/rewards/pays_for_length.py"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync")


@pytest.fixture(scope="module")
def seen_run(groups, tmp_path_factory):
    """One traced step with a sample table, scored by the task's reward and the example that
    pays for length; its folder holds what `rlhf train` writes (config.yaml included)."""
    from rlhf.config import format_config

    out = tmp_path_factory.mktemp("seen") / "run"
    cfg = job_config(groups[1], out, algorithm=GRPO, reward={"functions": [
        {"path": "rlhf.rewards.arith:exact_match"},
        {"path": f"{LENGTH_REWARD}:length_bonus"}]},
        trainer={"total_steps": 1, "save_every": 0, "trace": "steps", "trace_steps": [1],
                 "samples_every": 1, "samples_rows": 4})
    out.mkdir()
    (out / "config.yaml").write_text(format_config(cfg))
    fit(groups, cfg)
    return out


def test_a_traced_step_has_every_rank_on_the_driver_clock(seen_run):
    trace = json.loads((seen_run / "trace" / "step_000001.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_process = {name: {e["name"] for e in spans if e["pid"] == pid}
                  for pid, name in names.items()}
    ranks = [n for n in names.values() if n != "driver"]
    assert len(ranks) == 2  # the two colocated ranks (actor+ref)
    assert {"step", "generate", "reward", "update_actor"} <= by_process["driver"]
    for rank in ranks:  # each rank's role methods, micro-batches and offload phases
        assert {"generate", "update_actor", "forward", "backward"} <= by_process[rank]
        assert any(n.startswith("offload:") for n in by_process[rank])
    clocks = trace["otherData"]["clocks"]
    assert all(clocks[r]["error_us"] < 1_000_000 for r in ranks)
    assert read_metrics(seen_run)[0]["timing/trace"] > 0  # what taking the spans cost
    # on the driver's clock, a rank's update_actor lies inside the driver's update_actor
    driver_pid = next(p for p, n in names.items() if n == "driver")
    (outer,) = [e for e in spans if e["pid"] == driver_pid and e["name"] == "update_actor"]
    for e in spans:
        if e["pid"] != driver_pid and e["name"] == "update_actor":
            slack = clocks[names[e["pid"]]]["error_us"]
            assert outer["ts"] - slack <= e["ts"]
            assert e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + slack


def test_the_sample_table_holds_the_worst_and_best_samples(seen_run):
    from rlhf.trainer.loggers import read_samples

    rows = read_samples(seen_run)
    assert [(r["step"], r["kind"]) for r in rows] == [(1, "worst")] * 2 + [(1, "best")] * 2
    for r in rows:
        assert {"prompt", "response", "advantage", "length", "truncated", "logprob_gap",
                "reward/exact_match", "reward/length_bonus"} <= set(r)
        assert r["reward"] == pytest.approx(r["reward/exact_match"] + r["reward/length_bonus"])
    assert min(r["reward"] for r in rows[2:]) >= max(r["reward"] for r in rows[:2])


def test_the_report_renders_in_chromium_without_script_errors(seen_run, tmp_path):
    """The page of the real run in headless Chromium: every section rendered, the script ran
    to its end, no error; the screenshot stays in tmp_path as the test's artifact."""
    import shutil
    import subprocess

    from rlhf.report import SECTIONS, write_report

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium here (Debian: apt-get install chromium; .ci/run installs it)")
    page = write_report(seen_run, out=seen_run / "report.html")
    browse = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browse, "--dump-dom", page.as_uri()], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert 'data-ready="1"' in dom  # the inline script ran to its last line
    assert '<div id="errors"></div>' in dom
    for section in SECTIONS:
        assert f'<section id="{section}">' in dom
    assert "length_bonus" in dom and 'id="timeline-step-1"' in dom
    assert "no plan" not in dom  # the memory section has the plan of the run's config
    shot = tmp_path / "report.png"
    subprocess.run([*browse, f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri()],
                   capture_output=True, timeout=60, check=True)
    assert shot.stat().st_size > 10_000
