"""The GPU bring-up kit (rlhf.bench.bringup): its verdicts on recorded figures, its steps run
for real in their small CPU shapes, and an import path that needs neither Ray nor vLLM."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.bench import bringup

pytestmark = pytest.mark.timeout(600)

ROOT = str(Path(__file__).resolve().parents[3])
# As on a bare GPU box: these imports fail and importlib.util.find_spec says they are absent.
BARE = "import sys\nfor m in ('ray', 'vllm', 'flash_attn'): sys.modules[m] = None\n"

ENV = {"step": "env", "kind": "env", "device": "NVIDIA H100 80GB HBM3", "gpus": 1,
       "torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.28.9", "transformers": "5.17.0",
       "python": "3.12", "flash_attn": False, "torch_varlen": True}


def _engine(*, mfu, measured, planned, ours_mean=0.15, theirs_mean=0.14, exact=True):
    pair = lambda mx, mean: {"max_abs_diff": mx, "mean_abs_diff": mean}  # noqa: E731
    return [
        {"step": "engine", "kind": "config", "params": 1_235_814_400, "dtype": "bfloat16",
         "tokens_per_step": 32768},
        {"step": "engine", "kind": "step", "step_s": 0.8, "tokens_per_s": 40960.0,
         "model_tflops_per_s": 311.0, "peak_tflops_per_s": 989.0, "mfu": mfu,
         "micro_batches": 4, "forward_backward_s": 0.7, "optimizer_step_s": 0.1,
         "attention_kernel": "torch_varlen"},
        {"step": "engine", "kind": "memory", "planned_state_bytes": 22_240_000_000,
         "held_state_bytes": 22_240_000_000, "planned_layer_activation_bytes": 10e9,
         "planned_head_bytes": 4.2e9, "measured_peak_bytes": measured,
         "planned_peak_bytes": planned, "peak_ratio": round(measured / planned, 4)},
        {"step": "engine", "kind": "offload", "bytes": 22_240_000_000, "pinned": True,
         "bit_exact_samples": exact, "first_to_host_gb_per_s": 5.0,
         "first_to_device_gb_per_s": 20.0, "to_host_gb_per_s": 24.0, "to_device_gb_per_s": 25.0,
         "plain_to_host_gb_per_s": 26.0, "plain_to_device_gb_per_s": 27.0},
        {"step": "engine", "kind": "logprobs", "tokens": 6144,
         "engine_bf16_vs_transformers_bf16": pair(0.88, 0.15),
         "engine_bf16_vs_transformers_fp64": pair(0.9, ours_mean),
         "transformers_bf16_vs_transformers_fp64": pair(0.9, theirs_mean),
         "engine_fp32_vs_transformers_fp64": pair(2e-4, 1e-5)},
        {"step": "engine", "kind": "status", "rc": 0, "seconds": 100.0},
    ]


def _rows(text):
    return {line[6:28].strip(): line[:5].strip() for line in text.splitlines()[1:]}


def test_the_targets_decide_pass_and_fail():
    text, ok = bringup.summarize([ENV, *_engine(mfu=0.294, measured=47.74e9, planned=36.47e9)])
    rows = _rows(text)
    assert not ok and rows["engine MFU"] == "FAIL" and rows["engine memory"] == "FAIL"
    assert rows["engine offload"] == "PASS" and rows["engine log-probs"] == "PASS"
    assert "0.294 (target >= 0.4)" in text and "ratio 1.309" in text
    assert "H100" in text.splitlines()[0] and "torch varlen yes" in text.splitlines()[0]
    text, ok = bringup.summarize([ENV, *_engine(mfu=0.41, measured=38e9, planned=36.47e9)])
    assert ok and set(_rows(text).values()) == {"PASS"}, text


def test_bf16_log_probs_fail_outside_transformers_own_noise():
    lines = _engine(mfu=0.41, measured=38e9, planned=36.47e9, ours_mean=0.5, theirs_mean=0.14)
    text, ok = bringup.summarize([ENV, *lines])
    assert not ok and _rows(text)["engine log-probs"] == "FAIL"
    text, ok = bringup.summarize([ENV, *_engine(mfu=0.41, measured=38e9, planned=36.47e9,
                                                exact=False)])
    assert not ok and _rows(text)["engine offload"] == "FAIL"


def test_a_step_that_crashed_or_ran_out_of_time_fails_with_its_last_words():
    lines = [ENV, {"step": "verify", "kind": "status", "rc": 1, "seconds": 3.0,
                   "stderr_tail": "Traceback ...\nRuntimeError: NCCL error"},
             {"step": "engine", "kind": "status", "rc": None,
              "skipped": "the kit's time budget ran out"}]
    text, ok = bringup.summarize(lines)
    assert not ok
    assert "exit 1 after 3.0 s: RuntimeError: NCCL error" in text
    assert "skipped: the kit's time budget ran out" in text


# The three facts checked in one bare interpreter, each part's stdout after a line MARK NAME:
# what the kit imports (first, before anything else is imported), the kit's smoke steps, and
# pytest collecting where Ray is absent.
MARK = "--- part:"
KIT = BARE + f"MARK = {MARK!r}\n" + """
import json, traceback
print(MARK, "imports", flush=True)
import rlhf.cli, rlhf.bench.bringup, rlhf.verify
rlhf.cli.build_parser()  # imports every bench module and the trainer CLI
print(json.dumps({"transformers": "transformers" in sys.modules}), flush=True)
def kit():
    return rlhf.bench.bringup.main(["--out", sys.argv[1], "--smoke", "--only", "tiny_model",
                                    "verify", "attention"])
