"""GPU bring-up kit: the checks a fresh GPU box runs in under ten minutes, and their summary.

`examples/gpu_bringup.sh [OUT]` runs `python -m rlhf.bench.bringup --out OUT`. Each step is a
subprocess of the project's own commands with a time limit inside one overall budget; its
output goes to OUT/<step>.log, its JSON lines to OUT/results.jsonl (tagged with the step), and
the summary (one PASS/FAIL/INFO line per check with its figures) to the console and
OUT/summary.txt. Steps, in order: the environment; `rlhf bench attention` (every CUDA kernel
against the fp32 reference); `pytest -m gpu tests`; `rlhf verify-model --device cuda` on a
tiny model; `rlhf bench engine` at ~1B in bf16 (MFU, memory against the plan, offload round
trip, log-probs against transformers and an fp64 reference); the same step in the shape of the
first bring-up run (two micro-batches), for comparison. Only torch and transformers are needed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 570.0  # the whole kit; ten minutes less start-up slack
MFU_TARGET = 0.40
MEMORY_TARGET = 0.10  # |measured / planned - 1|
ENGINE_1B = ["--size", "1b", "--steps", "3", "--tokens", "8192", "--seq-len", "1024"]
# (name, command after `python -m`, seconds at most); {out} is the output folder, {scratch} a
# temporary one for what should not travel with the results (the tiny model).
STEPS = (
    ("attention", ["rlhf.cli", "bench", "attention"], 90),
    ("pytest", ["pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                "--junitxml={out}/pytest.xml", "tests"], 200),
    ("tiny_model", ["rlhf.cli", "make-tiny-model", "{scratch}/tiny", "--layers", "4", "--hidden",
                    "256", "--heads", "8", "--kv-heads", "4", "--intermediate", "512",
                    "--vocab", "1024", "--max-position", "256", "--overwrite"], 60),
    ("verify", ["rlhf.cli", "verify-model", "{scratch}/tiny", "--device", "cuda", "--num-seqs", "8",
                "--max-len", "128"], 120),
    ("engine", ["rlhf.cli", "bench", "engine", *ENGINE_1B, "--micro-batches", "4"], 300),
    ("engine_2mb", ["rlhf.cli", "bench", "engine", *ENGINE_1B, "--micro-batches", "2",
                    "--no-logprobs", "--no-offload"], 120),
)
# Run in place of a step that printed no "step" line: the engine bench with the SDPA kernel, so
# a failing new kernel still leaves the speed and memory figures.
FALLBACKS = {"engine": ("engine_sdpa", ["--attention-kernel", "sdpa_split"])}


# --smoke: the same steps in shapes a CPU runs in a minute or two, to test the kit itself.
SMOKE = {"attention": ["--heads", "8", "--kv-heads", "2", "--head-dim", "16"],
         "verify": ["--device", "cpu", "--num-seqs", "3", "--max-len", "16"],
         "tiny_model": ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--vocab",
                        "512"]}
SMOKE_ENGINE = ["--size", "tiny", "--steps", "1", "--tokens", "256", "--seq-len", "64"]


def steps(*, smoke: bool) -> list[tuple[str, list[str], float]]:
    """STEPS, or with --smoke their small CPU shapes (later flags win in argparse)."""
    out = []
    for name, command, limit in STEPS:
        if smoke and name.startswith("engine"):
            command = command + SMOKE_ENGINE
        elif smoke:
            command = command + SMOKE.get(name, [])
        out.append((name, command, limit))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.bench.bringup", description=__doc__)
    parser.add_argument("--out", required=True, help="folder for the logs and JSON lines")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all steps")
    parser.add_argument("--only", nargs="*", default=None, help="run only these steps")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--smoke", action="store_true",
                        help="small CPU shapes, to test the kit itself (not a GPU check)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    results.unlink(missing_ok=True)
    _append(results, {"step": "env", **environment()})
    deadline = time.monotonic() + args.budget
    scratch = tempfile.mkdtemp(prefix="rlhf-bringup-")
    for name, command, limit in steps(smoke=args.smoke):
        if args.only is not None and name not in args.only:
            continue
        remaining = deadline - time.monotonic()
        if remaining < 20:
            _append(results, {"step": name, "kind": "status", "rc": None,
                              "skipped": "the kit's time budget ran out"})
            continue
        command = [a.format(out=out, scratch=scratch) for a in command]
        run_step(name, command, out=out, results=results, python=args.python,
                 timeout_s=min(limit, remaining))
        if name in FALLBACKS and not _has_kind(results, name, "step"):
            fallback, extra = FALLBACKS[name]
            remaining = deadline - time.monotonic()
            if remaining >= 20:
                run_step(fallback, command + extra, out=out, results=results,
                         python=args.python, timeout_s=min(limit, remaining))
    shutil.rmtree(scratch, ignore_errors=True)
    lines = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
    text, ok = summarize(lines, out=out)
    (out / "summary.txt").write_text(text + "\n")
    print(text, flush=True)
    return 0 if ok else 1


def environment() -> dict:
    """Versions and devices, read in this process (torch and transformers only)."""
    import importlib.util

    import torch

    env = {"kind": "env", "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "flash_attn": importlib.util.find_spec("flash_attn") is not None,
           "ray": importlib.util.find_spec("ray") is not None,
           "vllm": importlib.util.find_spec("vllm") is not None}
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # a CPU build has no NCCL
        env["nccl"] = f"none ({type(exc).__name__})"
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    from rlhf.models.varlen_kernels import torch_varlen_fn

    env["torch_varlen"] = torch_varlen_fn() is not None
    return env


def run_step(name: str, command: list[str], *, out: Path, results: Path, python: str,
             timeout_s: float) -> None:
    """Run `python -m command...` from the source tree; log it; keep its JSON lines."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.monotonic()
    log = out / f"{name}.log"
    print(f"[bringup] {name}: {' '.join(command)} (at most {timeout_s:.0f} s)", flush=True)
    try:
        proc = subprocess.run([python, "-m", *command], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout_s)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        stdout, stderr = _text(exc.stdout), _text(exc.stderr)
    log.write_text(f"$ {' '.join(command)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                _append(results, {"step": name, **json.loads(line)})
            except json.JSONDecodeError:
                pass
    _append(results, {"step": name, "kind": "status", "rc": rc,
                      "seconds": round(time.monotonic() - start, 1),
                      "stderr_tail": stderr[-1500:] if rc != 0 else ""})


def _has_kind(results: Path, step: str, kind: str) -> bool:
    lines = (json.loads(x) for x in results.read_text().splitlines() if x.strip())
    return any(x.get("step") == step and x.get("kind") == kind for x in lines)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _append(path: Path, line: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


# ---- summary -----------------------------------------------------------------------------------


def summarize(lines: list[dict], *, out: Path | None = None) -> tuple[str, bool]:
    """The kit's summary text and whether every check passed (INFO lines do not count)."""
    by_step: dict[str, list[dict]] = {}
    for line in lines:
        by_step.setdefault(line["step"], []).append(line)
    rows: list[tuple[str, str, str]] = []
    env = by_step.get("env", [{}])[0]
    head = (f"GPU bring-up: {env.get('device')} x{env.get('gpus')}, torch {env.get('torch')} "
            f"(CUDA {env.get('cuda')}, NCCL {env.get('nccl')}), transformers "
            f"{env.get('transformers')}, python {env.get('python')}; flash-attn "
            f"{_yes(env.get('flash_attn'))}, torch varlen {_yes(env.get('torch_varlen'))}, ray "
            f"{_yes(env.get('ray'))}, vllm {_yes(env.get('vllm'))}")
    # A step with no lines at all was left out with --only; one that ran or was skipped for
    # time has at least its status line.
    if "attention" in by_step:
        rows += _attention_rows(by_step["attention"])
    if "pytest" in by_step:
        rows += _pytest_rows(by_step["pytest"], out)
    if "verify" in by_step or "tiny_model" in by_step:
        rows += _verify_rows(by_step.get("verify", []) + by_step.get("tiny_model", []))
    for step in ("engine", "engine_sdpa", "engine_2mb"):
        if step in by_step:
            rows += _engine_rows(step, by_step[step], info_only=step != "engine")
    text = "\n".join([head] + [f"{v:<5} {name:<22} {figures}" for v, name, figures in rows])
    return text, all(v != "FAIL" for v, _, _ in rows)


def _yes(flag) -> str:
    return "yes" if flag else "no"


def _status(lines: list[dict]) -> dict | None:
    return next((x for x in lines if x.get("kind") == "status"), None)


def _failed_step(name: str, lines: list[dict]) -> list[tuple[str, str, str]]:
    """A FAIL row when the step did not run or exited badly without its own lines."""
    status = _status(lines)
    if status is None:
        return [("FAIL", name, "did not run")]
    if status.get("skipped"):
        return [("FAIL", name, f"skipped: {status['skipped']}")]
    tail = (status.get("stderr_tail") or "").strip().splitlines()
    return [("FAIL", name, f"exit {status.get('rc')} after {status.get('seconds')} s: "
                           f"{tail[-1] if tail else 'no output'}")]


def _attention_rows(lines):
    agreements = [x for x in lines if x.get("kind") == "agreement"]
    if not agreements:
        return _failed_step("attention agreement", lines)
    rows = []
    for kernel in dict.fromkeys(x["kernel"] for x in agreements):
        mine = [x for x in agreements if x["kernel"] == kernel]
        worst = {}
        for x in mine:
            err = max(x["relative_error"].values()) if "relative_error" in x else float("inf")
            worst[x["dtype"]] = max(worst.get(x["dtype"], 0.0), err)
        chosen = sorted({x["dtype"] for x in mine if x["chosen"]})
        tolerance = {x["dtype"]: x["tolerance"] for x in mine}
        figures = ", ".join(f"{d} {e:.2g} (tol {tolerance[d]:g})" for d, e in worst.items())
        errors = [x["error"] for x in mine if "error" in x]
        rows.append(("PASS" if all(x["passed"] for x in mine) else "FAIL", f"attention {kernel}",
                     f"worst rel. error {figures}; chosen for {', '.join(chosen) or 'none'}"
                     + (f"; raised: {errors[0]}" if errors else "")))
    speeds = [x for x in lines if x.get("kind") == "speed"]
    for shape in dict.fromkeys(x["shape"] for x in speeds):
        shown = [x for x in speeds if x["shape"] == shape]
        done = [x for x in shown if "fwd_bwd_ms" in x]
        size = f"{done[0]['tokens']} tokens in {done[0]['sequences']} seqs, " if done else ""
        rows.append(("INFO", f"attention speed {shape}", size + "bf16 fwd+bwd: " + ", ".join(
            f"{x['kernel']} {x['fwd_bwd_ms']} ms" if "fwd_bwd_ms" in x
            else f"{x['kernel']} raised {x['error']}" for x in shown)))
    return rows


def _pytest_rows(lines, out: Path | None):
    status = _status(lines)
    xml = out / "pytest.xml" if out is not None else None
    if status is None or xml is None or not xml.exists():
        return _failed_step("pytest -m gpu", lines)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed, reasons = [], {}
    root = ET.parse(xml).getroot()
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            if case.find(tag) is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
        skip = case.find("skipped")
        if skip is not None:
            reason = skip.get("message") or ""
            if reason == "collection skipped" and "needs " in (skip.text or ""):
                # a whole module or folder: "<file> needs ray, which ..." -> "needs ray (module)"
                reason = skip.text.split("needs ", 1)[1].split(",")[0]
                reason = f"module needs {reason}"
            reason = reason[:60]
            reasons[reason] = reasons.get(reason, 0) + 1
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    figures = (f"{passed} passed, {counts['failures'] + counts['errors']} failed, "
               f"{counts['skipped']} skipped ("
               + "; ".join(f"{n}x {r}" for r, n in sorted(reasons.items(), key=lambda i: -i[1]))
               + ")")
    if failed:
        figures += "; failed: " + ", ".join(failed[:5])
    ok = status.get("rc") == 0 and passed > 0
    return [("PASS" if ok else "FAIL", "pytest -m gpu", figures)]


def _verify_rows(lines):
    report = next((x for x in lines if "max_abs_diff" in x), None)
    if report is None:
        return _failed_step("verify-model cuda", [x for x in lines if x["step"] == "verify"]
                            or lines)
    diffs = ", ".join(f"{k} {v:.2g}" for k, v in report["max_abs_diff"].items())
    return [("PASS" if report["passed"] else "FAIL", "verify-model cuda",
             f"{report['layout']['nproc']} NCCL rank(s) on {report.get('device')}, TF32 "
             f"{_yes(report.get('tf32'))}; max abs diff {diffs} (within {report['factor']:g}x "
             f"transformers' fp32 error + {report['floor']:g}; worst grad {report['worst_grad']})")]


def _engine_rows(step: str, lines, *, info_only: bool = False):
    kinds = {x.get("kind"): x for x in lines}
    if "step" not in kinds:
        return _failed_step(f"bench {step}", lines)
    config, speed = kinds.get("config", {}), kinds["step"]
    mfu = speed.get("mfu")
    verdict = "INFO" if info_only or mfu is None else ("PASS" if mfu >= MFU_TARGET else "FAIL")
    micro_batches = speed.get('micro_batches')
    tokens_per_mb = config.get('tokens_per_step', 0) // max(1, micro_batches or 1)
    rows = [(verdict, f"{step} MFU",
             f"{mfu} (target >= {MFU_TARGET}) against {speed.get('peak_tflops_per_s')} TFLOP/s; "
             f"{config.get('params', 0) / 1e9:.2f}B {config.get('dtype')}, "
             f"{micro_batches} x {tokens_per_mb} "
             f"tokens, step {speed['step_s']} s (fwd+bwd {speed.get('forward_backward_s')} s, "
             f"optimizer {speed.get('optimizer_step_s')} s), {speed['tokens_per_s']:.0f} tok/s, "
             f"{speed['model_tflops_per_s']} TFLOP/s, attention {speed.get('attention_kernel')}")]
    memory = kinds.get("memory")
    if memory and "peak_ratio" in memory:
        ratio = memory["peak_ratio"]
        ok = abs(ratio - 1) <= MEMORY_TARGET
        rows.append(("INFO" if info_only else ("PASS" if ok else "FAIL"), f"{step} memory",
                     f"max allocated {memory['measured_peak_bytes'] / 1e9:.2f} GB vs planned "
                     f"{memory['planned_peak_bytes'] / 1e9:.2f} GB (ratio {ratio}, target within "
                     f"{MEMORY_TARGET:.0%}): state {memory['planned_state_bytes'] / 1e9:.2f} GB "
                     f"planned / {memory['held_state_bytes'] / 1e9:.2f} held, layers "
                     f"{memory['planned_layer_activation_bytes'] / 1e9:.2f} GB, head "
                     f"{memory['planned_head_bytes'] / 1e9:.2f} GB"))
    offload = kinds.get("offload")
    if offload:
        rows.append(("PASS" if offload["bit_exact_samples"] else "FAIL", f"{step} offload",
                     f"{offload['bytes'] / 1e9:.2f} GB {'pinned' if offload['pinned'] else 'unpinned'}: "
                     f"to host {offload['to_host_gb_per_s']} GB/s, to device "
                     f"{offload['to_device_gb_per_s']} GB/s (first trip "
                     f"{offload['first_to_host_gb_per_s']} / {offload['first_to_device_gb_per_s']}); "
                     f"plain copy {offload['plain_to_host_gb_per_s']} / "
                     f"{offload['plain_to_device_gb_per_s']} GB/s; bit-exact "
                     f"{_yes(offload['bit_exact_samples'])}"))
    logprobs = kinds.get("logprobs")
    if logprobs:
        pairs = {k: v for k, v in logprobs.items() if "_vs_" in k}
        ours, theirs = (pairs["engine_bf16_vs_transformers_fp64"],
                        pairs["transformers_bf16_vs_transformers_fp64"])
        fp32 = pairs["engine_fp32_vs_transformers_fp64"]
        # Within transformers' own bf16 noise, and exact in fp32.
        ok = (ours["mean_abs_diff"] <= 1.5 * theirs["mean_abs_diff"] + 1e-4
              and fp32["max_abs_diff"] <= 1e-3)
        rows.append(("PASS" if ok else "FAIL", f"{step} log-probs",
                     f"{logprobs['tokens']} tokens, max / mean abs diff: " + "; ".join(
                         f"{k.replace('transformers', 'hf')} {v['max_abs_diff']:.3g} / "
                         f"{v['mean_abs_diff']:.3g}" for k, v in pairs.items())))
    status = _status(lines)
    if status and status.get("rc") not in (0, None):
        rows += _failed_step(f"bench {step}", lines)
    return rows


if __name__ == "__main__":
    sys.exit(main())
