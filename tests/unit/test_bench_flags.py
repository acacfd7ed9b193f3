"""One spelling of the flags every benchmark shares (recover_hsdp/bench/harness.SHARED_FLAGS:
the `recover-hsdp train` keys' --grad-accum --micro-batch-size --seq-len --warmup --repeats;
--out is a FILE, a folder is --work-dir), the old spellings kept as aliases that parse to the
same values, and help text on every option of every benchmark and of `recover-hsdp chaos`.

Each parser is taken from the command's own main() (argparse's parse_args intercepted before
anything runs), so what is checked is what the user gets."""
from __future__ import annotations

import argparse
import importlib

import pytest

from recover_hsdp import bench
from recover_hsdp.bench import harness as H

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

COMMANDS = [f"recover_hsdp.bench.{n}" for n in bench.available()] + ["recover_hsdp.tools.chaos"]
#: spellings that are aliases now, never an option's first (shown) name (stack's old --skip, the
#: warm-up steps, is its --warmup's alias; collectives' --skip PART is another option)
OLD = {"--accum", "--mbs", "--seq", "--repeat", "--debug-mbs", "--debug-seq"}


class _Caught(Exception):
    pass


def parser_of(module_name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``module.main([])`` builds, taken at its parse_args call (nothing runs)."""
    got = []
    original = argparse.ArgumentParser.parse_args

    def catch(self, args=None, namespace=None):
        got.append(self)
        raise _Caught

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    try:
        with pytest.raises(_Caught):
            importlib.import_module(module_name).main([])
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    return got[0]


def _options(p: argparse.ArgumentParser):
    return [a for a in p._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("module_name", COMMANDS)
def test_every_option_has_help_and_the_one_spelling(module_name, monkeypatch):
    p = parser_of(module_name, monkeypatch)
    opts = _options(p)
    assert opts, module_name
    for a in opts:
        assert a.help and a.help.strip(), f"{module_name}: {a.option_strings[0]} has no help"
        shown = a.option_strings[0]
        assert shown not in OLD, f"{module_name}: {shown} is an old spelling shown first"
        if shown == "--out":        # --out is always the JSON result file
            assert a.metavar == "FILE" and "folder" not in a.help, (module_name, a.help)
        if "--out" in a.option_strings[1:]:      # an old --out that named a folder
            assert shown == "--work-dir" and a.metavar == "DIR", (module_name, a.option_strings)
        for old in a.option_strings[1:]:         # an alias is named in the help
            assert f"old spelling: {old}" in a.help, (module_name, a.option_strings, a.help)
    for flag in ("--grad-accum", "--micro-batch-size", "--seq-len"):   # never an alias of
        shown = [a.option_strings[0] for a in opts if flag in a.option_strings]  # another
        assert shown in ([], [flag]), (module_name, flag, shown)


def _same(p: argparse.ArgumentParser, old: list[str], new: list[str]) -> argparse.Namespace:
    a, b = p.parse_args(old), p.parse_args(new)
    assert vars(a) == vars(b), (old, new)
    return a


def test_stack_aliases_parse_as_the_new_spellings(monkeypatch):
    p = parser_of("recover_hsdp.bench.stack", monkeypatch)
    a = _same(p, ["--accum", "3", "--mbs", "2", "--seq", "32", "--skip", "1"],
              ["--grad-accum", "3", "--micro-batch-size", "2", "--seq-len", "32", "--warmup", "1"])
    assert (a.grad_accum, a.micro_batch_size, a.seq_len, a.warmup) == (3, 2, 32, 1)
    d = p.parse_args([])
    assert (d.grad_accum, d.micro_batch_size, d.seq_len, d.warmup) != (3, 2, 32, 1)  # not defaults


def test_snapshot_and_planner_aliases(monkeypatch):
    p = parser_of("recover_hsdp.bench.snapshot", monkeypatch)
    a = _same(p, ["--repeat", "7", "--debug-mbs", "3", "--debug-seq", "64", "--mbs", "2",
                  "--seq", "512"],
              ["--repeats", "7", "--micro-batch-size", "3", "--seq-len", "64",
               "--micro-batch-size-1b", "2", "--seq-len-1b", "512"])
    assert (a.repeats, a.micro_batch_size, a.seq_len, a.micro_batch_size_1b, a.seq_len_1b) == \
        (7, 3, 64, 2, 512)
    p = parser_of("recover_hsdp.bench.planner", monkeypatch)
    assert _same(p, ["--repeat", "2"], ["--repeats", "2"]).repeats == 2


@pytest.mark.parametrize("module_name", ["recover_hsdp.bench.gpu", "recover_hsdp.tools.chaos"])
def test_a_folder_is_work_dir_and_the_old_out_still_works(module_name, monkeypatch, tmp_path):
    p = parser_of(module_name, monkeypatch)
    a = _same(p, ["--out", str(tmp_path)], ["--work-dir", str(tmp_path)])
    assert a.out == str(tmp_path)


def test_harness_refuses_an_alias_of_no_option():
    with pytest.raises(AssertionError, match="aliases of options that do not exist"):
        H.parser("x", None, aliases={"grad_accum": "--accum"}, steps=1)
