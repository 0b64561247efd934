"""MoE routes as a Batch field: the experts each position of a sample was routed to, how they
enter a packed micro-batch stream, how a stream's recorded routes become a field again, and how
well two routings agree.

    routed_experts   Ragged int16, per sample, one row per position of prompt + response
                     (entry j: the input token at position j), values (num_layers, top_k);
                     -1 marks "route freely" (a position the recorder never saw, a dense layer)

A packed stream (rlhf.data.packing.pack_prompt_response) holds each sample's last
prompt_lens[i] + response_lens[i] positions (a row that shares its prompt with the row before
keeps only the prompt's last token), so a sample's routes enter the stream as their last that
many rows, and leave it the same way, the dropped shared-prompt positions reading -1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.data.packing import PackedSequences
from rlhf.data.ragged import Ragged

ROUTES = "routed_experts"
"""Per-position Batch field of MoE routes (see the module docstring)."""
FREE = -1
"""A route entry that forces nothing: the model routes that (position, layer) itself."""


def routes_to_stream(routes: Ragged, packed: PackedSequences) -> Tensor:
    """(T, num_layers, top_k) int64 routes of `packed`'s stream from the per-sample `routes`
    of the same rows; ValueError when a row has fewer positions than the stream holds of it."""
    seq_lens = (packed.prompt_lens + packed.response_lens).tolist()
    rows = routes.to_list()
    if len(rows) != len(seq_lens):
        raise ValueError(f"{len(rows)} rows of routes for {len(seq_lens)} packed sequences")
    parts = []
    for i, (row, n) in enumerate(zip(rows, seq_lens)):
        if row.shape[0] < n:
            raise ValueError(f"{ROUTES} row {i} has {row.shape[0]} positions but its sequence "
                             f"holds {n}; record routes over prompt + response positions")
        parts.append(row[row.shape[0] - n:])
    return torch.cat(parts).to(torch.int64)


def stream_to_routes(stream_TLK: Tensor, packed: PackedSequences, full_lens: Tensor) -> Ragged:
    """Per-sample routes (`full_lens[i]` positions each: prompt + response) from a stream's
    recorded (T, num_layers, top_k) routes; positions the stream did not hold read FREE."""
    seq_lens = packed.prompt_lens + packed.response_lens
    rows = []
    for part, full in zip(stream_TLK.split(seq_lens.tolist()), full_lens.tolist()):
        row = part.new_full((full, *part.shape[1:]), FREE)
        row[full - part.shape[0]:] = part
        rows.append(row.to(torch.int16))
    return Ragged.from_list(rows, dtype=torch.int16)


def routing_agreement(recorded: Ragged, chosen: Ragged) -> dict[str, float]:
    """How often `chosen` routes (what a model picked itself) equal `recorded` ones, over the
    (position, layer) pairs `recorded` knows: token_match, the share of positions that agree
    in every such layer; layer_match, the share of pairs. Order within top-k does not count."""
    a, b = recorded.values.to(torch.int64), chosen.values.to(torch.int64)
    if a.shape != b.shape or not torch.equal(recorded.offsets, chosen.offsets):
        raise ValueError(f"routes of shape {tuple(a.shape)} and {tuple(b.shape)} do not align")
    a, b = a.sort(-1).values, b.sort(-1).values  # (N, L, K)
    known_NL = (a >= 0).all(-1)
    same_NL = (a == b).all(-1)
    counted_N = known_NL.any(-1)
    tokens, pairs = int(counted_N.sum()), int(known_NL.sum())
    return {"tokens": float(tokens),
            "token_match": float(((same_NL | ~known_NL).all(-1) & counted_N).sum()) / max(tokens, 1),
            "layer_match": float((same_NL & known_NL).sum()) / max(pairs, 1)}
