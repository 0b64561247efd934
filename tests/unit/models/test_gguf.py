"""`import-gguf` refuses, before any work, what our decoder or `gguf` cannot handle: another
architecture, a quantisation without a dequantizer, a file that is not GGUF."""

import numpy as np
import pytest

from rlhf.cli import main
from rlhf.errors import RLHFError

gguf = pytest.importorskip("gguf", reason="needs the gguf package: pip install -e '.[real-model]'")

from rlhf.models.gguf import check_gguf  # noqa: E402


def _write(path, *, arch: str, raw_dtype=None):
    writer = gguf.GGUFWriter(str(path), arch)
    if raw_dtype is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:  # raw bytes of one block of that type
        _, size = gguf.GGML_QUANT_SIZES[raw_dtype]
        writer.add_tensor("token_embd.weight", np.zeros((1, size), dtype=np.uint8),
                          raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_llama_file_of_plain_and_q8_tensors_is_accepted(tmp_path):
    facts = check_gguf(_write(tmp_path / "a.gguf", arch="llama"))
    assert facts == {"architecture": "llama", "tensor_types": ["F32"], "tensors": 1}
    facts = check_gguf(_write(tmp_path / "b.gguf", arch="qwen2",
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0))
    assert facts["tensor_types"] == ["Q8_0"]


def test_another_architecture_is_refused(tmp_path, capsys):
    path = _write(tmp_path / "gpt2.gguf", arch="gpt2")
    assert main(["import-gguf", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "GGUF architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3" in err
    assert not (tmp_path / "out").exists()


def test_a_type_without_a_dequantizer_is_refused(tmp_path):
    path = _write(tmp_path / "q81.gguf", arch="llama", raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(RLHFError, match="tensor type\\(s\\) Q8_1 cannot be dequantized"):
        check_gguf(path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(RLHFError, match="is not a readable GGUF file"):
        check_gguf(tmp_path / "x.gguf")
    with pytest.raises(RLHFError, match="is not a file"):
        check_gguf(tmp_path / "absent.gguf")
