"""The supervisor: everything that runs outside the ranks (docs/architecture.md, "Target layout").

command.py  the mpirun line and the ranks' environment
store.py    the TCPStore served outside the ranks, the store host
run.py      run_job / stop_job: start a job, stream its output, stop it

Pure Python at module level (no torch: tests/unit/test_launch_cost.py). This file imports
nothing, so that config/ can use launcher.store (a leaf placed below config in the layering).
"""
