"""The first run on a multi-GPU machine: two steps of a job, then a report of what to check.

`examples/gpu_first_run.sh [--cpu] [CONFIG] [k=v ...]` runs `python -m rlhf.bench.first_run`:
`rlhf train` for two steps (CONFIG, default the shipped 7B job; `--cpu`: the tiny CPU job of
configs/first_run_cpu.yaml, its data built if missing) with its output in RUN/first_run.log,
then the report, printed and written to RUN/first_run_report.txt. `rlhf run-report RUN`
reports on a run folder again. The report reads RUN/metrics.jsonl, RUN/config.yaml and the
memory plan (`rlhf plan`) of that config, and shows: the sync receipts and log-prob gap
statistics of every step, each phase's device memory against the plan, vLLM's sleep figures,
the NCCL communicators and their memory, pinned host memory, and the seconds of every phase.
A metric the run did not report (the CPU reports no device memory) is shown as such, never an
error. It exits 1 naming the first thing that went wrong, in step order (FINDINGS).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf.plan.memory import METHOD_PHASES, phase_peaks_gib

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIG = "configs/qwen2.5-7b_ppo_multigpu.yaml"  # in the checkout (ROOT)
CPU_CONFIG = "configs/first_run_cpu.yaml"
STEPS = 2
MEMORY_MARGIN = 0.10  # measured device memory may exceed the plan by this share
LOG_LINES = 25  # of the run's output shown when it failed
REPORT_FILE, LOG_FILE = "first_run_report.txt", "first_run.log"
GIB = 2**30
NOT_REPORTED = "not reported"
# What each kind of finding means, in the order they are checked within a step.
FINDINGS = {
    "run failed": "the run stopped before its last step",
    "sync incomplete": "a weight sync left a module without its receipt",
    "gap over limit": "vLLM's log-probs are too far from the trainer's after a sync",
    "memory over plan": "a phase used more device memory than the plan by more than the margin",
    "vllm residual over plan": "vLLM keeps more beside weights and KV cache than the plan counts",
    "nccl over plan": "NCCL communicators hold more device memory than the plan counts",
}

@dataclass(frozen=True)
class Finding:
    """Something that went wrong: its kind (a key of FINDINGS), the step, and what was seen."""

    kind: str
    step: int
    text: str

    def __str__(self) -> str:
        return f"{self.kind} (step {self.step}): {self.text}"


@dataclass
class Report:
    """The report's lines and what went wrong, first first."""

    lines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.findings else 0

    def text(self) -> str:
        ordered = sorted(self.findings, key=lambda f: (f.step, list(FINDINGS).index(f.kind)))
        if ordered:
            verdict = [f"FAIL: {ordered[0]}"] + [f"  then: {f}" for f in ordered[1:]]
        else:
            verdict = ["PASS: every step ran, every check held"]
        return "\n".join(self.lines + [""] + verdict) + "\n"


# ---- the report ----------------------------------------------------------------------------------

def build_report(records: list[dict], *, total_steps: int, gap_limit: float,
                 gap_dtype: torch.dtype,
                 plan=None, plan_note: str = "", log_tail: list[str] = (),
                 exit_code: int | None = None, device_gib: float | None = None) -> Report:
    """The report of a run's metric records (one per step), its planned steps and gap limit,
    its memory plan (None: `plan_note` says why there is none), the last lines of its output
    and the exit status of `rlhf train` (None: not known)."""
    report = Report()
    records = [r for r in records if r.get("step", 0) >= 1]
    _steps(report, records, total_steps=total_steps, log_tail=log_tail, exit_code=exit_code)
    _sync(report, records)
    _gaps(report, records, limit=gap_limit, dtype=gap_dtype)
    _memory(report, records, plan=plan, plan_note=plan_note, device_gib=device_gib)
    _sleep(report, records, plan=plan)
    _nccl(report, records, plan=plan)
    _pinned(report, records, plan=plan)
    _timings(report, records)
    return report


