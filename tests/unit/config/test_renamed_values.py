"""An option value a release renamed is rejected with a message that names the new value."""

from pathlib import Path

import pytest

from rlhf.config import ConfigError, load_config

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def test_recompute_selective_names_attention_block():
    with pytest.raises(ConfigError, match=r"actor\.recompute: 'selective' was renamed "
                                          r"'attention_block'"):
        load_config(QUICKSTART, ["actor.recompute=selective"])
    assert load_config(QUICKSTART, ["actor.recompute=attention_block"]).actor.recompute == \
        "attention_block"
