"""Tensor- and sequence-parallel layers with Megatron semantics; each holds only its shard.

Layers take the TP group (`mesh.tp_group`; None means no TP). Activations are token-major
(T, H) packed streams. Under sequence parallelism the stream between TP regions is split
along T (dim 0) into tp chunks, so T must be a multiple of tp (pad the packed stream):

    ColumnParallelLinear   (T/tp, H) -all-gather T-> (T, H) @ W[rows]ᵀ -> (T, O/tp)
    RowParallelLinear      (T, I/tp) @ W[:, cols]ᵀ -> partial (T, O) -reduce-scatter T-> (T/tp, O)
    VocabParallelEmbedding ids (T,) -> partial (T, D) -reduce-scatter T-> (T/tp, D)
    ParallelLMHead         (T/tp, H) -all-gather T-> logits_TV_local (T, V_padded/tp)

Without sequence parallelism the same layers all-reduce instead (full T on every rank).
Parameters replicated across TP that see only a token chunk under sequence parallelism (norm
weights, a row-parallel bias) hold a partial grad per rank; which ones is recorded in the
model's `ParamTable` (rlhf.models.param_table), and the engine sums them over TP.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from rlhf.parallel.collectives import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from rlhf.parallel.vocab_parallel import padded_vocab_size, vocab_shard_range


def shard_for_rank(full: Tensor, dim: int, rank: int, size: int) -> Tensor:
    """Rank's contiguous slice (a view) of `full` along `dim`, split into `size` equal parts."""
    n = full.shape[dim]
    if n % size:
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} is not divisible by {size}")
    return full.narrow(dim, rank * (n // size), n // size)


def _init_uniform_(tensor: Tensor, fan_in: int) -> None:
    # nn.Linear's default, with the fan-in of the full (unsharded) layer
    bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0
    nn.init.uniform_(tensor, -bound, bound)


def _check_load(name: str, got: Tensor, want: tuple[int, ...]) -> None:
    if tuple(got.shape) != want:
        raise ValueError(f"{name} has shape {tuple(got.shape)}; expected the full {want}")


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W split by output features: this rank holds out_features / tp rows."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 group: ProcessGroup | None, gather_output: bool = False,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.group, self.tp_size, self.tp_rank = group, group_size(group), group_rank(group)
        if out_features % self.tp_size:
            raise ValueError(f"out_features={out_features} is not divisible by tp={self.tp_size}")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        local = out_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None
        _init_uniform_(self.weight, in_features)
        if self.bias is not None:
            _init_uniform_(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: ProcessGroup | None,
                    gather_output: bool = False, sequence_parallel: bool = False):
        """This rank's shard of an existing full nn.Linear."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    group=group, gather_output=gather_output, sequence_parallel=sequence_parallel,
                    device=linear.weight.device, dtype=linear.weight.dtype)
        layer.load_full_weight(linear.weight, linear.bias)
        return layer

    def forward(self, x_TH: Tensor) -> Tensor:
        out_TO = self.local_linear(self.gather_input(x_TH))  # (T, O/tp)
        return gather_from_tp(out_TO, group=self.group) if self.gather_output else out_TO

    def gather_input(self, x_TH: Tensor) -> Tensor:
        """The full input every rank multiplies by its rows: all-gathered over the sequence
        under SP (T/tp, H) -> (T, H), else the input with its grad all-reduced in backward."""
        if self.sequence_parallel:
            return gather_from_sequence(x_TH, group=self.group)
        return copy_to_tp(x_TH, group=self.group)

    def local_linear(self, x_TH: Tensor) -> Tensor:
        """This rank's output columns from the full (gathered) input; an adapter adds to it."""
        return F.linear(x_TH, self.weight, self.bias)

    @torch.no_grad()
    def load_full_weight(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy this rank's rows of the full (out, in) weight and (out,) bias."""
        _check_load("weight", weight, (self.out_features, self.in_features))
        self.weight.copy_(shard_for_rank(weight, 0, self.tp_rank, self.tp_size))
        if self.bias is not None:
            if bias is None:
                raise ValueError("this layer has a bias; pass the full bias too")
            _check_load("bias", bias, (self.out_features,))
            self.bias.copy_(shard_for_rank(bias, 0, self.tp_rank, self.tp_size))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W split by input features; bias added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 group: ProcessGroup | None, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.group, self.tp_size, self.tp_rank = group, group_size(group), group_rank(group)
        if in_features % self.tp_size:
            raise ValueError(f"in_features={in_features} is not divisible by tp={self.tp_size}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True (the column-parallel "
                             "layer before it already splits the features)")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        local = in_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
                     if bias else None)
        _init_uniform_(self.weight, in_features)
        if self.bias is not None:
            _init_uniform_(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: ProcessGroup | None,
                    input_is_parallel: bool = True, sequence_parallel: bool = False):
        """This rank's shard of an existing full nn.Linear."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    group=group, input_is_parallel=input_is_parallel,
                    sequence_parallel=sequence_parallel,
                    device=linear.weight.device, dtype=linear.weight.dtype)
        layer.load_full_weight(linear.weight, linear.bias)
        return layer

    def forward(self, x_TI: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x_TI = scatter_to_tp(x_TI, group=self.group)  # (T, I) -> (T, I/tp)
        partial_TO = self.local_linear(x_TI)
        if self.sequence_parallel:
            out_TO = reduce_scatter_to_sequence(partial_TO, group=self.group)  # (T/tp, O)
        else:
            out_TO = reduce_from_tp(partial_TO, group=self.group)  # (T, O)
        return out_TO if self.bias is None else out_TO + self.bias

    def local_linear(self, x_TI: Tensor) -> Tensor:
        """This rank's partial output (before the TP reduction, without the bias) from its input
        features; an adapter adds its own partial to it, so one reduction sums both."""
        return F.linear(x_TI, self.weight)

    @torch.no_grad()
    def load_full_weight(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy this rank's columns of the full (out, in) weight, and the whole bias."""
        _check_load("weight", weight, (self.out_features, self.in_features))
        self.weight.copy_(shard_for_rank(weight, 1, self.tp_rank, self.tp_size))
        if self.bias is not None:
            if bias is None:
                raise ValueError("this layer has a bias; pass the full bias too")
            _check_load("bias", bias, (self.out_features,))
            self.bias.copy_(bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary padded to a multiple of tp and split into contiguous slices.

    Ids outside this rank's slice (or past the real vocabulary) look up zeros; the partial
    embeddings are summed over TP (all-reduce, or reduce-scatter to token chunks under SP).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: ProcessGroup | None,
                 sequence_parallel: bool = False, pad_to_multiple_of: int = 1,
                 device=None, dtype=None):
        super().__init__()
        self.group, self.tp_size, self.tp_rank = group, group_size(group), group_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.padded_num_embeddings = padded_vocab_size(
            num_embeddings, self.tp_size, pad_to_multiple_of=pad_to_multiple_of)
        self.vocab_start, self.vocab_end = vocab_shard_range(
            self.padded_num_embeddings, self.tp_rank, self.tp_size)
        local = self.vocab_end - self.vocab_start
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        with torch.no_grad():
            nn.init.normal_(self.weight)
            self.weight[max(0, num_embeddings - self.vocab_start):].zero_()  # padding rows

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, group: ProcessGroup | None,
                       sequence_parallel: bool = False, pad_to_multiple_of: int = 1):
        """This rank's shard of an existing full nn.Embedding."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group,
                    sequence_parallel=sequence_parallel, pad_to_multiple_of=pad_to_multiple_of,
                    device=embedding.weight.device, dtype=embedding.weight.dtype)
        layer.load_full_weight(embedding.weight)
        return layer

    def forward(self, ids_T: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(ids_T, self.weight)
        outside_T = (ids_T < self.vocab_start) | (ids_T >= self.vocab_end)
        local_T = torch.where(outside_T, 0, ids_T - self.vocab_start)
        partial_TD = F.embedding(local_T, self.weight).masked_fill(outside_T[..., None], 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(partial_TD, group=self.group)  # (T/tp, D)
        return reduce_from_tp(partial_TD, group=self.group)  # (T, D)

    @torch.no_grad()
    def load_full_weight(self, weight: Tensor) -> None:
        """Copy this rank's rows of the full (num_embeddings, D) weight; padding rows stay zero."""
        _check_load("weight", weight, (self.num_embeddings, self.embedding_dim))
        _load_vocab_rows(self.weight, weight, self.vocab_start)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}), "
                f"{self.embedding_dim}, tp={self.tp_size}, rows=[{self.vocab_start}, "
                f"{self.vocab_end}), sequence_parallel={self.sequence_parallel}")


