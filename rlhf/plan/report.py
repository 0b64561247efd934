"""`rlhf plan CONFIG [k=v ...]`: the memory plan as a table (or JSON), and the check that
`rlhf train` runs before it starts any worker."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlhf.config.loader import add_job_arguments
from rlhf.errors import RLHFError

GIB = 2**30


def add_command(commands: argparse._SubParsersAction) -> None:
    """Register `plan` on the top-level subparsers."""
    parser = commands.add_parser(
        "plan", help="predict the memory of every role and device in each phase of a step, "
                     "and whether the job fits; exit 1 when it does not")
    add_job_arguments(parser, example="actor.parallel.tp=2 trainer.device_memory_gb=79")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--models", action="append", default=[], metavar="DIR",
                        help="where to look for <model folder name>/config.json when a model "
                             "folder is absent (the YAML's folder/models is always searched)")
    parser.set_defaults(run=_run)


def model_dirs(config_path: str | Path, extra=()) -> tuple[Path, ...]:
    """Folders of architecture stand-ins: the YAML's own `models/` folder, then `extra`."""
    return (Path(config_path).parent / "models", *map(Path, extra))


def _run(args) -> int:
    from rlhf.config import load_config
    from rlhf.plan.advice import plan_with_advice

    cfg = load_config(args.config, args.overrides)
    plan, advice = plan_with_advice(cfg, model_dirs=model_dirs(args.config, args.models))
    if args.json:
        print(json.dumps(to_json(plan, advice)))
    else:
        print(format_plan(plan, advice, title=args.config), end="")
    return 0 if plan.fits else 1


def check_fits(cfg, *, config_path: str | Path) -> None:
    """Raise RLHFError naming the changes that fit when `cfg` is predicted not to fit;
    trainer.skip_memory_check skips the check. A model folder this machine cannot see (the
    workers' nodes may) leaves nothing to predict: a warning, and training goes on."""
    from rlhf.plan.advice import plan_with_advice
    from rlhf.plan.inputs import UnknownArchitecture

    if cfg.trainer.skip_memory_check:
        return
    try:
        plan, advice = plan_with_advice(cfg, model_dirs=model_dirs(config_path))
    except UnknownArchitecture as exc:
        print(f"warning: no memory check: {exc}", file=sys.stderr, flush=True)
        return
    if not plan.fits:
        raise RLHFError(verdict(plan, advice) + "Details: rlhf plan " + str(config_path)
                        + "; to start anyway: trainer.skip_memory_check=true")


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _unit(values) -> tuple[int, str]:
    """GiB, or MiB when every value is below 1 GiB (a tiny model's table stays readable)."""
    return (GIB, "GiB") if max(values, default=0) >= GIB else (2**20, "MiB")


