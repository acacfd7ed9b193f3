"""DataConfig validation names the key and values; conf/data/*.yaml load."""
from __future__ import annotations

from pathlib import Path

import pytest

from recover_hsdp.data.config import DataConfig, DataConfigError, check_model_data
from recover_hsdp.model import LLAMA_DEBUG

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize("overrides,message", [
    ({"source": "s3"}, "data.source('s3') must be one of embedded, local, hf"),
    ({"source": "local"}, "data.paths(()) must list at least one file"),
    ({"seq_len": 0}, "data.seq_len(0) must be a positive integer"),
    ({"micro_batch_size": 2.5}, "data.micro_batch_size(2.5) must be a positive integer"),
    ({"seed": -1}, "data.seed(-1) must be a non-negative integer"),
])
def test_data_config_errors_name_the_key(overrides, message):
    with pytest.raises(DataConfigError) as ei:
        DataConfig(**overrides)
    assert message in str(ei.value)


def test_data_yaml_files_load_and_cross_checks():
    for path in sorted((CONF / "data").glob("*.yaml")):
        DataConfig.from_yaml(path)
    assert DataConfig.from_yaml(CONF / "data" / "embedded.yaml") == DataConfig()
    with pytest.raises(DataConfigError, match=r"data\.seq_len\(256\) must be <= "
                                              r"model\.max_seq_len\(128\)"):
        check_model_data(LLAMA_DEBUG, DataConfig(seq_len=256), 4096)
    with pytest.raises(DataConfigError, match=r"model\.vocab_size\(100\) must equal"):
        check_model_data(LLAMA_DEBUG.with_vocab(100), DataConfig(), 4096)
    with pytest.raises(DataConfigError, match=r"data\.foo is not a data key"):
        DataConfig.from_dict({"foo": 1})
