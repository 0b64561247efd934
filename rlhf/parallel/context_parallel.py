"""Context parallelism: one packed micro-batch's tokens split over the cp ranks of a group.

Which tokens a rank holds (`plan_context_shard`, pure host arithmetic): every sequence of the
pack is padded at its end to a multiple of 2 * cp and cut into 2 * cp equal chunks; cp rank r
holds chunks r and 2 * cp - 1 - r of every sequence, so under causal attention each rank does
the same work (an early chunk sees few keys, its mirror many). Short sequences are split the
same way: the padding is at most 2 * cp - 1 tokens per sequence, every rank's linear layers
see the same token count, and the plan stays one rule; the pad sits after the sequence's last
token, where no real query can see it, so the result is exact.

Attention on a shard: each rank's keys and values are all-gathered over the cp group
(`gather_keys_values`; its backward reduce-scatters the grads of the keys other ranks used).
Gathering keys, unlike Ulysses' all-to-all over heads, works for any number of KV heads, so
cp may exceed them (GQA with 2 or 4 KV heads). Each local chunk is then a query run whose keys
are the first (chunk + 1) * chunk_len tokens of its sequence, causal aligned to the bottom
right: `ContextShard.key_rows` says where those keys sit in the gathered stream.

Shared prompts (rlhf.data.packing.SharedPrefix): a later sample of a prompt holds only the
prompt's last token and reads the rest from the first sample's tokens. After the gather every
rank holds every key, so each of its query runs' keys are those prefix tokens' gathered rows,
then its own sequence's as above; the bottom-right causal alignment lets every query see the
whole prefix. Its position ids continue from the prompt, as packing numbers them.

Labels are shifted on the whole stream before it is sharded (a chunk's last position predicts
a token that another rank holds): shard `shifted_targets` with `shard_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from rlhf.parallel.collectives import gather_from_sequence, group_size


@dataclass(frozen=True)
class ContextShard:
    """One cp rank's share of a packed stream of T tokens, as host bounds and CPU index rows.

    The local stream is, per sequence, chunk r then chunk 2cp-1-r, then (when the stream must
    be a multiple of `multiple` tokens, for sequence parallelism) a tail of pad tokens that
    attends only to itself. Its query runs are `query_bounds`; run j's keys are rows
    `key_rows[key_bounds[j]:key_bounds[j + 1]]` of the gathered stream (every rank's local
    stream, in cp-rank order; a shared prompt's rows first), causal aligned to the bottom right.
    """

    cp: int
    rank: int
    source: Tensor  # (T_local,) int64: the stream token each local row holds, -1 on padding
    positions: Tensor  # (T_local,) int64: position ids, the packing's (padding continues them)
    query_bounds: tuple[int, ...]  # (runs + 1,) bounds of the local query runs
    key_rows: Tensor  # (K,) int64 rows of the gathered stream: every run's keys in turn
    key_bounds: tuple[int, ...]  # (runs + 1,) bounds of each run's keys in key_rows
    token_rows: Tensor  # (T,) int64: the gathered-stream row of every stream token

    @property
    def num_local(self) -> int:
        return int(self.source.shape[0])

    @property
    def holds_token(self) -> Tensor:
        """(T_local,) bool: the local rows holding a stream token (False on padding)."""
        return self.source >= 0

    @property
    def max_query(self) -> int:
        return max((b - a for a, b in zip(self.query_bounds[:-1], self.query_bounds[1:])),
                   default=0)

    @property
    def max_key(self) -> int:
        return max((b - a for a, b in zip(self.key_bounds[:-1], self.key_bounds[1:])), default=0)


def plan_context_shard(seq_lens: Sequence[int], *, cp: int, rank: int, multiple: int = 1,
                       prefix_starts: Sequence[int] | None = None,
                       prefix_lens: Sequence[int] | None = None) -> ContextShard:
    """Rank `rank`'s `ContextShard` of a stream of sequences of `seq_lens` tokens split over
    `cp` ranks; `multiple`: the local stream's token count is padded to a multiple of it (the
    tp size under sequence parallelism); `prefix_starts`/`prefix_lens`: the shared prompts'
    runs of stream tokens (`SharedPrefix`, as host ints; None: nothing shared)."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    if multiple < 1:
        raise ValueError(f"multiple must be positive, got {multiple}")
    lens = [int(n) for n in seq_lens]
    if any(n < 0 for n in lens):
        raise ValueError(f"sequence lengths must be non-negative, got {lens}")
    if (prefix_starts is None) != (prefix_lens is None):
        raise ValueError("pass prefix_starts and prefix_lens together, or neither")
    shared = [0] * len(lens) if prefix_lens is None else [int(p) for p in prefix_lens]
    leaders = [0] * len(lens) if prefix_starts is None else [int(s) for s in prefix_starts]
    if len(shared) != len(lens) or len(leaders) != len(lens):
        raise ValueError(f"{len(lens)} sequences but {len(leaders)} prefix starts and "
                         f"{len(shared)} prefix lengths; pass one of each per sequence")
    if any(p < 0 or s < 0 or (p and s + p > sum(lens)) for s, p in zip(leaders, shared)):
        raise ValueError(f"prefix runs (starts {leaders}, lengths {shared}) must lie inside "
                         f"the stream of {sum(lens)} tokens")
    pieces = 2 * cp
    chunk = [-(-n // pieces) for n in lens]  # each sequence padded to pieces * chunk tokens
    starts = [0] * len(lens)  # of each sequence in the stream
    for i in range(1, len(lens)):
        starts[i] = starts[i - 1] + lens[i - 1]
    body = 2 * sum(chunk)  # every rank holds two chunks of every sequence
    tail = -body % multiple
    num_local = body + tail

    def chunks_of(q: int) -> list[tuple[int, int]]:
        """(sequence, chunk index) of rank q's local chunks in local order."""
        return [(i, k) for i, c in enumerate(chunk) if c for k in (q, pieces - 1 - q)]

    # gathered[i][p]: the gathered-stream row of padded position p of sequence i
    gathered = [torch.empty(pieces * c, dtype=torch.int64) for c in chunk]
    for q in range(cp):
        row = q * num_local
        for i, k in chunks_of(q):
            c = chunk[i]
            gathered[i][k * c:(k + 1) * c] = torch.arange(row, row + c)
            row += c
    empty = torch.empty(0, dtype=torch.int64)
    token_rows = torch.cat([g[:n] for g, n in zip(gathered, lens)] or [empty])
    source, positions, query_bounds, keys, key_bounds = [], [], [0], [], [0]
    for i, k in chunks_of(rank):
        c, p = chunk[i], shared[i]
        pos = torch.arange(k * c, (k + 1) * c)
        positions.append(pos + p)  # a sharing sequence's positions continue its prompt's
        source.append(torch.where(pos < lens[i], starts[i] + pos, -1))
        query_bounds.append(query_bounds[-1] + c)
        # the shared prompt's gathered rows, then the sequence up to this chunk
        keys += [token_rows[leaders[i]:leaders[i] + p], gathered[i][:(k + 1) * c]]
        key_bounds.append(key_bounds[-1] + p + (k + 1) * c)
    if tail:
        positions.append(torch.arange(tail))
        source.append(torch.full((tail,), -1, dtype=torch.int64))
        query_bounds.append(query_bounds[-1] + tail)
        keys.append(torch.arange(rank * num_local + body, (rank + 1) * num_local))
        key_bounds.append(key_bounds[-1] + tail)
    return ContextShard(cp=cp, rank=rank, source=torch.cat(source or [empty]),
                        positions=torch.cat(positions or [empty]),
                        query_bounds=tuple(query_bounds), key_rows=torch.cat(keys or [empty]),
                        key_bounds=tuple(key_bounds), token_rows=token_rows)


def shard_tokens(x_T: Tensor, shard: ContextShard, *, fill: float | bool = 0) -> Tensor:
    """This rank's local rows (T_local, ...) of a per-token tensor x_T (T, ...) of the whole
    stream; padding rows hold `fill`."""
    local = x_T.index_select(0, shard.source.clamp(min=0).to(x_T.device))
    pad = ~shard.holds_token.to(x_T.device).view(-1, *([1] * (x_T.dim() - 1)))
    return local.masked_fill(pad, fill)


def gather_keys_values(x_THD: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """Every cp rank's local keys (or values) in cp-rank order (the gathered stream that
    `ContextShard.key_rows` indexes); backward sums the grads each rank's queries gave them
    and keeps this rank's rows (a reduce-scatter). A no-op on a size-1 group."""
    return gather_from_sequence(x_THD, group=group, grad_is_partial=True)


def gather_tokens(x_local: Tensor, shard: ContextShard, *, group: ProcessGroup | None,
                  grad_is_partial: bool = False) -> Tensor:
    """The whole stream's (T, ...) per-token outputs, in stream order, from every rank's local
    rows (padding dropped), e.g. log-probs for the driver. `grad_is_partial`: as in
    `gather_from_sequence` (False: every rank computes the same loss of the result)."""
    if group_size(group) != shard.cp:
        raise ValueError(f"the shard is planned for cp={shard.cp} but the group has "
                         f"{group_size(group)} ranks; pass the cp group it was planned for")
    gathered = gather_from_sequence(x_local, group=group, grad_is_partial=grad_is_partial)
    return gathered.index_select(0, shard.token_rows.to(x_local.device))
