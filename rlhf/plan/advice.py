"""What would make a job fit: candidate changes, each planned again, the ones that fit kept.

A candidate is a list of `section.key=value` overrides, exactly what a user would type after
`rlhf train CONFIG`; it is applied to the config, checked by the config's own rules (a tp that
does not divide the heads is dropped, not suggested), and planned like the original.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlhf.config import JobConfig, config_from_dict, config_to_dict
from rlhf.config.loader import apply_override
from rlhf.errors import RLHFError
from rlhf.plan.inputs import RoleSpec
from rlhf.plan.memory import MemoryPlan, plan_job


@dataclass(frozen=True)
class Advice:
    """A change and the peak it leads to (bytes on the fullest device)."""

    overrides: tuple[str, ...]
    peak: int
    fits: bool


def plan_with_advice(cfg: JobConfig, *,
                     model_dirs: tuple[Path, ...] = ()) -> tuple[MemoryPlan, list[Advice]]:
    """The plan, and when it does not fit, the changes tried (those that fit first)."""
    plan = plan_job(cfg, model_dirs=model_dirs)
    if plan.fits:
        return plan, []
    return plan, advise(cfg, plan, lambda changed: plan_job(changed, model_dirs=model_dirs))


def candidates(cfg: JobConfig, plan: MemoryPlan) -> list[tuple[str, ...]]:
    """Single changes worth trying, most local first; see the module docstring."""
    out: list[tuple[str, ...]] = []
    pool = cfg.trainer.pool_size
    if not plan.host_fits:  # pinned host copies over the node's RAM: offload less
        for spec in plan.roles.values():
            out += [(f"{spec.name}.offload.{k}=false",) for k in ("optimizer", "grads", "params")
                    if getattr(spec.offload, k)]
    trainers = [s for s in plan.roles.values() if s.trains]
    for spec in trainers:
        if spec.dp > 1 and not spec.zero1:
            out.append((f"{spec.name}.optim.distributed=true",))
    on_cuda = plan.hardware.device_type == "cuda"
    if on_cuda:
        single = [c for spec in plan.roles.values() for c in _offload(spec)]
        out += single
        if len(single) > 1:
            out.append(tuple(x for c in single for x in c))  # every role offloads
    for spec in plan.roles.values():
        world = spec.world_size if not spec.colocated else pool
        model_parallel = spec.parallel.tp * spec.parallel.cp * spec.parallel.pp
        for axis in ("tp", "cp", "pp"):
            size = getattr(spec.parallel, axis)
            if world % (model_parallel * 2) == 0:
                out.append((f"{spec.name}.parallel.{axis}={size * 2}",))
        if spec.trains and spec.recompute != "full":
            nxt = "attention_block" if spec.recompute == "none" else "full"
            out.append((f"{spec.name}.recompute={nxt}",))
        out.append((f"{spec.name}.max_tokens_per_micro_batch={spec.tokens // 2}",))
    if on_cuda:
        util = cfg.rollout.gpu_memory_utilization
        for lower in (0.4, 0.3, 0.2):
            if lower < util:
                out.append((f"rollout.gpu_memory_utilization={lower}",))
    return out


def _offload(spec: RoleSpec) -> list[tuple[str, ...]]:
    if not spec.trains:
        return [] if spec.offload.params else [(f"{spec.name}.offload.params=true",)]
    return [] if all((spec.offload.params, spec.offload.grads, spec.offload.optimizer)) \
        else [_offload_all(spec)]


def _offload_all(spec: RoleSpec) -> tuple[str, ...]:
    kinds = ("params",) if not spec.trains else ("params", "grads", "optimizer")
    return tuple(f"{spec.name}.offload.{k}=true" for k in kinds)


def advise(cfg: JobConfig, plan: MemoryPlan,
           replan: Callable[[JobConfig], MemoryPlan]) -> list[Advice]:
    """Every candidate that passes the config checks, planned, fitting ones first (lowest
    peak first). When no single change fits, also the smallest combination of the changes
    that lower the peak, added greedily (biggest saving first) until it fits."""
    out = []
    for overrides in candidates(cfg, plan):
        result = _try(cfg, overrides, replan)
        if result is not None:
            out.append(Advice(overrides, result.peak, result.fits))
    out.sort(key=lambda a: (not a.fits, a.peak))
    if out and not out[0].fits:
        combined: tuple[str, ...] = ()
        for advice in (a for a in out if a.peak < plan.peak):
            keys = {o.partition("=")[0] for o in combined}
            if any(o.partition("=")[0] in keys for o in advice.overrides):
                continue
            result = _try(cfg, combined + advice.overrides, replan)
            if result is None:
                continue
            combined += advice.overrides
            if result.fits:
                out.insert(0, Advice(combined, result.peak, True))
                break
    return out


def _try(cfg: JobConfig, overrides: tuple[str, ...],
         replan: Callable[[JobConfig], MemoryPlan]) -> MemoryPlan | None:
    try:
        return replan(with_overrides(cfg, overrides))
    except (RLHFError, ValueError):
        return None  # the change breaks a config rule (tp must divide the heads...)


def with_overrides(cfg: JobConfig, overrides: tuple[str, ...]) -> JobConfig:
    """`cfg` with `section.key=value` overrides applied and every config rule checked."""
    tree = config_to_dict(cfg)
    for override in overrides:
        apply_override(tree, override)
    return config_from_dict(tree)
