"""ModelConfig validation names the key and values; conf/model/*.yaml match the named configs."""
from __future__ import annotations

from pathlib import Path

import pytest

from recover_hsdp.model import LLAMA_DEBUG, NAMED_CONFIGS, ConfigError, ModelConfig, get_config

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize("overrides,message", [
    ({"n_heads": 32, "n_kv_heads": 6, "d_model": 2048},
     "model.n_heads(32) must be divisible by model.n_kv_heads(6)"),
    ({"d_model": 100, "n_heads": 8, "n_kv_heads": 8},
     "model.d_model(100) must be divisible by model.n_heads(8)"),
    ({"d_model": 36, "n_heads": 4, "n_kv_heads": 4}, "head_dim(9) must be even"),
    ({"n_layers": 0}, "model.n_layers(0) must be a positive integer"),
    ({"ffn_dim": -3}, "model.ffn_dim(-3) must be a positive integer"),
    ({"vocab_size": 0}, "model.vocab_size(0) must be a positive integer or null"),
    ({"rope_theta": 0.0}, "model.rope_theta(0.0) must be > 0"),
    ({"norm_eps": -1.0}, "model.norm_eps(-1.0) must be > 0"),
    ({"tie_embeddings": "yes"}, "model.tie_embeddings('yes')"),
])
def test_model_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as ei:
        ModelConfig(**{**LLAMA_DEBUG.to_dict(), **overrides})
    assert message in str(ei.value)


def test_unknown_key_and_unresolved_vocab():
    with pytest.raises(ConfigError, match=r"model\.n_head is not a model key"):
        ModelConfig.from_dict({"n_head": 4})
    with pytest.raises(ConfigError, match=r"model\.vocab_size\(None\) is unresolved"):
        LLAMA_DEBUG.require_vocab()
    with pytest.raises(ConfigError, match=r"model\.name\('gpt'\)"):
        get_config("gpt")
    assert get_config("llama_debug", 4096).vocab_size == 4096


@pytest.mark.parametrize("name", sorted(NAMED_CONFIGS))
def test_yaml_matches_named_config(name):
    assert ModelConfig.from_yaml(CONF / "model" / f"{name}.yaml") == NAMED_CONFIGS[name]
