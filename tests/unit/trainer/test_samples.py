"""The sample table: the step's worst and best rewarded samples, with per-sample figures."""

import pytest
import torch

from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.trainer.samples import FUNCTION_SCORE, chosen_rows, sample_table


def test_chosen_rows_are_the_lowest_then_the_highest_each_once():
    scores = torch.tensor([0.5, -1.0, 2.0, 0.0, 2.0])
    assert chosen_rows(scores, 4) == [(1, "worst"), (3, "worst"), (4, "best"), (2, "best")]
    assert chosen_rows(scores, 3) == [(1, "worst"), (4, "best"), (2, "best")]
    # more rows than samples: every sample once
    assert sorted(i for i, _ in chosen_rows(scores[:2], 8)) == [0, 1]


def test_sample_table_rows_carry_the_figures_of_their_sample():
    responses = [[5, 6], [7], [8, 9, 10]]
    batch = Batch({
        "raw_prompt": ["a", "b", "c"],
        "response_ids": Ragged.from_list(responses),
        "advantages": Ragged.from_list([[1.0, 3.0], [-2.0], [0.5, 0.5, 0.5]]),
        "old_log_probs": Ragged.from_list([[-1.0, -1.0], [-2.0], [-1.0, -1.0, -1.0]]),
        "rollout_log_probs": Ragged.from_list([[-1.5, -0.5], [-2.0], [-1.0, -1.3, -1.0]]),
        FUNCTION_SCORE + "exact": torch.tensor([1.0, 0.0, 0.0]),
        FUNCTION_SCORE + "length": torch.tensor([0.2, 0.1, 0.3]),
        "env_reward": torch.tensor([0.0, 0.0, 0.5]),
    })
    scores = torch.tensor([1.2, 0.1, 0.3])
    decoded = []

    def decode(rows: Batch) -> list[str]:
        decoded.append(len(rows))
        return [" ".join(map(str, r.tolist())) for r in rows["response_ids"].to_list()]

    rows = sample_table(batch, scores, decode, truncated_N=torch.tensor([False, False, True]),
                        rows=2)
    assert decoded == [2]  # only the chosen samples are decoded
    worst, best = rows
    assert worst == {"index": 1, "kind": "worst", "prompt": "b", "response": "7", "reward":
                     pytest.approx(0.1), "reward/exact": 0.0, "reward/length": pytest.approx(0.1),
                     "reward/env": 0.0, "advantage": -2.0, "length": 1, "truncated": False,
                     "logprob_gap": 0.0}
    assert best["index"] == 0 and best["response"] == "5 6" and best["advantage"] == 2.0
    assert best["logprob_gap"] == pytest.approx(0.5)
    assert best["reward/exact"] == 1.0 and best["length"] == 2
