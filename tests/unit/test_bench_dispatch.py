"""`recover-hsdp bench all` runs the micro-benchmarks and leaves the long experiments to be run by
name."""
from __future__ import annotations

import importlib

from recover_hsdp import bench


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
    assert "recover-hsdp bench paper" in capsys.readouterr().out


def test_an_experiment_still_runs_by_name(monkeypatch):
    ran = []
    monkeypatch.setattr(bench.importlib, "import_module",
                        lambda mod: type("M", (), {"main": staticmethod(lambda a: ran.append((mod, a)) or 0)}))
    assert bench.main(["paper", "--analyze-only"]) == 0
    assert ran == [("recover_hsdp.bench.paper", ["--analyze-only"])]
