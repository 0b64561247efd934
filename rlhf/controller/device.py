"""The device of a rank: resolved once, from the GPU ids Ray assigned it, and shipped to its roles
in their WorkerContext. Nothing else picks a device by its own rule.

Ray reports a rank's GPUs by their ids as listed in the node's CUDA_VISIBLE_DEVICES (or their
physical index when that is unset). By default Ray then narrows the rank's CUDA_VISIBLE_DEVICES
to those ids, so torch sees the rank's GPU as index 0; with
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 it leaves the variable as it was, so torch sees
every GPU of the node and the rank's GPU sits at the id's position. Both cases are one rule:
the index of the assigned id in the rank's CUDA_VISIBLE_DEVICES, or the id itself without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def worker_device(gpu_ids: Sequence[str], *, use_gpu: bool,
                  env: Mapping[str, str]) -> torch.device:
    """The torch device of a rank given Ray's assigned GPU ids and the rank's environment;
    the CPU when the job takes no GPU."""
    if not use_gpu:
        return torch.device("cpu")
    ids = [str(i).strip() for i in gpu_ids]
    if len(ids) != 1:
        raise ValueError(f"a rank of a GPU job needs exactly one GPU from Ray, got ids {ids}; "
                         "give each rank's bundle {'GPU': 1}")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        listed = [v.strip() for v in visible.split(",")]
        if ids[0] not in listed:
            raise ValueError(f"Ray assigned GPU {ids[0]} but CUDA_VISIBLE_DEVICES={visible!r} "
                             "does not list it; do not change CUDA_VISIBLE_DEVICES in the "
                             "workers' runtime environment")
        return torch.device("cuda", listed.index(ids[0]))
    if not ids[0].isdigit():
        raise ValueError(f"Ray assigned GPU {ids[0]!r}, which is not an index, and "
                         "CUDA_VISIBLE_DEVICES is unset; set it on the node before `ray start`")
    return torch.device("cuda", int(ids[0]))
