"""`aggregate`: the four loss_agg_modes by hand and by loop, and micro-batch decomposition."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algorithms import aggregate, loss_normalizers, ppo_policy_loss

FAST = settings(max_examples=40, deadline=None)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
MAX_LEN = 6
D = torch.float64
nan = float("nan")


def t(xs, dtype=D):
    return torch.tensor(xs, dtype=dtype)


# Sample 0: [1, 2]; sample 1 empty; sample 2: [3, (4 masked), 5]; sample 3: [(6 masked)].
# Only samples 0 and 2 have valid tokens; the masked ones hold NaN to show they cannot leak.
LOSS = t([1, 2, 3, nan, 5, nan])
MASK = t([1, 1, 1, 0, 1, 0], torch.bool)
CU = t([0, 2, 2, 5, 6], torch.int32)


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("token-mean", {}, (1 + 2 + 3 + 5) / 4),
    ("token-mean", {"global_tokens": 8}, 11 / 8),
    ("seq-mean-token-sum", {}, ((1 + 2) + (3 + 5)) / 2),
    ("seq-mean-token-sum", {"global_seqs": 4}, 11 / 4),
    ("seq-mean-token-mean", {}, ((1 + 2) / 2 + (3 + 5) / 2) / 2),
    ("seq-mean-token-sum-norm", {"max_response_length": 4}, (3 / 4 + 8 / 4) / 2),
    ("seq-mean-token-sum-norm", {"max_response_length": 4, "global_seqs": 5}, (3 / 4 + 2) / 5),
])
def test_aggregate_hand_values(mode, kwargs, expected):
    got = aggregate(LOSS, MASK, CU, mode, **kwargs)
    assert got.dim() == 0
    torch.testing.assert_close(got, t(expected))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cu, loss", [([0, 2, 2], [nan, 1.0]), ([0], []), ([0, 0, 0], [])])
def test_aggregate_without_valid_tokens_is_zero_not_nan(mode, cu, loss):
    mask = torch.zeros(len(loss), dtype=torch.bool)
    got = aggregate(t(loss), mask, t(cu, torch.int64), mode, max_response_length=MAX_LEN)
    assert got.item() == 0.0


def test_aggregate_gradient_skips_masked_tokens():
    x = t([1, 2, 3, 4, 5, 6]).requires_grad_(True)
    aggregate(x, MASK, CU, "seq-mean-token-mean").backward()
    # two valid sequences: d/dx = 1 / (2 sequences * tokens of its sequence)
    torch.testing.assert_close(x.grad, t([1 / 4, 1 / 4, 1 / 4, 0, 1 / 4, 0]))


def test_aggregate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate(LOSS, MASK, CU, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(LOSS, MASK, CU, "token-sum")
    with pytest.raises(ValueError, match="global_tokens"):
        aggregate(LOSS, MASK, CU, "token-mean", global_tokens=0)
    with pytest.raises(ValueError, match="mask_T"):
        aggregate(LOSS, MASK[:3], CU, "token-mean")


def ref_aggregate(rows, mode, max_len):
    """rows: per-sample lists of (loss, valid) pairs."""
    kept = [[x for x, m in r if m] for r in rows]
    seqs = [k for k in kept if k]
    if mode == "token-mean":
        n = sum(len(k) for k in kept)
        return sum(sum(k) for k in kept) / n if n else 0.0
    per_seq = {"seq-mean-token-sum": lambda k: sum(k),
               "seq-mean-token-mean": lambda k: sum(k) / len(k),
               "seq-mean-token-sum-norm": lambda k: sum(k) / max_len}[mode]
    return sum(per_seq(k) for k in seqs) / len(seqs) if seqs else 0.0


@FAST
@given(lengths=st.lists(st.integers(0, MAX_LEN), max_size=9), seed=st.integers(0, 2**20),
       mode=st.sampled_from(MODES))
def test_aggregate_matches_loop(batch_factory, lengths, seed, mode):
    b = batch_factory(lengths, seed, mask_p=0.4)
    rows = [list(zip(r["reward"], r["mask"])) for r in b["rows"]]
    got = aggregate(b["stream"]("reward"), b["mask_T"], b["cu_seqlens"], mode,
                    max_response_length=MAX_LEN)
    torch.testing.assert_close(got, t(ref_aggregate(rows, mode, MAX_LEN)))


def split_batch(b, parts):
    """Sub-streams (loss, adv, logp, old_logp, mask, cu_seqlens) for each part of sample ids."""
    out = []
    for ids in parts:
        rows = [b["rows"][i] for i in ids]
        cu = [0]
        for r in rows:
            cu.append(cu[-1] + len(r["mask"]))

        def stream(key, dtype=D, rows=rows):
            return torch.tensor([x for r in rows for x in r[key]], dtype=dtype)
        out.append({"stream": stream, "mask_T": stream("mask", torch.bool),
                    "cu_seqlens": torch.tensor(cu, dtype=torch.int32)})
    return out


@FAST
@given(lengths=st.lists(st.integers(0, MAX_LEN), min_size=1, max_size=9),
       seed=st.integers(0, 2**20), mode=st.sampled_from(MODES), parts=st.integers(1, 4))
def test_micro_batches_sum_to_the_full_batch_loss(batch_factory, lengths, seed, mode, parts):
    b = batch_factory(lengths, seed, mask_p=0.4)
    ids = list(range(len(lengths)))
    random.Random(seed).shuffle(ids)  # micro-batches need not be contiguous in the mini-batch
    micro = split_batch(b, [ids[k::parts] for k in range(parts)])
    counts = [loss_normalizers(m["mask_T"], m["cu_seqlens"]) for m in micro]
    # The global counts are those of the whole mini-batch (summed over DP ranks in training).
    tokens, seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    assert (tokens, seqs) == loss_normalizers(b["mask_T"], b["cu_seqlens"])
    norm = dict(global_tokens=max(tokens, 1), global_seqs=max(seqs, 1),
                max_response_length=MAX_LEN)
    full = aggregate(b["stream"]("reward"), b["mask_T"], b["cu_seqlens"], mode, **norm)
    summed = sum(aggregate(m["stream"]("reward"), m["mask_T"], m["cu_seqlens"], mode, **norm)
                 for m in micro)
    torch.testing.assert_close(summed, full)

    # Same for the policy loss, including the gradient accumulated over micro-batches.
    def policy(s, logp):
        loss, _ = ppo_policy_loss(logp, s["stream"]("old_logp"), s["stream"]("adv"),
                                  s["mask_T"], s["cu_seqlens"], clip_low=0.2, clip_high=0.3,
                                  clip_c=3.0, agg_mode=mode, **norm)
        return loss

    full_logp = b["stream"]("logp").requires_grad_(True)
    full = policy(b, full_logp)
    full.backward()
    grads, summed = {}, 0.0
    for k, m in enumerate(micro):
        logp = m["stream"]("logp").requires_grad_(True)
        loss = policy(m, logp)
        loss.backward()
        summed = summed + loss.detach()
        for i, g in zip(ids[k::parts], torch.split(logp.grad, [len(b["rows"][i]["mask"])
                                                               for i in ids[k::parts]])):
            grads[i] = g
    torch.testing.assert_close(summed, full.detach())
    if full_logp.numel():
        torch.testing.assert_close(torch.cat([grads[i] for i in range(len(lengths))]),
                                   full_logp.grad)
