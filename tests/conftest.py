"""Every test: its id in the environment of every process it starts; none left running after
it (tests/_procs.py). ``deadline``: the test's one budget, below its pytest timeout.

The quick tier (`make test-quick`, ``-m quick``): a test joins it by ``@pytest.mark.quick`` (or
its module's ``pytestmark``); of a parametrized test, ``@pytest.mark.quick_params(ID, ...)``
names the parameter sets that join it, the others staying in `make test` only
(tests/unit/test_quick_tier.py checks the tier)."""
import os

import pytest

from tests._procs import (_test_id, deadline, pytest_configure,  # noqa: F401
                          pytest_runtest_call, pytest_runtest_setup)

#: the tests' environment opens the worker-function seam (RECOVER_HSDP_WORKER_FN is honoured only
#: under this gate: launcher/command.worker_fn_override); tests of the gate itself unset it
os.environ["RECOVER_HSDP_ALLOW_WORKER_FN"] = "1"


@pytest.hookimpl(tryfirst=True)      # before ``-m`` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        m = item.get_closest_marker("quick_params")
        callspec = getattr(item, "callspec", None)
        if m is not None and callspec is not None and callspec.id in m.args:
            item.add_marker(pytest.mark.quick)
