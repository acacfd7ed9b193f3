"""Every test: its id in the environment of every process it starts; none left running after
it (tests/_procs.py). ``deadline``: the test's one budget, below its pytest timeout."""
from tests._procs import (_test_id, deadline, pytest_configure,  # noqa: F401
                          pytest_runtest_call, pytest_runtest_setup)
