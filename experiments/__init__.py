"""Reproduction experiments: how the numbers and figures in docs/ were made. Not installed.

This folder sits next to the package (`recover_hsdp/`), not inside it: `pip install .` ships
the toolkit and the benchmarks a user runs (`recover-hsdp bench gpu|collectives|hsdp|stack|
snapshot|planner`); the experiments below run from a checkout, from the repository root, as
``python -m experiments.NAME [args]`` (docs/results.md, docs/verify.md, docs/rejoin.md,
docs/hsdp.md give the commands and the readings). They import the package; nothing in the
package imports them (tests/unit/test_layering.py).
"""