def _steps(report: Report, records: list[dict], *, total_steps: int, log_tail,
           exit_code: int | None) -> None:
    done = [r["step"] for r in records]
    report.lines.append(f"steps: {len(done)} of {total_steps} logged"
                        + (f" (exit status {exit_code})" if exit_code is not None else ""))
    if len(done) < total_steps or exit_code:
        last = "\n".join(f"    {line}" for line in log_tail) or "    (no output found)"
        report.findings.append(Finding(
            "run failed", (done[-1] + 1) if done else 1,
            f"{len(done)} of {total_steps} steps logged; the run's last lines:\n{last}"))


def _number(record: dict, key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _sync(report: Report, records: list[dict]) -> None:
    """sync/receipts: the modules vLLM should have received; sync/receipts_complete: how many
    got every tensor (a 0/1 flag when sync/receipts is absent)."""
    report.lines += ["", "sync receipts:"]
    for r in records:
        step, expected = r["step"], _number(r, "sync/receipts")
        complete = _number(r, "sync/receipts_complete")
        if _number(r, "sync/skipped"):
            report.lines.append(f"  step {step}: no sync (vLLM holds these weights already)")
        elif complete is None:
            report.lines.append(f"  step {step}: {NOT_REPORTED}")
        elif expected is None:
            report.lines.append(f"  step {step}: {'complete' if complete else 'INCOMPLETE'}")
            if not complete:
                report.findings.append(Finding("sync incomplete", step, "a module's receipt "
                                               "is incomplete (sync/receipts_complete=0)"))
        else:
            report.lines.append(f"  step {step}: {complete:g} of {expected:g} modules complete")
            if complete < expected:
                report.findings.append(Finding(
                    "sync incomplete", step, f"{expected - complete:g} of {expected:g} modules "
                    "did not receive every tensor (sync/receipts_complete < sync/receipts)"))


def gap_problem(record: dict, *, limit: float, dtype: torch.dtype) -> str | None:
    """Why the trainer's own check (rlhf.rollout.sampling) refuses this step's gap, or None."""
    from rlhf.rollout.sampling import GAP_STATISTIC, LogprobGapError, check_logprob_gap

    value = _number(record, f"rollout/logprob_gap_{GAP_STATISTIC}")
    if value is None:
        return None
    try:
        check_logprob_gap(value, limit=limit, dtype=dtype)
    except LogprobGapError as e:
        return str(e)
    return None


def _gaps(report: Report, records: list[dict], *, limit: float, dtype: torch.dtype) -> None:
    report.lines += ["", f"log-prob gap after sync (stops above p99 {limit:g}: "
                     "rollout.max_logprob_gap_p99):"]
    for r in records:
        gaps = {k.removeprefix("rollout/logprob_gap_"): v for k, v in r.items()
                if k.startswith("rollout/logprob_gap_")}
        text = "  ".join(f"{k} {v:.4g}" for k, v in gaps.items()) or NOT_REPORTED
        synced = not _number(r, "sync/skipped")
        report.lines.append(f"  step {r['step']}: {text}"
                            + ("" if synced or not gaps else " (no sync before it: not checked)"))
        if synced and (problem := gap_problem(r, limit=limit, dtype=dtype)):
            report.findings.append(Finding("gap over limit", r["step"], problem))


def _memory(report: Report, records: list[dict], *, plan, plan_note: str,
            device_gib: float | None) -> None:
    """Device memory per phase: used = the card's size - the least free on any rank as the
    phase's call ended, against the plan's fullest device in that phase."""
    cuda = plan is not None and plan.hardware.device_type == "cuda"
    planned = phase_peaks_gib(plan) if plan is not None else {}
    total = device_gib or (plan.hardware.device_bytes / GIB if cuda else None)
    head = "device memory per phase, GiB"
    if plan is None:
        head += f" (no plan: {plan_note})"
    elif cuda:
        head += (f" (card {total:.2f}; used = card - free; fails above plan x "
                 f"{1 + MEMORY_MARGIN:g})")
    else:
        head += (" (CPU: no device memory; host RSS holds Python, torch and vLLM themselves, "
                 "so it is not checked against the plan)")
    rows = [["step", "phase", "plan", "used", "free", "allocated", "reserved", "host rss"]]
    for r in records:
        for method, phase in METHOD_PHASES.items():
            stats = {k.rsplit("/", 1)[1]: v for k, v in r.items()
                     if k.startswith(f"memory/{method}/")}
            if not stats:
                continue
            free = stats.get("free_gb")
            used = total - free if (free is not None and total is not None) else None
            plan_gib = planned.get(phase)
            rows.append([str(r["step"]), phase, _gib(plan_gib), _gib(used), _gib(free),
                         _gib(stats.get("allocated_gb")), _gib(stats.get("reserved_gb")),
                         _gib(stats.get("host_rss_gb"))])
            if cuda and used is not None and plan_gib and used > plan_gib * (1 + MEMORY_MARGIN):
                report.findings.append(Finding(
                    "memory over plan", r["step"], f"{phase} ({method}) used {used:.2f} GiB, "
                    f"{used / plan_gib - 1:+.0%} over the plan's {plan_gib:.2f} GiB"))
    report.lines += ["", head + ":"]
    report.lines += _table(rows, left=2) if len(rows) > 1 else [f"  {NOT_REPORTED}"]


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _per_step(report: Report, records: list[dict], keys: tuple[str, ...], title: str,
              when_missing: str) -> None:
    report.lines += ["", title + ":"]
    for r in records:
        values = [f"{k.rsplit('/', 1)[1]} {r[k]:.4g}" for k in keys if _number(r, k) is not None]
        report.lines.append(f"  step {r['step']}: " + ("  ".join(values) or when_missing))


def _plan_residual(plan) -> float | None:
    """GiB the plan counts for what vLLM keeps beyond weights and KV cache on its fullest
    device: its `vllm residual` line plus vLLM's own communicator, as the run measures it."""
    from rlhf.plan.memory import VLLM_RESIDUAL

    kept = [parts.get(VLLM_RESIDUAL, 0) + parts.get("nccl vllm tp", 0)
            for device in (plan.devices if plan is not None else ())
            for parts in list(device.phases.values())[:1] if VLLM_RESIDUAL in parts]
    return max(kept) / GIB if kept else None


def _sleep(report: Report, records: list[dict], *, plan) -> None:
    planned = _plan_residual(plan)
    title = "vLLM sleep (GiB freed by sleep, GiB it keeps while asleep)"
    if planned is not None:
        title += f" (plan: keeps {planned:.2f} GiB, {plan.vllm_residual_source})"
    _per_step(report, records, ("rollout/sleep_freed_gb", "rollout/sleep_residual_gb"), title,
              f"{NOT_REPORTED} (vLLM on CPU does not sleep)")
    for r in records:
        measured = _number(r, "rollout/sleep_residual_gb")
        if planned is not None and measured is not None and measured > planned * (
                1 + MEMORY_MARGIN):
            report.findings.append(Finding(
                "vllm residual over plan", r["step"], f"rollout/sleep_residual_gb "
                f"{measured:.2f} GiB against the plan's {planned:.2f} GiB: set "
                f"rollout.sleep_residual_gb={measured:.1f} and run `rlhf plan` again"))


def _plan_nccl(plan) -> tuple[float, int] | None:
    """(GiB, communicators) the plan reserves for NCCL on its fullest device, or None."""
    best = None
    for device in plan.devices if plan is not None else ():
        parts = next(iter(device.phases.values()), {})
        nccl = {k: v for k, v in parts.items() if k.startswith("nccl ")}
        if nccl and (best is None or sum(nccl.values()) / GIB > best[0]):
            best = (sum(nccl.values()) / GIB, len(nccl))
    return best


def _nccl(report: Report, records: list[dict], *, plan) -> None:
    planned = _plan_nccl(plan)
    title = "NCCL communicators and their device memory"
    if planned:
        title += f" (plan: {planned[0]:.2f} GiB over {planned[1]} kinds of communicator)"
    _per_step(report, records, ("memory/nccl_communicators", "memory/nccl_gb"), title,
              f"{NOT_REPORTED} (gloo on CPU)")
    for r in records:
        measured = _number(r, "memory/nccl_gb")
        if planned and measured is not None and measured > planned[0] * (1 + MEMORY_MARGIN):
            report.findings.append(Finding(
                "nccl over plan", r["step"], f"memory/nccl_gb {measured:.2f} GiB against the "
                f"plan's {planned[0]:.2f} GiB"))


def _pinned(report: Report, records: list[dict], *, plan) -> None:
    title = "pinned host memory (GiB) and the seconds spent pinning"
    if plan is not None and plan.host:
        title += f" (plan: {plan.host_peak / GIB:.2f} GiB on the fullest node)"
    _per_step(report, records, ("memory/pinned_gb", "timing/pin_s"), title,
              f"{NOT_REPORTED} (nothing pinned: no offload, or the CPU)")


def _timings(report: Report, records: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in records for k in r if k.startswith("timing/")
                              and k != "timing/pin_s"))
    report.lines += ["", "seconds per phase:"]
    if not keys:
        report.lines.append(f"  {NOT_REPORTED}")
        return
    rows = [["phase"] + [f"step {r['step']}" for r in records]]
    for key in keys:
        rows.append([key.removeprefix("timing/")]
                    + [f"{r[key]:.2f}" if _number(r, key) is not None else "-" for r in records])
    report.lines += _table(rows)