def _ranks(ranks: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8, 9) -> "0-3,8-9"."""
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ",".join(runs)


def _layout(spec) -> str:
    p = spec.parallel
    text = f"tp{p.tp} pp{p.pp}" + (f" vpp{p.vpp}" if p.vpp > 1 else "") + f" dp{spec.dp}"
    text += f" ep{p.ep}" if p.ep > 1 else ""
    text += f" cp{p.cp}" if p.cp > 1 else ""
    text += " sp" if p.sequence_parallel else ""
    text += f" {str(spec.dtype).removeprefix('torch.')}"
    if spec.trains:
        text += f" zero1={'on' if spec.zero1 else 'off'} recompute={spec.recompute}"
    if spec.lora is not None:
        text += f" lora r={spec.lora.r} (base frozen: grads+optimizer for the adapters only)"
    off = [k for k in ("params", "grads", "optimizer") if getattr(spec.offload, k)]
    return text + (f" offload={'+'.join(off)}" if off else "")


def format_plan(plan, advice, *, title: str) -> str:
    """The plan as text: roles by stage, devices by phase, the verdict and any advice."""
    hw = plan.hardware
    head = (f"memory plan of {title}: {hw.device_type}, {_gib(hw.device_bytes)} GiB per "
            f"{'GPU' if hw.device_type == 'cuda' else 'machine'} ({hw.source})")
    return "\n".join([head, "", *_role_lines(plan), "", *_device_lines(plan), "",
                      *_host_lines(plan)]) + "\n\n" + verdict(plan, advice)


def _role_lines(plan) -> list[str]:
    kinds = list(plan.stages["actor"][0].state)  # weights, grads, masters, optimizer
    div, unit = _unit(v for stages in plan.stages.values() for s in stages
                      for v in (*s.state.values(), s.activations, sum(s.head.values()),
                                s.forward))

    def f(n):
        return f"{n / div:.2f}"

    rows = [["role", "stage", *kinds, "activations", "head", "forward"]]
    for name, stages in plan.stages.items():
        rows += [[name, str(s.pp_rank), *(f(s.state[k]) for k in kinds), f(s.activations),
                  f(sum(s.head.values())), f(s.forward)] for s in stages]
    lines = [f"per rank of each role, {unit} (state and head exact; activations, forward "
             "estimated):", *_table(rows)]
    if plan.ref_from_actor:
        lines.append("  ref: none built; the actor's frozen base (adapters disabled, actor.lora) "
                     "gives the reference log-probs")
    for name, spec in plan.roles.items():
        lines.append(f"  {name}: {_layout(spec)}, {spec.tokens} tokens per micro-batch")
        first = plan.stages[name][0]
        if spec.zero1:
            rep = first.replicated_state
            lines.append(f"    without zero1 stage 0 would hold masters {f(rep['masters'])}, "
                         f"optimizer {f(rep['optimizer'])}")
        if first.activations_by_recompute:
            lines.append("    stage 0 activations by recompute: " + ", ".join(
                f"{mode} {f(b)}" for mode, b in first.activations_by_recompute.items()))
        last = plan.stages[name][-1]
        for label, ops in (("update", last.head), ("forward", last.head_forward)):
            if ops:
                lines.append(f"    head workspace by op ({label}, last stage): " + ", ".join(
                    f"{op} {f(b)}" for op, b in ops.items()))
    host = "rollout" if any(d.pool == "rollout" for d in plan.devices) else "actor"
    lines.append(f"  vllm per {host} rank: weights {f(plan.vllm['weights'])}, "
                 f"kv cache {f(plan.vllm['kv_cache'])}")
    return lines


def _device_lines(plan) -> list[str]:
    from rlhf.plan.memory import VLLM_RESIDUAL, WAKE_PHASES

    div, unit = _unit(d.peak for d in plan.devices)

    def f(n):
        return f"{n / div:.2f}"

    phases = list(plan.devices[0].phases)
    rows = [["pool", "ranks", *phases, "peak"]]
    for d in plan.devices:
        rows.append([d.pool, _ranks(d.ranks), *(f(d.total(p)) for p in phases),
                     f"{f(d.peak)} ({d.peak_phase})"])
    worst = max(plan.devices, key=lambda d: d.peak)
    parts = sorted(worst.phases[worst.peak_phase].items(), key=lambda kv: -kv[1])
    lines = [f"per device and phase of a step, {unit} (what every colocated role keeps "
             "resident plus the phase's work):", *_table(rows), "",
             f"largest phase, {worst.peak_phase} on ranks {_ranks(worst.ranks)}:",
             *(f"  {k:<22} {f(v):>8}" for k, v in parts)]
    if plan.hardware.device_type != "cuda":
        return lines
    fixed = {k: v for k, v in worst.phases[worst.peak_phase].items()
             if k == "cuda context" or k.startswith("nccl ") or k == VLLM_RESIDUAL}
    lines += ["", f"outside the allocator on ranks {_ranks(worst.ranks)}, every phase: "
              + ", ".join(f"{k} {f(v)}" for k, v in fixed.items())
              + f" ({sum(1 for k in fixed if k.startswith('nccl '))} NCCL communicators, NVLS "
              f"{'on' if plan.nccl_nvls else 'off'}: trainer.nccl_nvls)"
              + (f"; {VLLM_RESIDUAL} from {plan.vllm_residual_source}, less vLLM's own "
                 "communicator (feed back a run's rollout/sleep_residual_gb)"
                 if VLLM_RESIDUAL in fixed else "")]
    lines.append("allocator cache (reserved but free, carried from the previous phase):")
    for d in plan.devices:
        carried = {p: parts["allocator cache"] for p, parts in d.phases.items()
                   if "allocator cache" in parts}
        needed = [p for p in d.emptied if p not in WAKE_PHASES]
        text = (", ".join(f"{p} {f(v)}" for p, v in carried.items()) or "none") + "; emptied " \
            f"before {', '.join(p for p in d.emptied if p in WAKE_PHASES) or 'no phase'} " \
            "(vLLM wakes)" + (f" and {', '.join(needed)} (to fit)" if needed else "")
        lines.append(f"  {d.pool} ranks {_ranks(d.ranks)}: {text}")
    return lines


def _host_lines(plan) -> list[str]:
    from rlhf.plan.memory import HOST_PINNED_SHARE

    if not plan.host:
        why = ("no role offloads" if plan.hardware.device_type == "cuda"
               else "on the CPU the host copies are in the RAM counted above")
        return [f"pinned host memory: none ({why})"]
    cap = plan.host_bytes
    lines = [f"pinned host memory per node (offloaded state's host copies), GiB, of "
             f"{_gib(cap)} GiB RAM ({plan.host_source}); at most {HOST_PINNED_SHARE:.0%} may be "
             "pinned:"]
    for n in plan.host:
        lines.append(f"  {n.pool} node {n.node} (ranks {_ranks(n.ranks)}): {_gib(n.total)} = "
                     + ", ".join(f"{k} {_gib(v)}" for k, v in n.pinned.items()))
    return lines


def verdict(plan, advice) -> str:
    """"fits" or "does not fit", with the changes that would make it fit."""
    from rlhf.plan.memory import HOST_PINNED_SHARE

    cap = plan.hardware.device_bytes
    per = "GPU" if plan.hardware.device_type == "cuda" else "machine"
    host = ""
    if plan.host:
        host = (f"; pinned host memory {_gib(plan.host_peak)} GiB of "
                f"{_gib(HOST_PINNED_SHARE * plan.host_bytes)} GiB allowed per node")
    if plan.fits:
        spare = 1 - plan.peak / cap  # the least headroom of any phase on any device
        return (f"fits: peak {_gib(plan.peak)} GiB of {_gib(cap)} GiB per {per} "
                f"({spare:.0%} headroom in its largest phase){host}.\n")
    text = f"does not fit: peak {_gib(plan.peak)} GiB of {_gib(cap)} GiB per {per}{host}.\n"
    if not plan.host_fits:
        text += ("The offloaded state's pinned host copies exceed the node's RAM: offload less, "
                 "or set trainer.host_memory_gb if this machine's RAM is not the nodes'.\n")
    fitting = [a for a in advice if a.fits]
    if fitting:
        text += "Changes that fit (peak after the change):\n" + "".join(
            f"  {' '.join(a.overrides)}  -> {_gib(a.peak)} GiB\n" for a in fitting)
    else:
        text += "No single change tried fits; the ones that help most:\n" + "".join(
            f"  {' '.join(a.overrides)}  -> {_gib(a.peak)} GiB\n"
            for a in advice[:5] if a.peak < plan.peak)
    return text


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


def to_json(plan, advice) -> dict:
    """The plan as plain data (bytes as integers)."""
    hw = plan.hardware
    return {
        "device_type": hw.device_type, "device_bytes": hw.device_bytes, "source": hw.source,
        "fits": plan.fits, "peak_bytes": plan.peak,
        "roles": {name: {"layout": _layout(spec), "tokens_per_micro_batch": spec.tokens,
                         "stages": [{"pp_rank": s.pp_rank, **s.state,
                                     "activations": s.activations, "logits": s.logits,
                                     "forward": s.forward, "head": s.head,
                                     "head_forward": s.head_forward,
                                     "activations_by_recompute": s.activations_by_recompute,
                                     "replicated_state": s.replicated_state}
                                    for s in plan.stages[name]]}
                  for name, spec in plan.roles.items()},
        "ref_from_actor": plan.ref_from_actor,
        "vllm": plan.vllm, "vllm_residual_source": plan.vllm_residual_source,
        "devices": [{"pool": d.pool, "ranks": list(d.ranks), "peak_bytes": d.peak,
                     "peak_phase": d.peak_phase, "phases": d.phases,
                     "cache_emptied_before": list(d.emptied)} for d in plan.devices],
        "host": {"bytes_per_node": plan.host_bytes, "source": plan.host_source,
                 "fits": plan.host_fits,
                 "nodes": [{"pool": n.pool, "node": n.node, "ranks": list(n.ranks),
                            "pinned": n.pinned, "total": n.total} for n in plan.host]},
        "advice": [{"overrides": list(a.overrides), "peak_bytes": a.peak, "fits": a.fits}
                   for a in advice],
    }
