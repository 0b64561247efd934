"""Pack ragged sequences into one token stream per micro-batch (THD layout) for varlen attention.

Sequences are concatenated without padding; `cu_seqlens` (int32, n+1) bounds them as
flash-attn's varlen API expects, and `position_ids` restart at 0 for every sequence.
Empty sequences keep their slot (a repeated `cu_seqlens` entry) so row i stays sample i.

Shared prompts (`pack_prompt_response(..., share_prompts=True)`): the samples of one prompt
(rollout.n of them, consecutive rows with equal prompt ids) hold that prompt once. The first
sample of such a run keeps its whole prompt; each later one keeps only the prompt's LAST token
(its sequence is that token then its response, positions continuing from the prompt) and
attends to the first sample's other prompt tokens through `Packed.prefix`. Every sequence still
starts with a prompt token that predicts its first response token, so everything that maps
response tokens to positions is unchanged, and the outputs equal the unshared packing's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlhf.data.ragged import Ragged, offsets_from_lengths

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class SharedPrefix:
    """Earlier stream tokens each sequence also attends to: sequence i's queries see stream
    positions starts[i] .. starts[i] + lens[i] - 1 (all of them), then its own tokens causally.
    lens[i] == 0 for a sequence that sees only itself."""

    starts: Tensor  # (n,) int64
    lens: Tensor  # (n,) int64

    def to(self, device: torch.device | str) -> SharedPrefix:
        return SharedPrefix(self.starts.to(device), self.lens.to(device))

    def padded(self, extra: int) -> SharedPrefix:
        """The same with `extra` sequences appended that share nothing (SP's dummy)."""
        zeros = self.lens.new_zeros(extra)
        return SharedPrefix(torch.cat([self.starts, zeros]), torch.cat([self.lens, zeros]))


@dataclass(frozen=True)
class Packed:
    """Sequences concatenated into one stream, bounded by `cu_seqlens`."""

    tokens: Tensor  # (T,) usually token ids; (T, *feature_dims) is allowed
    cu_seqlens: Tensor  # (n+1,) int32, cu_seqlens[0] == 0, cu_seqlens[-1] == T
    position_ids: Tensor  # (T,) int64, 0..len_i-1 inside sequence i (after its prefix)
    max_seqlen: int  # longest sequence, 0 when there are none
    prefix: SharedPrefix | None = field(default=None, kw_only=True)  # None: nothing shared

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seq_lens(self) -> Tensor:
        """Sequence lengths, (n,) int64."""
        cu = self.cu_seqlens.long()
        return cu[1:] - cu[:-1]


@dataclass(frozen=True)
class PackedSequences(Packed):
    """Prompt-then-response sequences in one stream; `response_mask` marks the response tokens."""

    response_mask: Tensor  # (T,) bool, True on response tokens
    prompt_lens: Tensor  # (n,) int64
    response_lens: Tensor  # (n,) int64


def _as_ragged(seqs: Sequence[Tensor] | Ragged, what: str) -> Ragged:
    if isinstance(seqs, Ragged):
        return seqs
    try:
        return Ragged.from_list(seqs)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from e


def _cu_seqlens(offsets: Tensor) -> Tensor:
    total = int(offsets[-1])
    if total > _INT32_MAX:
        raise ValueError(
            f"{total} tokens do not fit int32 cu_seqlens; use a smaller micro-batch token budget"
        )
    return offsets.to(torch.int32)


def _position_ids(offsets: Tensor) -> Tensor:
    lengths = offsets[1:] - offsets[:-1]
    total = int(offsets[-1])
    starts_T = torch.repeat_interleave(offsets[:-1], lengths, output_size=total)
    return torch.arange(total, device=offsets.device) - starts_T  # (T,)


def _max_len(lengths: Tensor) -> int:
    return int(lengths.max()) if lengths.numel() else 0


def pack(seqs: Sequence[Tensor] | Ragged) -> Packed:
    """Concatenate sequences into one stream with int32 `cu_seqlens` and restarting positions."""
    rows = _as_ragged(seqs, "pack")
    return Packed(
        tokens=rows.values,
        cu_seqlens=_cu_seqlens(rows.offsets),
        position_ids=_position_ids(rows.offsets),
        max_seqlen=_max_len(rows.lengths),
    )


def pack_prompt_response(
    prompts: Ragged | Sequence[Tensor], responses: Ragged | Sequence[Tensor], *,
    share_prompts: bool = False,
) -> PackedSequences:
    """Pack sequence i as prompts[i] followed by responses[i]; either part may be empty.

    `share_prompts`: consecutive rows with equal prompts (of 2+ tokens) hold the prompt once
    (see the module docstring); `prompt_lens` are then the prompt tokens each row holds.
    """
    p, r = _as_ragged(prompts, "prompts"), _as_ragged(responses, "responses")
    if len(p) != len(r):
        raise ValueError(f"{len(p)} prompts but {len(r)} responses; pass one response per prompt")
    pv, rv = p.values, r.values
    if pv.shape[1:] != rv.shape[1:] or pv.dtype != rv.dtype or pv.device != rv.device:
        raise ValueError(
            f"prompts are {pv.dtype} {tuple(pv.shape[1:])} on {pv.device} but responses are "
            f"{rv.dtype} {tuple(rv.shape[1:])} on {rv.device}; cast both to one dtype and device"
        )
    shared = shared_prompt_lens(p) if share_prompts else []
    prefix_lens = torch.tensor(shared, dtype=torch.int64, device=pv.device) if any(shared) else None
    if prefix_lens is not None:  # rows that share keep only their prompt's last token
        p = _drop_prefixes(p, prefix_lens)
        pv = p.values
    prompt_lens, response_lens = p.lengths, r.lengths
    seq_lens = prompt_lens + response_lens
    offsets = offsets_from_lengths(seq_lens)
    total = int(offsets[-1])
    position_ids = _position_ids(offsets)
    # Response tokens are those at or past their sequence's prompt length.
    prompt_len_T = torch.repeat_interleave(prompt_lens, seq_lens, output_size=total)
    response_mask = position_ids >= prompt_len_T
    tokens = pv.new_empty((total, *pv.shape[1:]))
    tokens[~response_mask] = pv  # boolean-mask assignment fills positions in stream order
    tokens[response_mask] = rv
    prefix = None
    if prefix_lens is not None:
        position_ids += torch.repeat_interleave(prefix_lens, seq_lens, output_size=total)
        prefix = SharedPrefix(_leader_starts(offsets[:-1], prefix_lens), prefix_lens)
    return PackedSequences(
        tokens=tokens,
        cu_seqlens=_cu_seqlens(offsets),
        position_ids=position_ids,
        max_seqlen=_max_len(seq_lens),
        response_mask=response_mask,
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        prefix=prefix,
    )


def shared_prompt_lens(prompts: Ragged | Sequence[Tensor]) -> list[int]:
    """How many leading prompt tokens row i can read from the first row of its run of equal
    consecutive prompts: its prompt length - 1 for a later row of a run (prompts of 2+ tokens),
    0 otherwise. The one rule of who shares, for packing and for planning micro-batches."""
    rows = _as_ragged(prompts, "prompts").to_list()
    lens, leader = [0] * len(rows), None
    for i, row in enumerate(rows):
        if (leader is not None and row.shape == rows[leader].shape and row.shape[0] > 1
                and torch.equal(row, rows[leader])):
            lens[i] = row.shape[0] - 1
        else:
            leader = i
    return lens


def _drop_prefixes(prompts: Ragged, prefix_lens: Tensor) -> Ragged:
    """Each row without its first prefix_lens[i] tokens."""
    lengths = prompts.lengths
    keep_T = _position_ids(prompts.offsets) >= torch.repeat_interleave(
        prefix_lens, lengths, output_size=prompts.values.shape[0])
    return Ragged(prompts.values[keep_T], offsets_from_lengths(lengths - prefix_lens))


def _leader_starts(starts: Tensor, prefix_lens: Tensor) -> Tensor:
    """(n,) stream start of the row each sharing row reads its prefix from (the last row
    before it that shares nothing); 0 for rows that share nothing."""
    leads = prefix_lens == 0
    index = torch.arange(len(starts), device=starts.device)
    leader = torch.cummax(torch.where(leads, index, torch.zeros_like(index)), dim=0).values
    return torch.where(leads, torch.zeros_like(starts), starts[leader])


def shifted_targets(packed: Packed) -> tuple[Tensor, Tensor]:
    """Next token inside the same sequence for every position: (targets_T, valid_T).

    Logits at position t predict token t+1, so `log p(tokens[t+1])` is
    `log_softmax(logits_TV).gather(-1, targets_T[:, None])[:, 0]`, meaningful only where
    `valid_T`, which is False at each sequence's last position (targets are 0 there).
    """
    tokens_T = packed.tokens
    if tokens_T.dim() != 1:
        raise ValueError(f"shifted_targets needs 1-D token ids, got shape {tuple(tokens_T.shape)}")
    cu = packed.cu_seqlens.long().to(tokens_T.device)
    lengths = cu[1:] - cu[:-1]
    num_tokens = tokens_T.shape[0]
    # Last position of every non-empty sequence; an empty one writes past the end, which is
    # cut off (a boolean index would read the mask back to the host, and `valid_T[last] =
    # False` copies the scalar to the GPU with a wait: index_fill_ passes it to the kernel).
    last = torch.where(lengths > 0, cu[1:] - 1, num_tokens)
    valid_T = torch.ones(num_tokens + 1, dtype=torch.bool, device=tokens_T.device)
    valid_T.index_fill_(0, last, False)
    valid_T = valid_T[:num_tokens]
    targets_T = torch.where(valid_T, torch.roll(tokens_T, -1), torch.zeros_like(tokens_T))
    return targets_T, valid_T


def response_values(
    values_T: Tensor, packed: PackedSequences, *, next_token: bool = False
) -> Ragged:
    """Per-token values (T, *feature_dims) of the response tokens, as one row per sequence.

    With `next_token=True`, values_T[t] scores token t+1 (log-probs computed against
    `shifted_targets`), so each response token's value is read one position earlier.
    """
    if values_T.shape[0] != packed.tokens.shape[0]:
        raise ValueError(
            f"values_T has {values_T.shape[0]} positions but the packed stream has "
            f"{packed.tokens.shape[0]}"
        )
    mask_T = packed.response_mask.to(values_T.device)
    if next_token and mask_T.numel():
        if bool(((packed.prompt_lens == 0) & (packed.response_lens > 0)).any()):
            raise ValueError(
                "next_token=True needs a non-empty prompt before every non-empty response: no "
                "position predicts a sequence's first token (start prompts with a BOS token)"
            )
        # Safe to roll: every sequence starts with a prompt token, so nothing crosses sequences.
        mask_T = torch.roll(mask_T, -1)
    offsets = offsets_from_lengths(packed.response_lens).to(values_T.device)
    return Ragged(values_T[mask_T], offsets)
