"""Micro-batches: whole prompt+response sequences packed into one stream, plus per-token tensors.

Per-response-token fields (old log-probs, advantages, loss masks, returns) are stored at the
packed position that PREDICTS their token: response token j of a sequence at stream position p
is scored by the model's output at p - 1 (the next-token convention of `shifted_targets` and of
`model_outputs`'s log_probs). So a loss on `outputs["log_probs"]` and `mb.tensors[...]` lines up
position by position, and every other position holds zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlhf.data.packing import PackedSequences, SharedPrefix, pack_prompt_response, response_values
from rlhf.data.ragged import Ragged
from rlhf.models.varlen_layout import VarlenLayout, varlen_layout
from rlhf.parallel.host import to_device


@dataclass(frozen=True)
class MicroBatch:
    """One packed stream of whole sequences and its per-token tensors (T, ...)."""

    packed: PackedSequences
    tensors: dict[str, Tensor] = field(default_factory=dict)  # each (T, ...), predicting positions
    sample_ids: Tensor | None = None  # (n,) int64: row of each sequence in the caller's batch
    # Attention's host lengths, read once here (where the stream is still on the CPU), so no
    # layer reads them back from the device.
    layout: VarlenLayout = field(default=None, compare=False)  # type: ignore[assignment]

    def __post_init__(self):
        if self.layout is None:
            object.__setattr__(self, "layout", varlen_layout(self.packed.cu_seqlens,
                                                             self.packed.prefix))

    @property
    def num_tokens(self) -> int:
        return int(self.packed.tokens.shape[0])

    @property
    def num_seqs(self) -> int:
        return self.packed.num_seqs

    @property
    def predicts_response_T(self) -> Tensor:
        """(T,) bool: positions whose next token is a response token (where losses live)."""
        return predicting_positions(self.packed)

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on `device` (the same object when nothing moves)."""
        if self.packed.tokens.device == torch.device(device):
            return self
        p = self.packed
        move = functools.partial(to_device, device=device)  # no stream sync per tensor
        prefix = None if p.prefix is None else SharedPrefix(move(p.prefix.starts),
                                                            move(p.prefix.lens))
        packed = PackedSequences(
            tokens=move(p.tokens), cu_seqlens=move(p.cu_seqlens),
            position_ids=move(p.position_ids), max_seqlen=p.max_seqlen,
            response_mask=move(p.response_mask), prompt_lens=p.prompt_lens,
            response_lens=p.response_lens, prefix=prefix)
        tensors = {k: move(v) for k, v in self.tensors.items()}
        return MicroBatch(packed, tensors, self.sample_ids, self.layout.to(device))


def predicting_positions(packed: PackedSequences) -> Tensor:
    """(T,) bool: True at p - 1 for every response token at p; needs non-empty prompts."""
    _check_prompts(packed.prompt_lens, packed.response_lens)
    # Each sequence starts with a prompt token, so rolling never crosses a sequence boundary.
    return torch.roll(packed.response_mask, -1)


def _check_prompts(prompt_lens: Tensor, response_lens: Tensor) -> None:
    empty_prompt = (prompt_lens == 0) & (response_lens > 0)
    if bool(empty_prompt.any()):
        i = int(empty_prompt.nonzero()[0])
        raise ValueError(f"sample {i} has a response but an empty prompt: no position predicts "
                         "its first token (start every prompt with at least one token, e.g. BOS)")


def scatter_response_values(values: Ragged, packed: PackedSequences) -> Tensor:
    """Per-response-token rows -> (T, ...) at the predicting positions, zeros elsewhere."""
    if not torch.equal(values.lengths.cpu(), packed.response_lens.cpu()):
        raise ValueError(f"rows have lengths {values.lengths.tolist()} but the responses have "
                         f"{packed.response_lens.tolist()}; give one value per response token")
    mask_T = predicting_positions(packed).to(values.values.device)
    out = values.values.new_zeros((mask_T.shape[0], *values.values.shape[1:]))
    out[mask_T] = values.values  # boolean assignment fills positions in stream order
    return out


def make_micro_batches(prompts: Ragged | Sequence[Tensor], responses: Ragged | Sequence[Tensor],
                       per_token: Mapping[str, Ragged] | None = None, *,
                       max_tokens: int, max_seqs: int | None = None,
                       share_prompts: bool = False) -> list[MicroBatch]:
    """Fill micro-batches in sample order up to `max_tokens` tokens (and `max_seqs` samples,
    when given) each, counting whole prompts; `share_prompts`: pack each micro-batch with
    shared prompts (rlhf.data.packing).

    `per_token[key]` has one row per sample with one entry per response token; it lands in
    `MicroBatch.tensors[key]` at the predicting positions (see the module docstring).
    """
    p, r = _ragged(prompts), _ragged(responses)
    if len(p) != len(r):
        raise ValueError(f"{len(p)} prompts but {len(r)} responses; pass one response per prompt")
    per_token = dict(per_token or {})
    for key, rows in per_token.items():
        if not isinstance(rows, Ragged) or not torch.equal(rows.lengths.cpu(), r.lengths.cpu()):
            raise ValueError(f"per_token[{key!r}] must be a Ragged with one entry per response "
                             "token of every sample (same row lengths as responses)")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if max_seqs is not None and max_seqs < 1:
        raise ValueError(f"max_seqs must be positive or None, got {max_seqs}")
    _check_prompts(p.lengths, r.lengths)
    bounds = _greedy_bounds((p.lengths + r.lengths).tolist(), max_tokens, max_seqs)
    out = []
    for start, stop in bounds:
        rows = range(start, stop)
        packed = pack_prompt_response(p.select(rows), r.select(rows), share_prompts=share_prompts)
        tensors = {k: scatter_response_values(v.select(rows), packed) for k, v in per_token.items()}
        out.append(MicroBatch(packed, tensors, torch.arange(start, stop)))
    return out


def _greedy_bounds(lengths: list[int], max_tokens: int,
                   max_seqs: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) sample ranges, each as long as fits in max_tokens and max_seqs."""
    bounds, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens (prompt + response) but a micro-batch "
                             f"holds at most max_tokens={max_tokens}; raise the token budget to "
                             f"at least {n} or shorten the sequence")
        if used + n > max_tokens or (max_seqs is not None and i - start == max_seqs):
            bounds.append((start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        bounds.append((start, len(lengths)))
    return bounds


def collect_response_values(outputs_T: Sequence[Tensor],
                            micro_batches: Sequence[MicroBatch]) -> Ragged:
    """Per-token outputs of every micro-batch -> one row per sample (response tokens only),
    in `sample_ids` order: the inverse of the scatter in `make_micro_batches`."""
    if len(outputs_T) != len(micro_batches):
        raise ValueError(f"{len(outputs_T)} outputs for {len(micro_batches)} micro-batches")
    if not micro_batches:
        raise ValueError("no micro-batches to collect from")
    parts = [response_values(out, mb.packed, next_token=True)
             for out, mb in zip(outputs_T, micro_batches)]
    rows = Ragged.concat(parts)
    ids = [mb.sample_ids if mb.sample_ids is not None else torch.arange(mb.num_seqs) + k
           for k, mb in zip(_running_counts(micro_batches), micro_batches)]
    return rows.select(torch.argsort(torch.cat(ids).cpu()))


def _running_counts(micro_batches: Sequence[MicroBatch]) -> list[int]:
    counts, n = [], 0
    for mb in micro_batches:
        counts.append(n)
        n += mb.num_seqs
    return counts


def _ragged(x: Ragged | Sequence[Tensor]) -> Ragged:
    return x if isinstance(x, Ragged) else Ragged.from_list(x)
