"""Two "nodes" on one machine: a network + UTS namespace each, joined by a veth pair.

Open MPI's ULFM runs across them as across real nodes: a daemon (prted) per node started by the
launch agent tests/e2e/nsrsh, TCP between the nodes, shared memory inside one. Only the network
and the hostname are separate: pids and files are shared, so a test signals any rank by the pid
in its heartbeat and reads the run directory as usual.

    with two_nodes() as nodes:                  # or the `two_nodes` fixture of a test module
        cmd = nodes.on(0, [python, "-m", "recover_hsdp.cli", "train", ...,
                           *nodes.train_overrides()])
        subprocess.Popen(cmd, env=nodes.env(), start_new_session=True)

Making namespaces needs root (CAP_SYS_ADMIN) and iproute2. Where that is expected (root, or
CI=1: CI runs as root on a machine like this) a failure to make them FAILS with one line;
elsewhere it SKIPS with one line. Teardown always runs: every process left in either namespace
is SIGKILLed (the launcher, mpirun, prted, ranks), then the namespaces are deleted.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from tests._wait import Deadline, wait_dead

AGENT = Path(__file__).resolve().parent / "nsrsh"
ENV_NODES = "RECOVER_HSDP_NSRSH_NODES"
SUBNET = "10.77.0"
#: ranks per node: the hostfile's slots and `--map-by ppr:N:node` (without it every rank landed
#: on the first node)
SLOTS = 4
PREFIX = "rhsdp"


@dataclass(frozen=True)
class Node:
    name: str        # network namespace = hostname inside it
    dev: str         # its end of the veth pair
    addr: str


@dataclass
class Nodes:
    nodes: tuple[Node, ...]
    hostfile: Path
    slots: int = SLOTS

    @property
    def subnet(self) -> str:
        return f"{SUBNET}.0/24"

    def env(self, base: dict | None = None) -> dict:
        """The environment for a launch: the agent's node table (mpirun hands its environment
        to the agent, which starts each prted with it)."""
        e = dict(os.environ if base is None else base)
        e[ENV_NODES] = " ".join(f"{n.addr}={n.name}:{n.dev}" for n in self.nodes)
        return e

    def on(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run on node ``i`` (its namespace, hostname and GLOO_SOCKET_IFNAME)."""
        import shlex

        return [str(AGENT), self.nodes[i].addr, shlex.join([str(c) for c in cmd])]

    def mpirun_args(self, hostfile: Path | None = None) -> list[str]:
        return ["--hostfile", str(hostfile or self.hostfile), "--map-by", f"ppr:{self.slots}:node",
                "--mca", "plm_rsh_agent", str(AGENT),
                "--mca", "oob_tcp_if_include", self.subnet,
                "--mca", "btl_tcp_if_include", self.subnet]

    def train_overrides(self) -> list[str]:
        """`recover-hsdp train` overrides for a job across both nodes, launched on node 0."""
        return [f"run.store_host={self.nodes[0].addr}",
                "run.mpirun_args=[" + ",".join(self.mpirun_args()) + "]"]

    def pids(self, i: int) -> list[int]:
        """Every process inside node ``i``'s network namespace."""
        return _ns_pids(self.nodes[i].name)

    def node_of(self, pid: int) -> int | None:
        """Which node a process runs on (by its network namespace), None if neither/gone."""
        try:
            ino = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        for i, n in enumerate(self.nodes):
            try:
                if os.stat(f"/run/netns/{n.name}").st_ino == ino:
                    return i
            except OSError:
                pass
        return None

    def kill_all(self, deadline: float = 30) -> list[int]:
        """SIGKILL every process on both nodes; return the pids that were alive."""
        return _kill_ns([n.name for n in self.nodes], deadline)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` exit {p.returncode}: "
                           f"{(p.stderr or p.stdout).strip().splitlines()[-1:] or ['']}")
    return p


def _ns_pids(name: str) -> list[int]:
    p = _ip("netns", "pids", name, check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()] if p.returncode == 0 else []


def _kill_ns(names: Sequence[str], deadline: float) -> list[int]:
    dl = Deadline(deadline)
    seen: list[int] = []
    # kill until nothing is left: a dying launcher may still have forked (bounded by dl)
    while not dl.expired():
        pids = [p for n in names for p in _ns_pids(n) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            wait_dead(pid, dl.sub(10), f"process {pid} in a test namespace")
        seen += [p for p in pids if p not in seen]
    return seen


def _delete(names: Sequence[str], devs: Sequence[str] = ()) -> None:
    _kill_ns(names, 30)
    for n in names:
        if Path(f"/run/netns/{n}").exists():
            _ip("netns", "del", n, check=False)
    for d in devs:       # a veth end never moved into its namespace (a set-up that failed)
        if Path(f"/sys/class/net/{d}").exists():
            _ip("link", "del", d, check=False)


def _stale() -> list[str]:
    """Namespaces left by an earlier session whose process is gone (name: PREFIX<pid><a|b>)."""
    out = []
    for n in _ip("netns", "list", check=False).stdout.split():
        if n.startswith(PREFIX) and n[len(PREFIX):-1].isdigit():
            if not Path(f"/proc/{n[len(PREFIX):-1]}").exists():
                out.append(n)
    return out


def _make(tag: str) -> tuple[Node, Node]:
    a = Node(f"{PREFIX}{tag}a", f"rh{tag}a"[-15:], f"{SUBNET}.1")
    b = Node(f"{PREFIX}{tag}b", f"rh{tag}b"[-15:], f"{SUBNET}.2")
    for n in (a, b):
        _ip("netns", "add", n.name)
    _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
    for n in (a, b):
        _ip("link", "set", n.dev, "netns", n.name)
        _ip("-n", n.name, "addr", "add", f"{n.addr}/24", "dev", n.dev)
        _ip("-n", n.name, "link", "set", "lo", "up")
        _ip("-n", n.name, "link", "set", n.dev, "up")
    # both ends answer before anything is launched (an address is usable once the link is up)
    p = subprocess.run(["ip", "netns", "exec", a.name, "ping", "-c", "1", "-W", "5", b.addr],
                       capture_output=True, text=True, timeout=30) if shutil.which("ping") else None
    if p is not None and p.returncode != 0:
        raise RuntimeError(f"{a.name} cannot reach {b.addr}: {p.stdout.strip()[-200:]}")
    return a, b


def expected_to_work() -> bool:
    """Where namespaces must be makeable: CI (CI=1), or root on any machine."""
    return os.environ.get("CI", "") not in ("", "0", "false") or os.geteuid() == 0


@contextlib.contextmanager
def two_nodes() -> Iterator[Nodes]:
    tag = str(os.getpid())
    names = [f"{PREFIX}{tag}a", f"{PREFIX}{tag}b"]
    devs = [f"rh{tag}a"[-15:], f"rh{tag}b"[-15:]]
    tmp = Path(tempfile.mkdtemp(prefix="two_nodes."))
    try:
        try:
            if shutil.which("ip") is None:
                raise RuntimeError("`ip` (iproute2) is not installed")
            _delete(_stale() + [n for n in names if Path(f"/run/netns/{n}").exists()])
            a, b = _make(tag)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            line = f"two namespaced nodes: cannot make them ({e})"
            if expected_to_work():
                pytest.fail(line.replace("\n", " "), pytrace=False)
            pytest.skip(line.replace("\n", " ") + "; needs root and iproute2")
        hostfile = tmp / "hosts"
        hostfile.write_text(f"{a.addr} slots={SLOTS}\n{b.addr} slots={SLOTS}\n")
        yield Nodes((a, b), hostfile)
    finally:
        _delete(names, devs)
        shutil.rmtree(tmp, ignore_errors=True)
