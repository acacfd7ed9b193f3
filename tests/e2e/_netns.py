"""Namespaced "nodes" for tests: the helper is recover_hsdp/tools/netns.py (also what
`recover-hsdp chaos --nodes N` uses); this adds the tests' rule for when it cannot make them.

    with two_nodes() as nodes:                  # or nodes_for_test(3) for three on a bridge
        cmd = nodes.on(0, [python, "-m", "recover_hsdp.cli", "train", ...,
                           *nodes.train_overrides()])
        subprocess.Popen(cmd, env=nodes.env(), start_new_session=True)

Making namespaces needs root (CAP_SYS_ADMIN) and iproute2. Where that is expected (root, or
CI=1: CI runs as root on a machine like this) a failure to make them FAILS with one line;
elsewhere it SKIPS with one line. Teardown always runs: every process left in a node's namespace
is SIGKILLed (the launcher, mpirun, prted, ranks), then the namespaces are deleted.
"""
from __future__ import annotations

import contextlib
import os
import shutil  # noqa: F401  (tests monkeypatch _netns.shutil.which: the same module object)
from typing import Iterator

import pytest

from recover_hsdp.tools import netns
from recover_hsdp.tools.netns import ENV_NODES, PREFIX, SLOTS, SUBNET, Node, Nodes  # noqa: F401


def expected_to_work() -> bool:
    """Where namespaces must be makeable: CI (CI=1), or root on any machine."""
    return os.environ.get("CI", "") not in ("", "0", "false") or os.geteuid() == 0


@contextlib.contextmanager
def nodes_for_test(n: int, slots: int = SLOTS) -> Iterator[Nodes]:
    cm = netns.nodes(n, slots)
    try:
        made = cm.__enter__()
    except netns.NetnsError as e:
        line = f"{n} namespaced nodes: cannot make them ({e})".replace("\n", " ")
        if expected_to_work():
            pytest.fail(line, pytrace=False)
        pytest.skip(line + "; needs root and iproute2")
    try:
        yield made
    except BaseException as e:
        if not cm.__exit__(type(e), e, e.__traceback__):
            raise
    else:
        cm.__exit__(None, None, None)


@contextlib.contextmanager
def two_nodes() -> Iterator[Nodes]:
    with nodes_for_test(2) as made:
        yield made
