"""Dynamic sampling's fill loop with a fake generator: groups dropped and refilled, surplus
truncated, a short batch topped up when the rounds run out, per-round seeds, and a loader
position that a resumed run continues from exactly."""

from types import SimpleNamespace

import torch

from rlhf.config import AlgorithmConfig, DataConfig, RolloutConfig
from rlhf.data.batch import Batch
from rlhf.data.dataset import PromptLoader
from rlhf.trainer.recipes import fill_batch, round_seed

N = 2  # responses per prompt


class Prompts:
    """A dataset of `size` prompts whose rows hold only their index."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def batch(self, indices):
        return Batch({"pid": indices.clone()})


def cfg_of(mode="all_equal", rounds=3, batch=2, std=0.0):
    return SimpleNamespace(
        algorithm=AlgorithmConfig(adv_estimator="grpo", dynamic_sampling=mode,
                                  dynamic_sampling_std=std, max_sampling_rounds=rounds),
        rollout=RolloutConfig(n=N), data=DataConfig(train_files=("x",), train_batch_size=batch))


def fake_sample(useful, seeds):
    """Prompts whose index is in `useful` get scores (1, 0), the others (1, 1)."""
    def sample(prompts):
        seeds.append(prompts.meta["seed"])
        samples = prompts.repeat_interleave(N)
        scores = torch.tensor([float(i % 2 == 0 or int(p) not in useful)
                               for i, p in enumerate(samples["pid"])])
        return samples, scores, {"reward/mean": float(scores.mean())}
    return sample


def run(loader, cfg, useful, seeds, base_seed=7):
    draw = lambda r: next(loader).with_meta(seed=round_seed(base_seed, r))  # noqa: E731
    return fill_batch(draw, fake_sample(useful, seeds), cfg)


def test_groups_without_spread_are_refilled_and_the_surplus_truncated():
    loader = PromptLoader(Prompts(20), batch_size=2, shuffle=False)
    seeds = []
    # round 1: prompts 0, 1 (only 1 useful); round 2: prompts 2, 3 (both useful): 3 kept, 2 used
    batch, scores, metrics = run(loader, cfg_of(), useful={1, 2, 3}, seeds=seeds)
    assert batch["pid"].tolist() == [1, 1, 2, 2]
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics["ds/groups_dropped"] == 1 and metrics["ds/rounds"] == 2
    assert metrics["ds/prompts_consumed"] == 4 and metrics["ds/batch_groups"] == 2
    assert metrics["reward/mean"] == 0.75  # round 1's: scores 1, 1, 0, 1
    assert seeds == [7, round_seed(7, 1)] and seeds[1] != 7
    assert loader.position == 2  # both rounds' batches consumed


def test_rounds_run_out_and_the_batch_is_topped_up_with_dropped_groups():
    loader = PromptLoader(Prompts(20), batch_size=2, shuffle=False)
    batch, _, metrics = run(loader, cfg_of(rounds=2), useful={3}, seeds=[])
    # kept: prompt 3 only; topped up with the first dropped group, prompt 0
    assert batch["pid"].tolist() == [3, 3, 0, 0]
    assert metrics["ds/batch_groups"] == 1 and metrics["ds/rounds"] == 2
    assert metrics["ds/groups_dropped"] == 3


def test_off_is_one_unfiltered_round_with_the_step_seed():
    loader = PromptLoader(Prompts(20), batch_size=2, shuffle=False)
    seeds = []
    batch, _, metrics = run(loader, cfg_of(mode="off"), useful=set(), seeds=seeds)
    assert batch["pid"].tolist() == [0, 0, 1, 1]
    assert seeds == [7] and not any(k.startswith("ds/") for k in metrics)


def test_std_below_keeps_groups_with_enough_spread():
    loader = PromptLoader(Prompts(20), batch_size=2, shuffle=False)
    # (1, 0) has unbiased std 0.707
    batch, _, _ = run(loader, cfg_of(mode="std_below", std=0.5), useful={0, 1}, seeds=[])
    assert batch["pid"].tolist() == [0, 0, 1, 1]


def test_a_resumed_loader_draws_the_same_prompts():
    useful = {3, 4, 8, 9, 13}
    straight = PromptLoader(Prompts(20), batch_size=2, shuffle=True, seed=3)
    first = run(straight, cfg_of(), useful, [])[0]["pid"].tolist()
    second = run(straight, cfg_of(), useful, [], base_seed=8)[0]["pid"].tolist()

    before = PromptLoader(Prompts(20), batch_size=2, shuffle=True, seed=3)
    assert run(before, cfg_of(), useful, [])[0]["pid"].tolist() == first
    resumed = PromptLoader(Prompts(20), batch_size=2, shuffle=True, seed=3)
    resumed.load_state_dict(before.state_dict())
    assert run(resumed, cfg_of(), useful, [], base_seed=8)[0]["pid"].tolist() == second
    assert resumed.state_dict() == straight.state_dict()


def test_round_seeds_differ_per_round_and_step():
    seeds = {round_seed(s, r) for s in (7, 8) for r in range(4)}
    assert len(seeds) == 8 and round_seed(7, 0) == 7
    assert all(0 <= s < 2**31 for s in seeds)


def test_a_group_filter_from_a_file_named_in_the_config_picks_the_groups(tmp_path):
    (tmp_path / "my_filter.py").write_text(
        "def keep_odd_prompts(scores_N, group_size, *, std_threshold=0.0):\n"
        "    import torch\n"
        "    return torch.arange(scores_N.numel() // group_size) % 2 == 1\n")
    loader = PromptLoader(Prompts(20), batch_size=2, shuffle=False)
    cfg = cfg_of(mode=f"{tmp_path / 'my_filter.py'}:keep_odd_prompts")
    # every group has a spread, but the file's filter keeps only the second of each round
    batch, _, metrics = run(loader, cfg, useful=set(range(20)), seeds=[])
    assert batch["pid"].tolist() == [1, 1, 3, 3]
    assert metrics["ds/groups_dropped"] == 2 and metrics["ds/rounds"] == 2
