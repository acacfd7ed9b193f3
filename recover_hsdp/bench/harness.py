"""What every benchmark needs, written once: arguments, child processes and jobs, interleaved
repeats, medians, the table and the JSON.

A benchmark module is then what it measures: its own arguments (added to :func:`parser`), the
arms it runs (:func:`interleaved` orders them so that load drifts hit every arm alike), its
summary (:func:`median`, :func:`spread`, :func:`median_after`), its rows (:func:`fmt`,
:func:`fmt_spec`), and one :func:`write_json` of the result, which carries :func:`machine` (host,
cores, versions, load at start and end) so that a number is never read without its conditions.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

#: the checkout this package runs from; an installed package (no checkout above it) works in
#: the current directory instead, never in site-packages
REPO = (Path(__file__).resolve().parents[2]
        if (Path(__file__).resolve().parents[2] / "pyproject.toml").is_file() else Path.cwd())
RESULTS_DIR = Path("bench") / "results"    # relative to the working directory, as documented


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
#: The one spelling of the options every benchmark shares (the `recover-hsdp train` keys'):
#: ``--replicas --shard-size --grad-accum --micro-batch-size --seq-len --steps --warmup
#: --repeats``; ``--out FILE`` is always the JSON result file, ``--work-dir DIR`` always a
#: folder. A benchmark's old spelling stays an alias (``aliases=``, named in its help).
SHARED_FLAGS = ("--replicas", "--shard-size", "--grad-accum", "--micro-batch-size", "--seq-len",
                "--steps", "--warmup", "--repeats", "--out", "--work-dir")


def parser(name: str, doc: str | None, /, *, out: str | None = None,
           timeout: float | None = None, aliases: dict[str, str] | None = None,
           **opts: Any) -> argparse.ArgumentParser:
    """``recover-hsdp bench NAME`` with the module docstring as help; ``--out`` (the JSON result
    file, default bench/results/<out>) and ``--timeout`` (seconds per job) when the benchmark
    has them; then the benchmark's own :func:`options` (``aliases``: name -> old flag)."""
    p = argparse.ArgumentParser(prog=f"recover-hsdp bench {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is not None:
        p.add_argument("--out", default=str(RESULTS_DIR / out), metavar="FILE",
                       help=f"the JSON result file (default {RESULTS_DIR / out})")
    if timeout is not None:
        p.add_argument("--timeout", type=float, default=timeout, metavar="S",
                       help=f"seconds per job (default {timeout:g})")
    return options(p, aliases=aliases, **opts)


def options(p: argparse.ArgumentParser, aliases: dict[str, str] | None = None,
            **opts: Any) -> argparse.ArgumentParser:
    """Add ``--name-with-dashes`` options, each ``name=default``, ``name=(default, help)`` or
    ``name=(default, help, type)``; the type is the default's, a False default makes a flag.
    ``aliases``: name -> an old spelling of its flag, still accepted (and named in the help)."""
    aliases = aliases or {}
    for name, spec in opts.items():
        default, hlp, *typ = spec if isinstance(spec, tuple) else (spec, None)
        flags = ["--" + name.replace("_", "-")] + ([aliases[name]] if name in aliases else [])
        if name in aliases:
            hlp = f"{hlp} (old spelling: {aliases[name]})"
        if default is False:
            p.add_argument(*flags, dest=name, action="store_true", help=hlp)
        else:
            p.add_argument(*flags, dest=name, default=default, help=hlp,
                           metavar=name.upper(), type=typ[0] if typ else type(default))
    unknown = set(aliases) - set(opts)
    assert not unknown, f"aliases of options that do not exist: {sorted(unknown)}"
    return p


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= lo, refused with the value named."""
    def conv(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {v!r}") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo} (got {n})")
        return n
    conv.__name__ = f"int>={lo}"
    return conv


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def int_list(text: str) -> list[int]:
    """An argparse type: a comma list of integers >= 1 (``2,4,8``)."""
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    if not xs or any(x < 1 for x in xs):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return xs


def choice_list(choices: Sequence[str], *, all_word: str | None = "all",
                what: str = "choice") -> Callable[[str], list[str]]:
    """An argparse type: a comma list from ``choices`` (or ``all``), returned in their order."""
    def conv(text: str) -> list[str]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        if all_word and names == [all_word]:
            return list(choices)
        bad = [p for p in names if p not in choices]
        if bad or not names:
            alt = f"{all_word} or " if all_word else ""
            raise argparse.ArgumentTypeError(
                f"unknown {what}(s) {', '.join(bad) or '(none)'}; choose from {alt}"
                f"{','.join(choices)}")
        return [p for p in choices if p in names]
    return conv


# ---------------------------------------------------------------------------------------------
# Progress lines, machine, JSON
# ---------------------------------------------------------------------------------------------
def command_line(name: str, argv: Sequence[str] | None, prog: str | None = None) -> str:
    """The command as the user typed it: ``recover-hsdp bench NAME ARGS`` (``prog`` instead of
    ``recover-hsdp bench NAME`` for a program of its own, e.g. ``python -m experiments.peers``)."""
    args = shlex.join(sys.argv[1:] if argv is None else argv)
    return f"{prog or f'recover-hsdp bench {name}'} {args}".strip()


def load() -> list[float]:
    """The 1/5/15-minute load averages, rounded: every result records them."""
    return [round(x, 2) for x in os.getloadavg()]


def say(name: str, msg: str, *, stream=sys.stderr, with_load: bool = True) -> None:
    """One progress line: ``[bench NAME HH:MM:SS load a/b/c] msg``."""
    tag = f" load {'/'.join(f'{x:.1f}' for x in os.getloadavg())}" if with_load else ""
    print(f"[bench {name} {time.strftime('%H:%M:%S')}{tag}] {msg}", file=stream, flush=True)


#: Linux's session autogroups: when on (1), CFS shares the CPU between SESSIONS first, then
#: between the tasks of each; None where the kernel has no such switch
AUTOGROUP = "/proc/sys/kernel/sched_autogroup_enabled"


def sched_autogroup(path: str = AUTOGROUP) -> Optional[int]:
    """0 or 1: whether the scheduler shares CPU per session (None: unknown). Beside other load
    it decides who gets the cores: a job whose ranks share one session (mpirun's) gets one
    session's share, a job whose ranks each start a session gets one share per rank
    (docs/results.md "Beside busy loops: sessions, not processes")."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def machine(**extra: Any) -> dict:
    """Where a number was measured: host, cores, Python, torch (if imported), load now, and
    the scheduler's session autogroup switch (:func:`sched_autogroup`)."""
    out = {"host": platform.node(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "load_start": load(),
           "sched_autogroup": sched_autogroup()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
    out.update(extra)
    return out


def result(name: str, argv: Sequence[str] | None, args: argparse.Namespace, *,
           prog: str | None = None, **extra: Any) -> dict:
    """A benchmark's JSON head: its command (:func:`command_line`), :func:`machine`, when it
    started, its arguments, no errors yet, then ``extra``."""
    return {"command": command_line(name, argv, prog), **machine(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args), "errors": [],
            **extra}


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1, **kw: Any) -> Path:
    """Write ``obj`` (dataclasses and paths as text) atomically; return the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=indent, default=str, **kw) + "\n")
    tmp.replace(p)
    return p


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------
def median(xs: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def median_after(values: Sequence[float], skip: int) -> float:
    """The median after dropping the first ``skip`` values (warm-up)."""
    v = list(values)[skip:]
    if not v:
        raise ValueError(f"no values after skipping {skip}")
    return float(statistics.median(v))


def quartiles(xs: Iterable[float | None]) -> tuple[float | None, float | None]:
    v = sorted(x for x in xs if x is not None)
    if not v:
        return None, None
    if len(v) == 1:
        return v[0], v[0]
    q = statistics.quantiles(v, n=4, method="inclusive")
    return q[0], q[2]


def spread(xs: Iterable[float | None]) -> dict:
    """n, median, min, max and the quartiles of the values that are not None."""
    v = [x for x in xs if x is not None]
    q1, q3 = quartiles(v)
    return {"n": len(v), "median": median(v), "min": min(v) if v else None,
            "max": max(v) if v else None, "p25": q1, "p75": q3}


def times(fn: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Wall seconds of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved(arms: Sequence[str], repeats: int) -> list[list[str]]:
    """The order of the arms in each repeat: forward, then reversed, alternately (A B, B A, ...),
    so that a load change during the run lands on every arm alike."""
    return [list(arms) if r % 2 == 0 else list(reversed(arms)) for r in range(repeats)]


# ---------------------------------------------------------------------------------------------
# Numbers in tables
# ---------------------------------------------------------------------------------------------
def fmt(x: float | None, nd: int = 3, unit: str = "", none: str = "-") -> str:
    """``x`` with ``nd`` decimals and a unit; ``none`` for a missing value."""
    return none if x is None else f"{x:.{nd}f}{unit}"


def verdict(ok: bool | None) -> str:
    """A target's verdict: MET, NOT MET, or - when it could not be judged."""
    return "-" if ok is None else ("MET" if ok else "NOT MET")


def load_text(x: Sequence[float] | None) -> str:
    """Load averages as ``a/b/c``; - when missing."""
    return "-" if not x else "/".join(f"{v:.1f}" for v in x)


def header(result: dict, name: str, versions: str = "", prog: str | None = None) -> list[str]:
    """A report's first two lines: the command (``prog`` as in :func:`command_line`), then host,
    cpus, torch (+``versions``), the load at start and end, and the wall time (the keys
    :func:`machine` and the benchmark write)."""
    return [f"{prog or f'recover-hsdp bench {name}'}   ({result.get('command', '')})",
            f"host {result.get('host', '?')}, {result.get('cpus', '?')} cpus, torch "
            f"{result.get('torch', '?')}{versions}; load (1/5/15 min) at start "
            f"{load_text(result.get('load_start'))}, at end {load_text(result.get('load_end'))}; "
            f"wall {fmt(result.get('wall_s'), 0, ' s')}"
            + ("; sched autogroup ON (CPU shared per session)"
               if result.get("sched_autogroup") == 1 else "")]


def footer(result: dict) -> list[str]:
    """A report's last lines: one ``! error`` line each, then where the JSON went."""
    return ([f"! {e}" for e in result.get("errors", [])]
            + ([f"JSON: {result['out']}"] if result.get("out") else []))


@contextlib.contextmanager
def figure(path: str | os.PathLike, *args: Any, **kw: Any):
    """``plt.subplots(*args, **kw)`` on the Agg backend: yields (fig, axes), then lays the figure
    out, saves it to ``path`` (110 dpi) and closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **kw)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def fmt_spec(x: float | None, spec: str, none: str = "-") -> str:
    """``format(x, spec)`` (``",.0f"``, ``".2e"``, ...); ``none`` for a missing value."""
    return none if x is None else format(x, spec)


# ---------------------------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------------------------
def child_env(threads: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a child process: this checkout first on PYTHONPATH, no MPI rank or
    worker-function variables inherited, OMP_NUM_THREADS when given, mpirun allowed as root."""
    env = dict(os.environ)
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + pp if pp else "")
    for k in ("OMPI_COMM_WORLD_RANK", "RECOVER_HSDP_WORKER_FN"):
        env.pop(k, None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra)
    return env


def run_logged(cmd: Sequence[Any], log: str | os.PathLike, timeout: float, *,
               env: dict[str, str] | None = None,
               cwd: str | os.PathLike = REPO) -> tuple[int, float]:
    """Run ``cmd`` in its own session, its output (after the command line) to ``log``:
    (exit code, wall s). Past ``timeout`` s the whole process group is SIGKILLed and the exit
    code is 124; any exception while waiting (Ctrl-C) kills the group too and is re-raised.
    ``env``: default :func:`child_env`."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(map(str, cmd)) + "\n")
        f.flush()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd,
                                env=child_env() if env is None else env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return rc, time.perf_counter() - t


def run_captured(cmd: Sequence[Any], timeout: float, *, env: dict[str, str] | None = None,
                 keep: int = 3000) -> tuple[int, str, float]:
    """:func:`run_logged` with the output kept: (exit code, its last ``keep`` characters,
    wall s); 124 after ``timeout`` s."""
    with tempfile.TemporaryDirectory(prefix="bench_") as d:
        rc, wall = run_logged(cmd, Path(d) / "log", timeout, env=env)
        out = (Path(d) / "log").read_text(errors="replace").split("\n", 1)[-1]
    return rc, out[-keep:], wall


@contextlib.contextmanager
def work_dir(given: str | None, prefix: str, keep: bool = False):
    """Where a benchmark's runs go: ``given`` (kept), else a temporary directory removed at the
    end unless ``keep``."""
    work = Path(given).resolve() if given else Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if not given and not keep:
            shutil.rmtree(work, ignore_errors=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float) -> bool:
    """True once something listens on 127.0.0.1:port, False after ``timeout`` seconds."""
    end = time.time() + timeout
    while time.time() < end:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def tail(path: str | os.PathLike, n: int = 20) -> str:
    """The last ``n`` lines of a log (empty when it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