def _table(rows: list[list[str]], *, left: int = 1) -> list[str]:
    """Rows of cells, the first `left` columns left-aligned and the rest right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) if i < left else c.rjust(w)
                             for i, (c, w) in enumerate(zip(row, widths))) for row in rows]


# ---- a run folder --------------------------------------------------------------------------------

def report_run(run_dir: str | Path, *, log: Path | None = None,
               exit_code: int | None = None) -> Report:
    """The report of run folder `run_dir` (its config.yaml, metrics.jsonl, the plan of that
    config); `log`: the run's output (default RUN/first_run.log, else RUN/logs/driver.log)."""
    from rlhf.config import load_config
    from rlhf.errors import RLHFError
    from rlhf.trainer.loggers import read_metrics

    run = Path(run_dir)
    config = run / "config.yaml"
    if not config.is_file():
        raise RLHFError(f"{run} holds no config.yaml: give the trainer.output_dir of a run that "
                        "started (`rlhf train` writes it before the first step)")
    cfg = load_config(config)
    plan, note = None, ""
    try:
        from rlhf.plan.memory import plan_job

        plan = plan_job(cfg)
    except Exception as e:  # noqa: BLE001 - the report goes on without a plan, saying why
        note = f"{type(e).__name__}: {e}"
    if log is None:
        log = next((p for p in (run / LOG_FILE, run / "logs" / "driver.log") if p.is_file()),
                   None)
    tail = log.read_text(errors="replace").splitlines()[-LOG_LINES:] if log else []
    from rlhf.rollout.sampling import logprob_gap_limit
    from rlhf.trainer.device import actor_dtype

    dtype = actor_dtype(cfg)
    return build_report(read_metrics(run), total_steps=cfg.trainer.total_steps,
                        gap_limit=logprob_gap_limit(cfg.rollout, dtype), gap_dtype=dtype,
                        plan=plan, plan_note=note,
                        log_tail=tail, exit_code=exit_code, device_gib=_local_device_gib())


