"""Tokenizers load from local folders only: a missing folder is an error, never a hub id."""

import pytest

from rlhf.errors import RLHFError
from rlhf.trainer.jobs import load_tokenizer
from tests.unit.trainer.jobs import TINY


def test_a_missing_tokenizer_folder_is_an_error_not_a_hub_lookup(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # no offline switch to lean on
    with pytest.raises(RLHFError, match=r"tokenizer folder 'Qwen/Qwen2.5-0.5B' does not exist"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")  # looks like a hub id; is a (missing) path here
    with pytest.raises(RLHFError, match="does not exist"):
        load_tokenizer(tmp_path / "absent")


def test_a_local_tokenizer_folder_loads(tmp_path):
    from rlhf.demo.tiny_model import make_tiny_model

    folder = make_tiny_model(TINY, tmp_path / "model")
    assert load_tokenizer(folder).eos_token_id is not None
