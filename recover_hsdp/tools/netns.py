"""Namespaced "nodes" on one machine (as root): a network + UTS namespace per node, all on a bridge.

Open MPI's ULFM runs across them as across real nodes: a daemon (prted) per node started by the
launch agent (an rsh-like script this module writes beside the hostfile), TCP between the nodes,
shared memory inside one. Only the network and the hostname are separate: pids and files are
shared, so a supervisor signals any rank by the pid in its heartbeat and reads the run directory
as usual. Used by `recover-hsdp chaos --nodes N` and by the tests (tests/e2e/_netns.py).

    with nodes(3) as ns:
        cmd = ns.on(0, [python, "-m", "recover_hsdp.cli", "train", ..., *ns.train_overrides()])
        subprocess.Popen(cmd, env=ns.env(), start_new_session=True)

Layout: node i is the namespace PREFIX<tag>n<i> with address SUBNET.<i+1> on its end of a veth
pair whose other end is a port of the bridge in the hub namespace PREFIX<tag>h (the bridge is
not in the caller's namespace: the machine's own network is untouched). Making them needs root
(CAP_SYS_ADMIN) and iproute2; a failure raises NetnsError with one line. Teardown always runs:
every process left in a node's namespace is SIGKILLed (the launcher, mpirun, prted, ranks),
then the namespaces (and with them the veths and the bridge) are deleted.

(Recipe: a two-namespace Open MPI ULFM run, 2026-11-30, ../shared/netns/README.md. Separate
hostnames: one shared hostname made Open MPI's shared-memory transport crash; GLOO_SOCKET_IFNAME:
the node names do not resolve; `--map-by ppr:N:node`: without it every rank landed on node 0.)
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

ENV_NODES = "RECOVER_HSDP_NSRSH_NODES"
SUBNET = "10.77.0"
#: ranks per node by default: the hostfile's slots and `--map-by ppr:N:node`
SLOTS = 4
PREFIX = "rhsdp"
#: how often the kill loop re-looks at a namespace's processes (pacing only)
PACE_S = 0.02

#: mpirun's launch agent (`--mca plm_rsh_agent`), also used to start the launcher on node 0:
#: `nsrsh [opts] HOST CMD...` runs CMD inside HOST's network namespace, in a fresh UTS namespace
#: whose hostname is the node's name, with GLOO_SOCKET_IFNAME set to the node's interface. The
#: nodes come from RECOVER_HSDP_NSRSH_NODES: "ADDR=NETNS:DEV ...".
AGENT_TEXT = r"""#!/usr/bin/env bash
# written by recover_hsdp/tools/netns.py: rsh-like launch agent into a namespaced node
while [[ "$1" == -* ]]; do shift; done
host=$1; shift
ns=""; dev=""
for n in $RECOVER_HSDP_NSRSH_NODES; do
  if [[ "${n%%=*}" == "$host" ]]; then v=${n#*=}; ns=${v%%:*}; dev=${v#*:}; fi
done
if [[ -z "$ns" ]]; then
  echo "nsrsh: unknown host $host (RECOVER_HSDP_NSRSH_NODES='$RECOVER_HSDP_NSRSH_NODES')" >&2
  exit 255
fi
# A daemon killed by a signal (a node loss played by SIGKILLing it) leaves its session silent,
# as an ssh session to a dead machine is, until mpirun goes: had the session ended at once with
# the daemon's 137, PRTE would say "A daemon failed to report back after being spawned" instead
# of "lost communication with a remote daemon" (which of the two won was a race).
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $ns; export GLOO_SOCKET_IFNAME=$dev; $*
rc=\$?; if [ \$rc -gt 128 ]; then exec </dev/null >/dev/null 2>&1
while kill -0 \$PPID; do sleep 1; done; fi; exit \$rc"
"""


class NetnsError(RuntimeError):
    """The namespaces could not be made (one line: why)."""


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
    agent: Path = Path("nsrsh")

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
        return [str(self.agent), self.nodes[i].addr, shlex.join([str(c) for c in cmd])]

    def mpirun_args(self, hostfile: Path | None = None) -> list[str]:
        return ["--hostfile", str(hostfile or self.hostfile), "--map-by", f"ppr:{self.slots}:node",
                "--mca", "plm_rsh_agent", str(self.agent),
                "--mca", "oob_tcp_if_include", self.subnet,
                "--mca", "btl_tcp_if_include", self.subnet]

    def train_overrides(self) -> list[str]:
        """`recover-hsdp train` overrides for a job across every node, launched on node 0."""
        return [f"run.store_host={self.nodes[0].addr}",
                "run.mpirun_args=[" + ",".join(self.mpirun_args()) + "]"]

    def pids(self, i: int) -> list[int]:
        """Every process inside node ``i``'s network namespace."""
        return _ns_pids(self.nodes[i].name)

    def node_of(self, pid: int) -> int | None:
        """Which node a process runs on (by its network namespace), None if none/gone."""
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
        """SIGKILL every process on every node; return the pids that were alive."""
        return _kill_ns([n.name for n in self.nodes], deadline)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` exit {p.returncode}: "
                         f"{(p.stderr or p.stdout).strip().splitlines()[-1:] or ['']}")
    return p


def _ns_pids(name: str) -> list[int]:
    p = _ip("netns", "pids", name, check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()] if p.returncode == 0 else []


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _kill_ns(names: Sequence[str], deadline: float) -> list[int]:
    end = time.monotonic() + float(deadline)
    seen: list[int] = []
    # kill until nothing is left: a dying launcher may still have forked (bounded by deadline)
    while time.monotonic() < end:
        pids = [p for n in names for p in _ns_pids(n) if p != os.getpid()]
        live = [p for p in pids if not _gone(p)]
        if not live:
            break
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while time.monotonic() < end and not all(_gone(p) for p in live):
            time.sleep(PACE_S)
        seen += [p for p in live if p not in seen]
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
    """Namespaces left by an earlier session whose process is gone (PREFIX<pid><suffix>)."""
    out = []
    for n in _ip("netns", "list", check=False).stdout.split():
        if not n.startswith(PREFIX):
            continue
        digits = ""
        for ch in n[len(PREFIX):]:
            if not ch.isdigit():
                break
            digits += ch
        if digits and not Path(f"/proc/{digits}").exists():
            out.append(n)
    return out


def names_for(tag: str, n: int) -> tuple[list[str], list[str], str]:
    """(node namespaces, their veth ends in the caller's namespace before the move, hub)."""
    nodes = [f"{PREFIX}{tag}n{i}" for i in range(n)]
    devs = [f"rh{tag}n{i}"[-15:] for i in range(n)] + [f"rh{tag}p{i}"[-15:] for i in range(n)]
    return nodes, devs, f"{PREFIX}{tag}h"


def _make(tag: str, n: int) -> tuple[Node, ...]:
    names, devs, hub = names_for(tag, n)
    nodes = tuple(Node(names[i], devs[i], f"{SUBNET}.{i + 1}") for i in range(n))
    _ip("netns", "add", hub)
    _ip("-n", hub, "link", "add", "br0", "type", "bridge")
    _ip("-n", hub, "link", "set", "br0", "up")
    _ip("-n", hub, "link", "set", "lo", "up")
    for i, nd in enumerate(nodes):
        port = devs[n + i]
        _ip("netns", "add", nd.name)
        _ip("link", "add", nd.dev, "type", "veth", "peer", "name", port)
        _ip("link", "set", nd.dev, "netns", nd.name)
        _ip("link", "set", port, "netns", hub)
        _ip("-n", hub, "link", "set", port, "master", "br0")
        _ip("-n", hub, "link", "set", port, "up")
        _ip("-n", nd.name, "addr", "add", f"{nd.addr}/24", "dev", nd.dev)
        _ip("-n", nd.name, "link", "set", "lo", "up")
        _ip("-n", nd.name, "link", "set", nd.dev, "up")
    # every node answers node 0 before anything is launched
    if shutil.which("ping"):
        for nd in nodes[1:]:
            p = subprocess.run(["ip", "netns", "exec", nodes[0].name, "ping", "-c", "1", "-W",
                                "5", nd.addr], capture_output=True, text=True, timeout=30)
            if p.returncode != 0:
                raise NetnsError(f"{nodes[0].name} cannot reach {nd.addr}: "
                                 f"{p.stdout.strip()[-200:]}")
    return nodes


@contextlib.contextmanager
def nodes(n: int = 2, slots: int = SLOTS, tag: str | None = None) -> Iterator[Nodes]:
    """``n`` namespaced nodes on a bridge, each with ``slots`` slots in the hostfile."""
    if n < 1 or n > 200:
        raise NetnsError(f"nodes: n must be 1..200 (got {n})")
    tag = tag or str(os.getpid())
    names, devs, hub = names_for(tag, n)
    tmp = Path(tempfile.mkdtemp(prefix="netns_nodes."))
    try:
        if shutil.which("ip") is None:
            raise NetnsError("`ip` (iproute2) is not installed")
        try:
            _delete(_stale() + [m for m in names + [hub] if Path(f"/run/netns/{m}").exists()])
            made = _make(tag, n)
        except (OSError, subprocess.SubprocessError) as e:
            raise NetnsError(str(e).replace("\n", " ")) from e
        agent = tmp / "nsrsh"
        agent.write_text(AGENT_TEXT)
        agent.chmod(0o755)
        hostfile = tmp / "hosts"
        hostfile.write_text("".join(f"{nd.addr} slots={slots}\n" for nd in made))
        yield Nodes(made, hostfile, slots, agent)
    finally:
        _delete(names + [hub], devs)
        shutil.rmtree(tmp, ignore_errors=True)