def _local_device_gib() -> float | None:
    """This machine's first GPU in GiB (the driver of a first run sits on a GPU node), or None."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[1] / GIB
    except Exception:  # noqa: BLE001 - no usable CUDA: the plan's card size is used
        pass
    return None


def write_report(run_dir: Path, report: Report) -> None:
    text = report.text()
    print(text, end="", flush=True)
    (run_dir / REPORT_FILE).write_text(text, encoding="utf-8")


# ---- the first run -------------------------------------------------------------------------------

def prepare_cpu_data(train_files) -> None:
    """Write the quickstart's "max of two numbers" rows into each missing data file."""
    from rlhf.demo.arithmetic_data import ArithTask, write_arith_dataset

    for name in train_files:
        if not Path(name).is_file():
            write_arith_dataset(Path(name), task=ArithTask(form="max", max_value=99), n=64,
                                seed=0, kind="rl", split="train")


def first_run(config: str, overrides: list[str], *, cpu: bool) -> int:
    """Two steps of `config` with `overrides` (into a sibling folder of its output_dir named
    *-first-run, unless CPU or trainer.output_dir is given), then the report; its exit code."""
    from rlhf.config import load_config
    from rlhf.config.paths import resolve_paths

    cfg = load_config(config, overrides)
    ours = [f"trainer.total_steps={STEPS}", "trainer.val_every=0", "trainer.overwrite=true"]
    if not cpu and not any(o.startswith("trainer.output_dir=") for o in overrides):
        ours.append(f"trainer.output_dir={cfg.trainer.output_dir.rstrip('/')}-first-run")
    args = [*ours, *overrides]  # the caller's overrides come last and win
    cfg = resolve_paths(load_config(config, args), base=Path.cwd())
    if cpu:
        prepare_cpu_data(cfg.data.train_files)
    run = Path(cfg.trainer.output_dir)
    run.mkdir(parents=True, exist_ok=True)
    log = run / LOG_FILE  # not a run entry: trainer.overwrite leaves it, and it is rewritten
    command = [sys.executable, "-m", "rlhf.cli", "train", config, *args, "--no-progress"]
    print(f"first run: {' '.join(command[1:])}\n  output: {log}", flush=True)
    started = time.time()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        code = proc.wait()
    written = run / "config.yaml"  # by `rlhf train` before step 1; an older one is another run's
    if not written.is_file() or written.stat().st_mtime < started - 1:
        tail = log.read_text(errors="replace").splitlines()[-LOG_LINES:]
        print("\nFAIL: run failed (step 1): `rlhf train` stopped before its first step:\n"
              + "\n".join(f"    {line}" for line in tail), flush=True)
        return 1
    report = report_run(run, log=log, exit_code=code)
    print(f"\n---- first-run report ({run / REPORT_FILE}) ----", flush=True)
    write_report(run, report)
    return report.exit_code


