"""`recover-hsdp bench all` runs the micro-benchmarks and leaves the long experiments to be run by
name; the reproduction experiments that left the package say where they went."""
from __future__ import annotations

import importlib

import pytest

from recover_hsdp import bench

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_all_skips_the_experiments(monkeypatch, capsys):
    ran = []

    class _Fake:
        def __init__(self, name):
            self.name = name

        def main(self, argv):
            ran.append(self.name)
            return 0

    real = importlib.import_module
    monkeypatch.setattr(bench.importlib, "import_module",
                        lambda mod: _Fake(mod.rsplit(".", 1)[1])
                        if mod.startswith("recover_hsdp.bench.") else real(mod))
    assert bench.main(["all"]) == 0
    assert set(bench.EXPERIMENTS) <= set(bench.available())
    assert ran == [n for n in bench.available() if n not in bench.EXPERIMENTS]
    assert "recover-hsdp bench gpu" in capsys.readouterr().out


def test_an_experiment_still_runs_by_name(monkeypatch):
    ran = []
    monkeypatch.setattr(bench.importlib, "import_module",
                        lambda mod: type("M", (), {"main": staticmethod(lambda a: ran.append((mod, a)) or 0)}))
    assert bench.main(["gpu", "--cpu"]) == 0
    assert ran == [("recover_hsdp.bench.gpu", ["--cpu"])]


@pytest.mark.parametrize("name", sorted(bench.MOVED))
def test_a_moved_experiment_says_where_it_went(name, capsys):
    """The reproduction experiments left the package (experiments/, not installed): the old
    subcommand ends in one line naming the new command, and a non-zero exit."""
    assert name not in bench.available()
    assert bench.main([name, "--help"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and bench.MOVED[name] in err[0] and "moved" in err[0]
