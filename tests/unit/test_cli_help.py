"""One CLI convention: `recover-hsdp <command> --help` (every command the console script
dispatches, bench's and tokenizer's subcommands included) exits 0 with the help on stdout and no
side effect: run in an empty working directory with HOME, the cache directories and TMPDIR in a
temporary folder, it writes nothing in any of them. `--version` prints the package's version.
Usage errors go to stderr with exit 2, stdout left empty.

The commands come from the CLI's own dispatch table (recover_hsdp.cli.command_paths: SUBCOMMANDS
and each one's ``subcommands()``), so a new subcommand is covered without editing this file."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from recover_hsdp import bench, cli
from recover_hsdp.tools import chaos, tokenizer
from tests._procs import run

REPO = Path(__file__).resolve().parents[2]
PATHS = cli.command_paths()


def _ids(path: tuple[str, ...]) -> str:
    return "-".join(path)


@pytest.fixture
def sandbox(tmp_path):
    """(cwd, env): an empty working directory; HOME, XDG_CACHE_HOME, the package's and Hugging
    Face's caches and TMPDIR all under an empty temporary home; no inherited job variables."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RECOVER_HSDP_", "OMPI_", "PMIX_", "HF_", "XDG_"))
           or k == "RECOVER_HSDP_TEST_ID"}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"),
               RECOVER_HSDP_CACHE=str(home / ".cache" / "recover_hsdp"),
               HF_HOME=str(home / ".cache" / "huggingface"), TMPDIR=str(home / "tmp"))
    (home / "tmp").mkdir()
    return cwd, home, env


def _written(*roots: Path) -> list[str]:
    """Everything below ``roots`` but the (empty) folders the sandbox made."""
    made = {r for r in roots} | {roots[-1] / "tmp"}
    return sorted(str(p) for r in roots for p in r.rglob("*") if p not in made)


def _cli(args, cwd, env, timeout=120.0):
    return run([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=env,
               timeout=timeout, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def test_the_dispatch_table_reaches_every_subcommand():
    """command_paths is what the help test walks: it has every top-level command, bench's `all`
    and each benchmark, and tokenizer's and corpus's subcommands."""
    assert {p[0] for p in PATHS} == set(cli.SUBCOMMANDS)
    subs = {p[0]: [q[1] for q in PATHS if len(q) == 2 and q[0] == p[0]] for p in PATHS}
    assert subs["bench"] == ["all", *bench.available()] and "stack" in subs["bench"]
    assert subs["tokenizer"] == ["train", "encode", "info"]
    assert subs["corpus"] == ["build", "stats", "pack"]


@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_help_exits_0_on_stdout_and_writes_nothing(path, sandbox):
    cwd, home, env = sandbox
    p = _cli([*path, "--help"], cwd, env)
    where = f"recover-hsdp {' '.join(path)} --help"
    assert p.returncode == 0, f"{where}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "usage" in p.stdout.lower(), f"{where}: no usage on stdout:\n{p.stdout}\n{p.stderr}"
    assert f"recover-hsdp {' '.join(path)}" in p.stdout, f"{where}: another one's help?\n{p.stdout}"
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    assert _written(cwd, home) == [], f"{where} wrote files"


def test_top_level_help_lists_every_command(sandbox):
    cwd, home, env = sandbox
    for flag in ("--help", "-h"):
        p = _cli([flag], cwd, env)
        assert p.returncode == 0 and p.stderr == ""
        assert all(f"  {name} " in p.stdout for name in cli.SUBCOMMANDS), p.stdout
    assert _written(cwd, home) == []


def test_version(sandbox):
    cwd, home, env = sandbox
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert cli.version() == importlib.metadata.version("recover_hsdp") == declared
    for flag in ("--version", "-V"):
        p = _cli([flag], cwd, env, timeout=60.0)
        assert p.returncode == 0, p.stderr
        assert p.stdout == f"recover-hsdp {declared}\n" and p.stderr == ""
    assert _written(cwd, home) == []


@pytest.mark.parametrize("argv", [[], ["no-such-command"], ["--no-such-flag"], ["bench"],
                                  ["bench", "no-such-benchmark"], ["bench", "all", "--repeat", "1"],
                                  ["demo", "-m"]], ids=_ids)
def test_a_usage_error_is_stderr_and_exit_2(argv, sandbox):
    cwd, home, env = sandbox
    p = _cli(argv, cwd, env, timeout=60.0)
    assert p.returncode == 2, f"{argv}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert p.stdout == "" and p.stderr.strip(), (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    assert _written(cwd, home) == []


@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_an_unknown_option_is_a_usage_error(path, monkeypatch, tmp_path, capsys):
    """In-process (the dispatch as the console script runs it): exit 2, a message on stderr,
    nothing on stdout, nothing written."""
    monkeypatch.chdir(tmp_path)
    try:
        rc = cli._main([*path, "--no-such-option-xyz"])
    except SystemExit as e:             # argparse's error()
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, f"{path}: exit {rc}\n{out}\n{err}"
    assert out == "" and err.strip(), (out, err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("parser", [chaos._parser, tokenizer._parser], ids=["chaos", "tokenizer"])
def test_every_option_has_help(parser):
    def actions(p):
        for a in p._actions:
            if a.choices and hasattr(a, "_name_parser_map"):        # subcommands
                for sub in a.choices.values():
                    yield from actions(sub)
            elif a.option_strings or a.nargs:
                yield p.prog, a
    missing = [(prog, a.dest) for prog, a in actions(parser())
               if a.dest != "help" and not (a.help or "").strip()]
    assert missing == []
