"""Memory planner: will a job fit its devices, and if not, what change would make it fit.

- `inputs.py`: the facts of a job the planner reads (one RoleSpec per role, the hardware).
- `shapes.py`: exact per-rank parameter shapes, built on the meta device.
- `memory.py`: bytes per role and stage, and per device and phase of a step (`plan_job`),
  with each rank's CUDA context, NCCL communicators, vLLM graph pool and allocator cache, and
  the pinned host memory of each node.
- `advice.py`: candidate changes, each planned again (`plan_with_advice`).
- `report.py`: `rlhf plan` (table or JSON) and the check `rlhf train` runs first.

Nothing heavy is imported here, so registering the command keeps `rlhf --help` instant.
"""