# ---- command lines -------------------------------------------------------------------------------

def add_command(commands: argparse._SubParsersAction) -> None:
    """Register `run-report` on the top-level subparsers."""
    parser = commands.add_parser(
        "run-report", help="report a run's sync receipts, log-prob gaps, memory against "
                                 "the plan, NCCL, pinned memory and phase times; exit 1 naming "
                                 "the first thing that went wrong (examples/gpu_first_run.sh)")
    parser.add_argument("run_dir", help="the run's trainer.output_dir")
    parser.add_argument("--log", type=Path, help="the run's output (default RUN/first_run.log, "
                                                 "else RUN/logs/driver.log)")
    parser.set_defaults(run=_report_command)


def _report_command(args) -> int:
    report = report_run(args.run_dir, log=args.log)
    write_report(Path(args.run_dir), report)
    return report.exit_code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="examples/gpu_first_run.sh", description="two steps of a job, then the first-run "
                                                      "report (rlhf.bench.first_run)")
    parser.add_argument("--cpu", action="store_true",
                        help=f"the tiny CPU job ({CPU_CONFIG}), its data built if missing")
    parser.add_argument("config", nargs="?", help=f"job config (default {GPU_CONFIG}; with "
                                                  f"--cpu {CPU_CONFIG})")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    if args.config and "=" in args.config:  # only overrides were given
        args.overrides.insert(0, args.config)
        args.config = None
    config = args.config or str(ROOT / (CPU_CONFIG if args.cpu else GPU_CONFIG))
    from rlhf.errors import RLHFError

    try:
        return first_run(config, args.overrides, cpu=args.cpu)
    except RLHFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