class ParallelLMHead(ColumnParallelLinear):
    """Column-parallel output layer over the padded vocabulary; logits stay vocab-sharded.

    Returns `logits_TV_local` (T, padded_vocab / tp) for the columns [vocab_start, vocab_end);
    feed them to vocab_parallel_log_probs / vocab_parallel_entropy with `real_vocab_size`.
    Its weight has the same shard layout as a VocabParallelEmbedding with the same vocab,
    group and pad_to_multiple_of, so tied embeddings can share one Parameter.
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, group: ProcessGroup | None,
                 sequence_parallel: bool = False, pad_to_multiple_of: int = 1,
                 device=None, dtype=None):
        padded = padded_vocab_size(vocab_size, group_size(group),
                                   pad_to_multiple_of=pad_to_multiple_of)
        super().__init__(hidden_size, padded, bias=False, group=group, gather_output=False,
                         sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.vocab_size, self.padded_vocab_size = vocab_size, padded
        self.vocab_start, self.vocab_end = vocab_shard_range(padded, self.tp_rank, self.tp_size)
        with torch.no_grad():
            self.weight[max(0, vocab_size - self.vocab_start):].zero_()  # padding rows

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: ProcessGroup | None,
                    sequence_parallel: bool = False, pad_to_multiple_of: int = 1):
        """This rank's shard of a full (vocab, hidden) output layer without bias."""
        if linear.bias is not None:
            raise ValueError("ParallelLMHead has no bias; the given nn.Linear has one")
        head = cls(linear.in_features, linear.out_features, group=group,
                   sequence_parallel=sequence_parallel, pad_to_multiple_of=pad_to_multiple_of,
                   device=linear.weight.device, dtype=linear.weight.dtype)
        head.load_full_weight(linear.weight)
        return head

    @torch.no_grad()
    def load_full_weight(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy this rank's rows of the full (vocab, hidden) weight; padding rows stay zero."""
        if bias is not None:
            raise ValueError("ParallelLMHead has no bias")
        _check_load("weight", weight, (self.vocab_size, self.in_features))
        _load_vocab_rows(self.weight, weight, self.vocab_start)


def _load_vocab_rows(local_VD: Tensor, full_VD: Tensor, vocab_start: int) -> None:
    """Fill a vocab shard from the full (unpadded) table: real rows copied, padding rows zeroed."""
    real = full_VD[vocab_start: vocab_start + local_VD.shape[0]]
    local_VD[: real.shape[0]].copy_(real)
    local_VD[real.shape[0]:].zero_()
