"""`rlhf verify-model`: exit codes, the JSON report, and refusals before any process starts."""

import json

import pytest
import torch

from rlhf.cli import main
from rlhf.config.schema import TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model

FIELDS = {"model", "model_type", "layout", "num_seqs", "num_tokens", "seed", "max_abs_diff",
          "worst_grad", "factor", "floor", "errors", "passed"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # vocab 515: the tp=2 layout pads the vocabulary; kv 2 heads: tp=4 is refused
    spec = TinyModelConfig(arch="qwen2", num_layers=2, hidden_size=64, num_heads=4,
                           num_kv_heads=2, intermediate_size=96, vocab_size=515,
                           max_position_embeddings=64)
    return str(make_tiny_model(spec, tmp_path_factory.mktemp("m") / "qwen2"))


def _report(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


def test_tp2_matches_transformers(folder, capsys):
    """Compiled (`--compile on`; the other layouts here run eager): the fused bodies on the
    tp shards, the padded vocab head's chunks included."""
    assert main(["verify-model", folder, "--tp", "2", "--num-seqs", "4", "--compile", "on"]) == 0
    report = _report(capsys)
    assert FIELDS <= report.keys() and report["compiled"] is True
    assert report["layout"] == {"tp": 2, "pp": 1, "dp": 1, "nproc": 2, "sequence_parallel": False}
    assert report["passed"] is True and report["num_seqs"] == 4
    assert set(report["max_abs_diff"]) == {"logits", "log_probs", "entropy", "grads"}
    assert all(d < 1e-5 for d in report["max_abs_diff"].values()), report


def test_tp2_x_pp2_matches_transformers(folder, capsys):
    """The pipeline path: 3 micro-batches through 1F1B, tp=2 with SP inside each stage."""
    assert main(["verify-model", folder, "--tp", "2", "--pp", "2", "--sequence-parallel",
                 "--num-seqs", "5"]) == 0
    report = _report(capsys)
    assert report["layout"] == {"tp": 2, "pp": 2, "dp": 1, "nproc": 4, "sequence_parallel": True}
    assert report["passed"] is True
    assert set(report["max_abs_diff"]) == {"log_probs", "entropy", "grads"}
    assert all(d < 1e-5 for d in report["max_abs_diff"].values()), report


def test_a_tolerance_below_fp32_noise_fails(folder, capsys):
    """Sharded sums round away from float64 by ~1e-7, far above a bare 1e-12."""
    argv = ["verify-model", folder, "--tp", "2", "--sequence-parallel", "--nproc", "4",
            "--factor", "0", "--floor", "1e-12", "--num-seqs", "3", "--seed", "5"]
    assert main(argv) == 1
    report = _report(capsys)
    assert report["passed"] is False and report["layout"]["dp"] == 2
    assert report["layout"]["sequence_parallel"] is True
    assert max(report["max_abs_diff"].values()) > 1e-12
    assert all(d < 1e-5 for d in report["max_abs_diff"].values()), report


@pytest.mark.parametrize("argv, message", [
    (["--tp", "1", "--pp", "2", "--vpp", "2"], "pp * vpp = 4 stages need at least 4 decoder "
                                                "layers but the model has 2"),
    (["--tp", "1", "--vpp", "2"], "vpp=2 needs pp > 1"),
    (["--tp", "4"], "tp=4 does not divide num_key_value_heads=2"),
    (["--tp", "2", "--nproc", "3"], "--nproc 3 is not a positive multiple of tp * pp = 2"),
    (["--tp", "1", "--sequence-parallel"], "sequence_parallel needs tp > 1"),
    (["--ep", "2"], "--ep 2 needs a mixture-of-experts model whose expert count it divides"),
    (["--ep", "2", "--nproc", "3"], "--nproc 3 is not a positive multiple of tp * pp * ep = 2"),
])
def test_bad_layouts_exit_2_without_a_traceback(folder, capsys, argv, message):
    assert main(["verify-model", folder, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and message in captured.err
    assert "Traceback" not in captured.err


def test_missing_folder_exits_2(tmp_path, capsys):
    assert main(["verify-model", str(tmp_path / "absent"), "--tp", "2"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["verify-model", str(tmp_path / "empty"), "--tp", "2"]) == 2
    assert "config.json not found" in capsys.readouterr().err


def test_tp_defaults_to_one(folder, capsys):
    from rlhf.cli import build_parser

    assert build_parser().parse_args(["verify-model", folder]).tp == 1
    assert main(["verify-model", folder, "--num-seqs", "2", "--max-len", "8"]) == 0
    report = _report(capsys)
    assert report["passed"]
    assert (report["layout"]["tp"], report["layout"]["pp"], report["layout"]["nproc"]) == (1, 1, 1)


def test_report_names_the_device_and_tf32(folder, capsys):
    assert main(["verify-model", folder, "--num-seqs", "2", "--max-len", "8",
                 "--device", "cpu"]) == 0
    report = _report(capsys)
    assert report["device"] == "cpu" and report["tf32"] is False
    assert (report["factor"], report["floor"]) == (4.0, 1e-6)  # the CPU defaults
    for row in report["errors"].values():
        assert row["passed"] and row["ours"] <= row["limit"]
        assert row["limit"] == pytest.approx(4.0 * row["transformers_fp32"] + 1e-6)


def test_cuda_without_a_gpu_exits_2(folder, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["verify-model", folder, "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_cuda_starts_one_process_per_visible_gpu(folder, monkeypatch):
    from pathlib import Path

    from rlhf.errors import RLHFError
    from rlhf.verify import _check_inputs

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    common = dict(pp=1, vpp=1, sequence_parallel=False, num_seqs=2, max_len=8, device="cuda")
    assert _check_inputs(Path(folder), tp=2, nproc=None, **common)[1] == 4
    assert _check_inputs(Path(folder), tp=1, nproc=2, **common)[1] == 2
    with pytest.raises(RLHFError, match="needs a GPU per process but 4 are visible"):
        _check_inputs(Path(folder), tp=1, nproc=8, **common)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(RLHFError, match=r"--nproc 3 \(the 3 visible GPUs\) is not a positive "
                                        r"multiple of tp \* pp = 2"):
        _check_inputs(Path(folder), tp=2, nproc=None, **common)


def test_ieee_fp32_turns_tf32_off_and_restores():
    from rlhf.verify import ieee_fp32

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 allowed
    try:
        with ieee_fp32():
            assert torch.get_float32_matmul_precision() == "highest"
            assert not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_nccl_matches_transformers_on_every_visible_gpu(folder, capsys):
    assert main(["verify-model", folder, "--device", "cuda", "--num-seqs", "4"]) == 0
    report = _report(capsys)
    assert report["layout"]["nproc"] == torch.cuda.device_count()
    assert report["device"] != "cpu" and report["tf32"] is False
    assert report["passed"], report
