"""The installed environment: the imports the README's install promises."""

import importlib
import importlib.metadata
import re

import pytest


def test_every_transformers_model_class_imports():
    # A torchvision built for another torch breaks model classes lazily, one by one, so touch all.
    transformers = importlib.import_module("transformers")
    names = [n for n in dir(transformers)
             if n[:1].isupper() and re.search(r"(Model|For[A-Z]\w+)$", n)]
    assert len(names) > 500, "transformers exposes far fewer model classes than expected"
    failed = {}
    for name in names:
        try:
            getattr(transformers, name)
        except Exception as exc:  # collect them all for one readable failure
            failed[name] = f"{type(exc).__name__}: {exc}"[:200]
    assert not failed, f"{len(failed)} model classes fail to import, e.g. {list(failed.items())[:3]}"


@pytest.mark.parametrize("module", ["vllm", "ray", "torch", "safetensors", "tokenizers"])
def test_runtime_dependency_imports(module):
    assert importlib.import_module(module).__version__


@pytest.mark.parametrize("package", ["torchvision", "torchaudio", "torchcodec"])
def test_no_unloadable_torch_companion_left_installed(package):
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return  # removed by examples/install.sh, as intended
    importlib.import_module(package)  # present: then it must load next to this torch


def test_doctor_reports_healthy_environment(capsys):
    from rlhf.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "environment OK" in out and "vllm" in out and "ray" in out
    # The installed vllm(-cpu) lies in the tested range, and the GPU-path lines are all there.
    assert "vllm range    ok (" in out
    for line in ("flash-attn", "nccl", "ray gpus"):
        assert f"\n  {line:13s} " in out, line
