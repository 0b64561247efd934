"""Batch and Ragged: every operation checked against per-sample python lists built alongside."""

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged

FAST = settings(max_examples=40, deadline=None)
lengths_st = st.lists(st.integers(0, 6), min_size=0, max_size=10)


def make(lengths, seed=0, meta=None):
    """A batch with every field kind, and the same data as a per-sample list of dicts."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        rows.append({
            "ids": torch.randint(0, 100, (n,), generator=g),
            "feat": torch.randn(n, 2, generator=g),
            "adv": torch.randn((), generator=g),
            "mat": torch.randint(0, 9, (3,), generator=g),
            "gt": f"answer-{seed}-{i}",
            "info": {"i": i, "tags": ["x"] * (i % 3)},
        })
    info = np.empty(len(rows), dtype=object)
    info[:] = [r["info"] for r in rows]
    no_feat = Ragged(torch.empty(0, 2), torch.zeros(1, dtype=torch.int64))
    fields = {
        "ids": Ragged.from_list([r["ids"] for r in rows], dtype=torch.int64),
        "feat": Ragged.from_list([r["feat"] for r in rows]) if rows else no_feat,
        "adv": torch.stack([r["adv"] for r in rows]) if rows else torch.empty(0),
        "mat": torch.stack([r["mat"] for r in rows]) if rows else torch.empty(0, 3).long(),
        "gt": [r["gt"] for r in rows],
        "info": info,
    }
    return Batch(fields, meta=meta if meta is not None else {"step": 3}), rows


def assert_rows(batch, rows):
    """Compare a batch with per-sample reference dicts (reads fields, not `batch[i]`)."""
    assert len(batch) == len(rows)
    ids, feat = batch["ids"].to_list(), batch["feat"].to_list()
    assert len(ids) == len(feat) == len(rows)
    for i, r in enumerate(rows):
        assert torch.equal(ids[i], r["ids"])
        assert torch.equal(feat[i], r["feat"])
        assert torch.equal(batch["adv"][i], r["adv"])
        assert torch.equal(batch["mat"][i], r["mat"])
        assert batch["gt"][i] == r["gt"]
        assert batch["info"][i] == r["info"]


# ---- Ragged ----


@FAST
@given(lengths=lengths_st, data=st.data())
def test_ragged_select_matches_loop(lengths, data):
    rows = [torch.arange(n) * 10 + i for i, n in enumerate(lengths)]
    r = Ragged.from_list(rows)
    assert r.lengths.tolist() == lengths and len(r) == len(lengths)
    assert all(torch.equal(a, b) for a, b in zip(r.to_list(), rows, strict=True))
    n = len(rows)
    idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=12)) if n else []
    got = r.select(idx).to_list()
    assert len(got) == len(idx)
    assert all(torch.equal(a, rows[i]) for a, i in zip(got, idx))


def test_ragged_getitem_concat_and_feature_dims():
    rows = [torch.ones(2, 3), torch.zeros(0, 3), torch.full((1, 3), 7.0)]
    r = Ragged.from_list(rows)
    assert torch.equal(r[2], rows[2]) and torch.equal(r[-3], rows[0]) and r[1].shape == (0, 3)
    with pytest.raises(IndexError, match="out of range"):
        r[3]
    with pytest.raises(TypeError, match="select"):
        r[0:2]
    both = Ragged.concat([r, r.select([0])])
    assert both.offsets.tolist() == [0, 2, 2, 3, 5]
    assert torch.equal(both[3], rows[0])
    assert both.equal(Ragged.from_list(rows + rows[:1]))
    assert not both.equal(r)
    assert Ragged.from_list([]).to_list() == [] and Ragged.from_list([]).dtype == torch.int64


@pytest.mark.parametrize(
    "values, offsets, match",
    [
        (torch.zeros(3), torch.tensor([0.0, 3.0]), "int64"),
        (torch.zeros(3), torch.tensor([[0, 3]]), "1-D"),
        (torch.zeros(3), torch.tensor([], dtype=torch.int64), "length B\\+1"),
        (torch.zeros(3), torch.tensor([1, 3]), "start at 0"),
        (torch.zeros(3), torch.tensor([0, 2, 1, 3]), "non-decreasing.*offsets\\[2\\] = 1"),
        (torch.zeros(3), torch.tensor([0, 2]), "end at 2 but values has 3"),
        (torch.tensor(1.0), torch.tensor([0]), "total, \\*feature_dims"),
        ([1, 2], torch.tensor([0, 2]), "tensor"),
    ],
)
def test_ragged_validation(values, offsets, match):
    with pytest.raises(ValueError, match=match):
        Ragged(values, offsets)


def test_ragged_from_list_rejects_mixed_rows():
    with pytest.raises(ValueError, match="row 1 is .*int32.*row 0 is .*int64"):
        Ragged.from_list([torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)])
    with pytest.raises(ValueError, match="trailing dims"):
        Ragged.from_list([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="part 1"):
        Ragged.concat([Ragged.from_list([torch.zeros(2)]), Ragged.from_list([[0, 0]])])
    assert Ragged.from_list([[1, 2], [3]], dtype=torch.int32).dtype == torch.int32
    # An empty python row takes the dtype of the other rows instead of float32.
    assert Ragged.from_list([[], torch.tensor([1], dtype=torch.int16)]).dtype == torch.int16
    assert Ragged.from_list([[], [1], []]).dtype == torch.int64


# ---- Batch: split / chunk / concat / select ----


@FAST
@given(lengths=lengths_st, data=st.data())
def test_split_concat_roundtrip(lengths, data):
    batch, rows = make(lengths)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(rows)), max_size=4)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(rows)])]
    pieces = batch.split(sizes)
    assert [len(p) for p in pieces] == sizes
    start = 0
    for piece, size in zip(pieces, sizes):
        assert_rows(piece, rows[start : start + size])
        assert piece.meta == {"step": 3}
        start += size
    assert Batch.concat(pieces).equal(batch)


@FAST
@given(lengths=lengths_st, n=st.integers(1, 13))
def test_chunk_even_and_roundtrip(lengths, n):
    batch, rows = make(lengths)
    chunks = batch.chunk(n)
    sizes = [len(c) for c in chunks]
    assert len(chunks) == n and sum(sizes) == len(rows)
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert Batch.concat(chunks).equal(batch)
    assert_rows(Batch.concat(chunks), rows)


def test_chunk_and_split_errors():
    batch, _ = make([1, 2, 3])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive"):
            batch.chunk(bad)
    with pytest.raises(ValueError, match="sum to the batch length 3"):
        batch.split([1, 1])
    with pytest.raises(ValueError, match="non-negative"):
        batch.split([4, -1])


@FAST
@given(lengths=lengths_st, data=st.data())
def test_select_with_repeats_matches_loop(lengths, data):
    batch, rows = make(lengths)
    n = len(rows)
    idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=15)) if n else []
    assert_rows(batch.select(idx), [rows[i] for i in idx])
    assert_rows(batch.select(torch.tensor(idx, dtype=torch.int64)), [rows[i] for i in idx])


@FAST
@given(lengths=lengths_st, repeats=st.integers(1, 4))
def test_repeat_interleave_matches_loop(lengths, repeats):
    batch, rows = make(lengths)
    expected = [r for r in rows for _ in range(repeats)]
    assert_rows(batch.repeat_interleave(repeats), expected)


def test_repeat_interleave_rejects_non_positive():
    batch, _ = make([1])
    with pytest.raises(ValueError, match="positive int"):
        batch.repeat_interleave(0)


def test_operations_do_not_mutate_inputs():
    batch, rows = make([2, 0, 3, 1], meta={"step": 3, "cfg": {"t": 1.0}})
    snapshot = copy.deepcopy(batch)
    other = Batch({"extra": torch.arange(4)}, meta={"more": 1})
    results = [
        batch.select([3, 3, 0]), batch.split([1, 3]), batch.chunk(3), batch.repeat_interleave(2),
        batch.union(other), batch.pop(["ids"]), batch[1:3], batch[::2], batch.to("cpu"),
        batch.with_meta(step=3, x=2), Batch.concat([batch, batch]),
    ]
    assert results and batch.equal(snapshot)
    assert other.equal(Batch({"extra": torch.arange(4)}, meta={"more": 1}))
    assert_rows(batch, rows)
    assert batch.keys() == ["ids", "feat", "adv", "mat", "gt", "info"]


# ---- __getitem__ ----


def test_getitem_variants():
    batch, rows = make([2, 0, 3, 1, 4])
    assert batch["gt"] == [r["gt"] for r in rows]
    with pytest.raises(KeyError, match="no field 'nope'.*'ids'"):
        batch["nope"]
    sample = batch[1]
    assert sorted(sample) == sorted(rows[1])
    assert torch.equal(sample["ids"], rows[1]["ids"]) and sample["gt"] == rows[1]["gt"]
    assert sample["info"] == rows[1]["info"] and torch.equal(sample["feat"], rows[1]["feat"])
    assert torch.equal(batch[-1]["mat"], rows[-1]["mat"])
    assert batch[np.int64(2)]["gt"] == rows[2]["gt"]
    assert batch[torch.tensor(0)]["gt"] == rows[0]["gt"]
    for bad in (5, -6):
        with pytest.raises(IndexError, match="out of range"):
            batch[bad]
    assert_rows(batch[1:4], rows[1:4])
    assert_rows(batch[4:1], [])
    assert_rows(batch[::-2], rows[::-2])
    assert_rows(batch[[4, 0, 0]], [rows[4], rows[0], rows[0]])
    assert_rows(batch[np.array([2, -1])], [rows[2], rows[-1]])
    assert_rows(batch[torch.tensor([3, 1])], [rows[3], rows[1]])
    mask = [True, False, False, True, True]
    assert_rows(batch[torch.tensor(mask)], [r for r, m in zip(rows, mask) if m])
    assert_rows(batch[np.array(mask)], [r for r, m in zip(rows, mask) if m])
    with pytest.raises(IndexError, match="mask has shape"):
        batch[torch.tensor([True, False])]
    with pytest.raises(IndexError, match="out of range"):
        batch[[0, 5]]
    with pytest.raises(IndexError, match="ints"):
        batch[[0.5, 1.0]]


# ---- construction, union, concat, meta, pop ----


def test_mismatched_lengths_error_names_the_field():
    with pytest.raises(ValueError, match="field 'rewards' has 2 samples but the batch has 3"):
        Batch({"ids": Ragged.from_list([[1], [2], [3]]), "gt": list("abc"), "rewards": [0.0, 1.0]})
    with pytest.raises(ValueError, match="field 'gt' has 2 samples but the batch has 4"):
        Batch({"gt": ["a", "b"]}, size=4)
    with pytest.raises(ValueError, match="field 'lr'.*meta"):
        Batch({"lr": 0.1})
    with pytest.raises(ValueError, match="field 'scale'.*no dims"):
        Batch({"scale": torch.tensor(2.0)})


def test_union_adds_fields_and_rejects_conflicts():
    batch, rows = make([1, 2, 0])
    rewards = torch.tensor([1.0, 0.0, 0.5])
    scored = Batch({"rewards": rewards, "gt": list(batch["gt"])}, meta={"step": 3, "kl": 0.1})
    joined = batch.union(scored)
    assert joined.keys() == batch.keys() + ["rewards"]
    assert torch.equal(joined["rewards"], rewards) and dict(joined.meta) == {"step": 3, "kl": 0.1}
    assert_rows(joined, rows)
    with pytest.raises(ValueError, match="field 'gt' is in both batches with different values"):
        batch.union(Batch({"gt": ["x", "y", "z"]}))
    with pytest.raises(ValueError, match="field 'ids' is in both"):
        batch.union(Batch({"ids": Ragged.from_list([[0], [1, 2], []])}))
    with pytest.raises(ValueError, match="field 'adv' is in both"):
        batch.union(Batch({"adv": batch["adv"].double()}))
    with pytest.raises(ValueError, match="lengths differ \\(3 vs 2\\)"):
        batch.union(Batch({"rewards": torch.zeros(2)}))
    with pytest.raises(ValueError, match="meta key 'step'"):
        batch.union(Batch({"r": torch.zeros(3)}, meta={"step": 4}))


def test_concat_checks_fields_and_meta():
    a, rows_a = make([1, 2], seed=1, meta={"step": 3, "temp": torch.tensor([1.0])})
    b, rows_b = make([0, 4, 1], seed=2, meta={"step": 3, "temp": torch.tensor([1.0]), "extra": "x"})
    both = Batch.concat([a, b])
    assert_rows(both, rows_a + rows_b)
    assert sorted(both.meta) == ["extra", "step", "temp"]
    with pytest.raises(ValueError, match="meta key 'step' has conflicting values 3 and 4"):
        Batch.concat([a, b.with_meta(step=4)])
    _, b_less = b.pop("gt")
    with pytest.raises(ValueError, match="batch 1 lacks fields \\['gt'\\]"):
        Batch.concat([a, b_less])
    with pytest.raises(ValueError, match="field 'adv'.*dtype"):
        Batch.concat([Batch({"adv": torch.zeros(2)}), Batch({"adv": torch.zeros(3).double()})])
    with pytest.raises(ValueError, match="field 'gt' is a list in some batches and a ndarray"):
        Batch.concat([Batch({"gt": ["a"]}), Batch({"gt": np.array(["b"])})])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


def test_pop_splits_fields_without_mutating():
    batch, rows = make([3, 1])
    taken, rest = batch.pop(["ids", "gt"])
    assert taken.keys() == ["ids", "gt"] and rest.keys() == ["feat", "adv", "mat", "info"]
    assert len(taken) == len(rest) == 2 and taken.meta == rest.meta == {"step": 3}
    assert taken.union(rest).pop(batch.keys())[0].equal(batch)
    assert len(batch.keys()) == 6
    with pytest.raises(KeyError, match="no field 'missing'"):
        batch.pop(["missing"])
    empty, _ = batch.pop([])
    assert len(empty) == 2 and empty.keys() == [] and [len(c) for c in empty.chunk(2)] == [1, 1]


def test_meta_is_read_only_and_with_meta_copies():
    batch, _ = make([1])
    with pytest.raises(TypeError):
        batch.meta["step"] = 9
    updated = batch.with_meta(step=9)
    assert updated.meta["step"] == 9 and batch.meta["step"] == 3


def test_to_and_repr():
    batch, rows = make([2, 5])
    moved = batch.to("cpu")
    assert_rows(moved, rows)
    text = repr(batch)
    for piece in ("len=2", "ids: Ragged(total=7", "feat: Ragged(total=7, feature_dims=(2,))",
                  "adv: Tensor(2,) torch.float32", "mat: Tensor(2, 3) torch.int64", "gt: list",
                  "info: ndarray object", "meta=['step']"):
        assert piece in text


# ---- pickling: what crosses the Ray object store ----


def _tensor_bytes(batch):
    total = 0
    for name in batch.keys():
        v = batch[name]
        tensors = (v.values, v.offsets) if isinstance(v, Ragged) else (v,)
        for t in tensors if isinstance(v, (Ragged, torch.Tensor)) else ():
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("num_samples", [1, 256])
def test_pickle_size_is_raw_bytes_plus_small_constant(num_samples):
    batch, _ = make([(i * 7) % 50 for i in range(num_samples)])
    blob = pickle.dumps(batch)
    assert pickle.loads(blob).equal(batch)
    payload = len(pickle.dumps((batch["gt"], batch["info"], dict(batch.meta))))
    # 6 tensors (2 Ragged x 2 + 2 dense); per-sample tensor objects would cost ~300 bytes each.
    assert len(blob) <= _tensor_bytes(batch) + payload + 6 * 600 + 1024


def test_pickled_chunk_carries_only_its_own_bytes():
    batch, _ = make([40] * 256)
    chunk = batch.chunk(8)[3]
    ids = chunk["ids"].values
    assert ids.untyped_storage().nbytes() > ids.numel() * ids.element_size()  # a view
    blob = pickle.dumps(chunk)
    payload = len(pickle.dumps((chunk["gt"], chunk["info"], dict(chunk.meta))))
    assert len(blob) <= _tensor_bytes(chunk) + payload + 6 * 600 + 1024
    restored = pickle.loads(blob)
    assert restored.equal(chunk) and restored.equal(batch[96:128])
