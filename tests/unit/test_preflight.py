"""Launcher-side input checks (recover_hsdp/data/preflight.py): a dataset every rank
needs is refused up front with one line naming what to set instead, and the hub probe is
bounded (an unreachable hub costs seconds, not the ~30 s of `datasets` retries per rank)."""
from __future__ import annotations

import socket
import threading

import pytest

from recover_hsdp.data import DataConfig
from recover_hsdp.data.preflight import (InputUnavailable, check_hub, check_inputs,
                                         check_local_files, hub_address, probe)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_local_files(tmp_path):
    ok = tmp_path / "a.jsonl"
    ok.write_text('{"text": "x"}\n')
    check_local_files([ok])
    with pytest.raises(InputUnavailable, match="does not exist"):
        check_local_files([ok, tmp_path / "b.jsonl"])
    with pytest.raises(InputUnavailable, match="is not a regular file"):
        check_local_files([tmp_path])
    check_inputs(DataConfig(source="local", paths=(str(ok),)))
    check_inputs(DataConfig())        # embedded: nothing to check here


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_is_refused_without_probing(var, monkeypatch):
    import recover_hsdp.data.preflight as pf

    probed = []                         # the event itself: no connection is even tried
    monkeypatch.setattr(pf.socket, "create_connection", lambda *a, **k: probed.append(a))
    with pytest.raises(InputUnavailable) as e:
        check_hub(DataConfig(source="hf"), {var: "1", "HF_ENDPOINT": "http://10.255.255.1:9"})
    msg = str(e.value)
    assert "\n" not in msg and f"{var}=1" in msg
    assert "data=local" in msg and "data=embedded" in msg
    assert probed == []


def test_unreachable_hub_is_refused_fast():
    # fast: refused on the connection's own answer (ECONNREFUSED), not at the probe's bound
    with pytest.raises(InputUnavailable, match="not reachable from this machine") as e:
        check_hub(DataConfig(source="hf"), {"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert "refused" in str(e.value).lower() and "no answer within" not in str(e.value), e.value


def test_probe_is_bounded_and_sees_a_listener(monkeypatch):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        assert probe("127.0.0.1", port, 2.0) is None
        # the hub reachable (here: a local listener as HF_ENDPOINT): no error
        check_hub(DataConfig(source="hf"), {"HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    # a name resolution that never answers (socket timeouts do not bound it): the bound ends it
    import recover_hsdp.data.preflight as pf

    never = threading.Event()          # the answer that never comes (set at the end)
    entered = threading.Event()
    monkeypatch.setattr(pf.socket, "create_connection",
                        lambda *a, **k: (entered.set(), never.wait()))
    # the order, not a wall-clock bound: probe returned its bound's verdict while the connection
    # attempt it started was still blocked (without the bound it would never return: the
    # pytest timeout)
    assert "no answer within 0.3 s" in probe("hub.invalid", 443, 0.3)
    assert entered.is_set() and not never.is_set()
    never.set()
    monkeypatch.undo()
    # 0 skips the probe (a site that knows its hub answers)
    check_hub(DataConfig(source="hf"), {"HF_ENDPOINT": "http://127.0.0.1:9",
                                        "RECOVER_HSDP_HUB_PROBE_S": "0"})


def test_hub_address_and_local_dataset_dir(tmp_path):
    assert hub_address({}) == ("huggingface.co", 443, "https://huggingface.co:443")
    assert hub_address({"HF_ENDPOINT": "http://mirror:8080"})[:2] == ("mirror", 8080)
    assert hub_address({"HTTPS_PROXY": "http://proxy:3128"})[:2] == ("proxy", 3128)
    # a dataset directory on disk is opened without the hub: not probed, not refused
    check_hub(DataConfig(source="hf", hf_path=str(tmp_path)), {"HF_HUB_OFFLINE": "1"})
