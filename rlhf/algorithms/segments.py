"""Segment operations on a packed per-token stream bounded by `cu_seqlens` (never padded).

A stream of T tokens holds n samples back to back; sample i owns tokens
`cu_seqlens[i]:cu_seqlens[i + 1]`. Everything here is index arithmetic on that layout:
per-sample sums (`index_add`), per-sample -> per-token broadcasts (a gather), dropping masked
tokens (`Segments.compact`) and a back-to-front scan vectorised across samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Segments:
    """Where the samples of one packed stream are: lengths, starts and the owner of each token."""

    lengths_N: Tensor  # (n,) int64
    starts_N: Tensor  # (n,) int64, offset of each sample's first token
    sample_T: Tensor  # (T,) int64, the sample each token belongs to

    @property
    def num_samples(self) -> int:
        return self.lengths_N.numel()

    @property
    def num_tokens(self) -> int:
        return self.sample_T.numel()

    def positions(self) -> Tensor:
        """Position of every token inside its sample, (T,) int64 starting at 0."""
        return torch.arange(self.num_tokens, device=self.sample_T.device) - self.starts_N[
            self.sample_T]

    def compact(self, valid_T: Tensor) -> Segments:
        """The segments of the stream `x_T[valid_T]`: masked tokens removed, samples kept."""
        lengths_N = count_per_sample(valid_T, self)
        return Segments(lengths_N, _starts(lengths_N), self.sample_T[valid_T])


def _starts(lengths_N: Tensor) -> Tensor:
    return F.pad(lengths_N.cumsum(0), (1, 0))[:-1]


def segments(cu_seqlens: Tensor, num_tokens: int, device: torch.device | None = None) -> Segments:
    """Check `cu_seqlens` (int32 or int64, n+1) against a stream of `num_tokens` and index it."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D integer tensor of n+1 offsets starting at 0")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths_N = cu[1:] - cu[:-1]
    # A wrong offset would silently mix samples. The check is queued, not waited for: on a
    # device it fails asynchronously, on the CPU at once (then raised as a ValueError).
    ok = (cu[0] == 0) & (cu[-1] == num_tokens) & (lengths_N >= 0).all()
    message = (f"cu_seqlens does not bound a stream of {num_tokens} tokens: it must start at 0, "
               f"never decrease and end at {num_tokens}")
    try:
        # torch's device-side assert: no host sync; private in name only (its stubs say so)
        torch._assert_async(ok, message)  # pyright: ignore[reportPrivateImportUsage]
    except RuntimeError:
        raise ValueError(f"{message} (got {cu.tolist()[:8]}"
                         f"{'...' if cu.numel() > 8 else ''})") from None
    sample_T = torch.repeat_interleave(
        torch.arange(lengths_N.numel(), device=cu.device), lengths_N, output_size=num_tokens
    )
    return Segments(lengths_N, cu[:-1], sample_T)


def valid_mask(mask_T: Tensor | None, num_tokens: int, device: torch.device) -> Tensor:
    """A bool (T,) mask from a bool or 0/1 mask; None means every token counts."""
    if mask_T is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    if tuple(mask_T.shape) != (num_tokens,):
        raise ValueError(f"mask_T has shape {tuple(mask_T.shape)}, expected ({num_tokens},)")
    return mask_T.to(device) != 0


def check_tokens(num_tokens: int, **tensors_T: Tensor | None) -> None:
    """Raise a ValueError naming any per-token tensor whose shape is not (num_tokens,)."""
    for name, t in tensors_T.items():
        if t is not None and tuple(t.shape) != (num_tokens,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({num_tokens},)")


def segment_sum(x_T: Tensor, seg: Segments, valid_T: Tensor | None = None) -> Tensor:
    """Per-sample sum (n,) of the valid tokens; masked tokens may hold NaN/inf without effect."""
    if valid_T is not None:
        x_T = x_T.masked_fill(~valid_T, 0)
    out_N = x_T.new_zeros(seg.num_samples)
    return out_N.index_add(0, seg.sample_T, x_T)  # out of place: differentiable w.r.t. x_T


def count_per_sample(valid_T: Tensor, seg: Segments) -> Tensor:
    """Valid tokens of every sample, (n,) int64."""
    return segment_sum(valid_T.to(torch.int64), seg)


def to_tokens(x_N: Tensor, seg: Segments) -> Tensor:
    """Broadcast a per-sample value to each of the sample's tokens, (T,)."""
    return x_N[seg.sample_T]


def scatter_valid(x_V: Tensor, valid_T: Tensor) -> Tensor:
    """Put the values of the valid tokens back in a (T,) stream, with 0 at masked tokens."""
    out_T = x_V.new_zeros(valid_T.shape[0])
    out_T[valid_T] = x_V
    return out_T


def last_valid_index(seg: Segments, valid_T: Tensor) -> Tensor:
    """Stream index of each sample's last valid token, (n,) int64; -1 where it has none."""
    idx_T = torch.arange(seg.num_tokens, device=seg.sample_T.device)
    out_N = torch.full((seg.num_samples,), -1, dtype=torch.int64, device=idx_T.device)
    return out_N.scatter_reduce(0, seg.sample_T[valid_T], idx_T[valid_T], reduce="amax")


def reverse_scan(x_T: Tensor, seg: Segments, decay: float) -> Tensor:
    """y[t] = x[t] + decay * y[t+1] inside every sample, computed back to front.

    Loops over positions (up to the longest sample), each step handling all samples at once.
    """
    y_T = x_T.clone()
    if seg.num_tokens == 0:
        return y_T
    pos_T = seg.positions()
    max_len = int(seg.lengths_N.max())
    # Token indices grouped by position; the predecessor of a token at position p >= 1 is the
    # previous stream index, in the same sample by construction.
    order_T = torch.argsort(pos_T, stable=True)
    by_pos = torch.split(order_T, torch.bincount(pos_T, minlength=max_len).tolist())
    for p in range(max_len - 1, 0, -1):
        idx = by_pos[p]
        y_T.index_add_(0, idx - 1, decay * y_T[idx])
    return y_T
