"""The sft section: defaults, overrides and errors that name the key."""

import pytest

from rlhf.config import ConfigError, load_config


def test_sft_section_loads_with_overrides():
    cfg = load_config("configs/quickstart.yaml", ["sft.total_steps=7", "sft.parallel.tp=2",
                                                  "sft.optim.lr=3e-4"])
    assert cfg.sft.total_steps == 7 and cfg.sft.parallel.tp == 2 and cfg.sft.optim.lr == 3e-4
    assert cfg.sft.response_key == "response"


@pytest.mark.parametrize("override, message", [
    ("sft.batch_size=0", "batch_size"),
    ("sft.total_steps=-1", "total_steps"),
    ("sft.response_key=''", "response_key must not be empty"),
    ("sft.output_path=''", "output_path must not be empty"),
    ("trainer.max_keep=-1", "max_keep"),
])
def test_bad_sft_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/quickstart.yaml", [override])
