"""The cp ranks of a dp replica share its packs: a DP call hands them the same rows, and the
driver collects each replica's result once (from cp rank 0 of the last stage)."""

import torch

import rlhf.controller.dispatch as dispatch
from rlhf.controller.dispatch import Dispatch, collect, route_call
from rlhf.data.batch import Batch
from rlhf.parallel.layout import Layout


def test_cp_ranks_of_a_replica_receive_the_same_rows(monkeypatch):
    monkeypatch.setattr(dispatch.ray, "put", lambda value: value)  # no object store needed
    # dp=2 cp=2 tp=2 over 8 ranks: tp fastest, then cp; ranks 0-3 are dp 0, 4-7 dp 1
    layout = Layout(dp=2, cp=2, tp=2)
    batch = Batch({"id": torch.arange(6)})
    routing = route_call(Dispatch.DP_COMPUTE, layout, (batch,), {})
    rows = [call[0][0]["id"].tolist() for call in routing.args if call is not None]
    assert rows == [[0, 1, 2]] * 4 + [[3, 4, 5]] * 4
    assert routing.keep == [True, False, False, False, True, False, False, False]
    results = {r: Batch({"id": torch.tensor(rows[r]) * 10}) for r in range(8) if routing.keep[r]}
    assert collect(Dispatch.DP_COMPUTE, layout, routing, results)["id"].tolist() == [
        0, 10, 20, 30, 40, 50]
