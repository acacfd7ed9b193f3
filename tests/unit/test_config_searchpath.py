"""Presets outside the package: a model preset in a user folder is found through Hydra's own
``hydra.searchpath=[file:///dir]`` override (it works through our compose call) and through
RECOVER_HSDP_CONFIG_PATH; a folder that is not there is one line, exit 2; a preset that is not
found names both ways. Through `recover-hsdp train`'s real entry point (train.main)."""
from __future__ import annotations

from pathlib import Path

import pytest

from recover_hsdp import train
from recover_hsdp.config import compose
from recover_hsdp.config.groups import CONF_DIR

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def _preset(tmp_path: Path, name: str = "my_tiny", d_model: int = 96) -> Path:
    """A user folder with model/<name>.yaml: llama_debug with another name and width."""
    folder = tmp_path / "presets"
    (folder / "model").mkdir(parents=True)
    text = (CONF_DIR / "model" / "llama_debug.yaml").read_text()
    lines = [f"name: {name}" if ln.startswith("name:") else
             f"d_model: {d_model}" if ln.startswith("d_model:") else ln
             for ln in text.splitlines()]
    assert f"name: {name}" in lines and f"d_model: {d_model}" in lines
    (folder / "model" / f"{name}.yaml").write_text("\n".join(lines) + "\n")
    return folder


def _print_config(args, capsys) -> tuple[int, str, str]:
    rc = train.main(["--print-config", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_hydra_searchpath_override_finds_a_user_model_preset(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(compose.ENV_CONFIG_PATH, raising=False)
    folder = _preset(tmp_path)
    rc, out, err = _print_config([f"hydra.searchpath=[file://{folder}]", "model=my_tiny",
                                  f"run.output_dir={tmp_path / 'run'}"], capsys)
    assert rc == 0, err
    assert "name: my_tiny" in out and "d_model: 96" in out, out
    assert not (tmp_path / "run").exists()              # --print-config writes nothing


def test_env_var_finds_a_user_model_preset_and_the_job_builds_it(tmp_path, capsys, monkeypatch):
    folder = _preset(tmp_path)
    monkeypatch.setenv(compose.ENV_CONFIG_PATH, str(folder))
    rc, out, err = _print_config(["model=my_tiny"], capsys)
    assert rc == 0 and "name: my_tiny" in out, err
    # the whole launcher path (compose, resolve, validate) takes it: the ranks get it resolved
    jobs = train.prepare_jobs(["model=my_tiny", f"run.output_dir={tmp_path / 'run'}"],
                              multirun=False, cwd=tmp_path)
    assert jobs[0].cfg.model.name == "my_tiny" and jobs[0].cfg.model.d_model == 96


def test_the_package_presets_still_win_and_stay_available(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(compose.ENV_CONFIG_PATH, str(_preset(tmp_path)))
    rc, out, err = _print_config(["model=llama_debug"], capsys)
    assert rc == 0 and "name: llama_debug" in out, err


@pytest.mark.parametrize("how", ["env", "override"])
def test_a_missing_folder_is_one_line_exit_2(tmp_path, capsys, monkeypatch, how):
    missing = tmp_path / "nope"
    args = ["model=my_tiny"]
    if how == "env":
        monkeypatch.setenv(compose.ENV_CONFIG_PATH, str(missing))
        want = f"RECOVER_HSDP_CONFIG_PATH({str(missing)!r}): no such directory"
    else:
        monkeypatch.delenv(compose.ENV_CONFIG_PATH, raising=False)
        args.insert(0, f"hydra.searchpath=[file://{missing}]")
        want = f"hydra.searchpath: file://{missing}: no such directory"
    rc, out, err = _print_config(args, capsys)
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [f"recover-hsdp train: error: {want}"], err


def test_a_preset_not_found_names_both_ways(capsys, monkeypatch):
    monkeypatch.delenv(compose.ENV_CONFIG_PATH, raising=False)
    rc, out, err = _print_config(["model=my_tiny"], capsys)
    assert rc == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("recover-hsdp train: error: model=my_tiny: no such model config "
                           "(available: llama_1b, llama_debug); your own: model/my_tiny.yaml"), line
    assert "RECOVER_HSDP_CONFIG_PATH" in line and "hydra.searchpath=[file://" in line
