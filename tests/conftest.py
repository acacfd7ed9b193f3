"""Every test: its id in the environment of every process it starts; none left running after
it (tests/_procs.py)."""
from tests._procs import _test_id, pytest_configure, pytest_runtest_call  # noqa: F401