def collect():
    import pytest
    return pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "tests/unit/controller/test_worker_device.py",
                        "tests/unit/bench/test_flops.py"])
for name, call in (("kit", kit), ("pytest", collect)):
    print(MARK, name, flush=True)
    try:
        rc = int(call())
    except BaseException:
        traceback.print_exc()
        rc = 1
    print(MARK, name + "_exit", rc, flush=True)
"""


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The bare interpreter's run: each part's stdout by name (kit_exit and pytest_exit hold
    exit statuses), the kit's results folder and the stderr."""
    out = tmp_path_factory.mktemp("bringup")
    proc = subprocess.run([sys.executable, "-c", KIT, str(out)], capture_output=True, text=True,
                          timeout=580, cwd=ROOT)
    parts = {}
    for chunk in proc.stdout.split(MARK + " ")[1:]:
        header, _, text = chunk.partition("\n")
        name, _, status = header.partition(" ")
        parts[name] = status or text
    return parts, out, proc.stderr


def test_the_kit_imports_without_ray_vllm_or_flash_attn(kit):
    parts, _, stderr = kit
    assert "imports" in parts and "kit" in parts, stderr[-3000:]
    # ... and its parser, which every `rlhf` command builds, without transformers either
    assert json.loads(parts["imports"]) == {"transformers": False}


def test_smoke_steps_run_and_write_logs_results_and_summary(kit):
    """The kit's own plumbing, in the small CPU shapes, where Ray and vLLM are absent."""
    parts, out, stderr = kit
    assert parts.get("kit_exit") == "0", parts.get("kit", "")[-3000:] + stderr[-3000:]
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == "env" and lines[0]["ray"] is False and lines[0]["vllm"] is False
    assert {x["step"] for x in lines} == {"env", "tiny_model", "verify", "attention"}
    summary = (out / "summary.txt").read_text()
    assert "PASS  verify-model cuda" in summary and "PASS  attention sdpa_split" in summary
    assert (out / "verify.log").read_text().startswith("$ rlhf.cli verify-model")
    assert not (out / "tiny").exists()  # the model stays out of the results folder


def test_pytest_collects_without_ray_skipping_what_needs_it(kit):
    """A module that imports Ray is reported skipped with the reason; the rest runs."""
    parts, _, stderr = kit
    report = parts.get("pytest", "")
    assert parts.get("pytest_exit") == "0", report[-3000:] + stderr[-3000:]
    assert "test_worker_device.py needs ray, which is not installed here" in report
    assert " passed" in report and "error" not in report.lower()


def test_an_attention_kernel_that_raises_is_a_failed_check():
    lines = [ENV, {"step": "attention", "kind": "agreement", "kernel": "torch_varlen",
                   "chosen": True, "dtype": "bfloat16", "shared_prefix": False,
                   "error": "RuntimeError: bad cu_seqlens", "tolerance": 0.03, "passed": False},
             {"step": "attention", "kind": "speed", "kernel": "torch_varlen", "shape": "equal",
              "error": "RuntimeError: bad cu_seqlens"},
             {"step": "attention", "kind": "status", "rc": 1, "seconds": 2.0}]
    text, ok = bringup.summarize(lines)
    assert not ok and "raised: RuntimeError: bad cu_seqlens" in text
    assert "torch_varlen raised RuntimeError" in text
