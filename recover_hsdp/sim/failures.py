"""Failure processes: exponential per GPU (the rate follows the GPUs in use) or a trace file.

A failure takes down the replica(s) holding the failed GPU or node: kinds `gpu` (one replica),
`node` (every replica on the node: gpus_per_node / gpus_per_replica of them when replicas are
smaller than a node, else one), `hang` (one replica, but nobody notices before the hang timeout)
and `fatal` (nothing replica-level survives it: the job restarts from its last checkpoint).

Trace file: JSON lines, a JSON list, or CSV with a header; one failure per entry with either `t`
(seconds since the start) or `step` (fires at that step's gradient synchronisation, the first
time the job reaches it), and optionally `kind`, `replicas` (how many die together) and `role`
(the victim's role, e.g. `major`; default a uniformly random alive replica).
"""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

KINDS = ("gpu", "node", "hang", "fatal")


class TraceError(ValueError):
    """A trace file that cannot be read: one line, the CLI exits 2."""


@dataclass(frozen=True)
class Failure:
    time: float
    kind: str = "gpu"
    replicas: int = 1
    role: str | None = None
    step: int | None = None


class PoissonFailures:
    """Exponential failures, one event per `gpu_hours_per_failure` GPU-hours of the GPUs in use.

    The rate changes with the GPUs in use; the process is memoryless, so the next failure is
    simply redrawn from the time of the change."""

    def __init__(self, gpu_hours_per_failure: float, rng: random.Random, *, gpus_per_node: int,
                 gpus_per_replica: int, node_fraction: float = 0.0, hang_fraction: float = 0.0,
                 fatal_fraction: float = 0.0) -> None:
        self.mtbf_gpu_s = gpu_hours_per_failure * 3600.0
        self.rng = rng
        self.node_replicas = max(1, gpus_per_node // gpus_per_replica)
        self.p = (fatal_fraction, node_fraction, hang_fraction)
        self._next: float | None = None
        self._gpus = -1

    def peek(self, t: float, gpus: int) -> float:
        """Time of the next failure, given `gpus` in use from `t` on."""
        if self._next is None or gpus != self._gpus:
            self._gpus = gpus
            self._next = (t + self.rng.expovariate(gpus / self.mtbf_gpu_s)) if gpus > 0 \
                else float("inf")
        return self._next

    def reset(self) -> None:
        """Forget the drawn failure (memoryless: the next one is drawn from the next peek)."""
        self._next = None

    def pop(self) -> Failure:
        t = self._next
        assert t is not None
        self._next = None
        u = self.rng.random()
        fatal, node, hang = self.p
        if u < fatal:
            return Failure(t, "fatal")
        if u < fatal + node:
            return Failure(t, "node", self.node_replicas)
        if u < fatal + node + hang:
            return Failure(t, "hang")
        return Failure(t, "gpu")

    def due_at_step(self, step: int) -> list[Failure]:
        return []

    @property
    def next_step(self) -> float:
        return float("inf")


class TraceFailures:
    """Failures replayed from a list (time-keyed ones in time order; step-keyed ones fire when
    the job first reaches that step's synchronisation)."""

    def __init__(self, failures: list[Failure]) -> None:
        self.timed = sorted((f for f in failures if f.step is None), key=lambda f: f.time)
        self.stepped = sorted((f for f in failures if f.step is not None), key=lambda f: f.step)
        self._i = 0

    def peek(self, t: float, gpus: int) -> float:
        return self.timed[self._i].time if self._i < len(self.timed) else float("inf")

    def pop(self) -> Failure:
        self._i += 1
        return self.timed[self._i - 1]

    @property
    def next_step(self) -> float:
        return self.stepped[0].step if self.stepped else float("inf")

    def due_at_step(self, step: int) -> list[Failure]:
        out = []
        while self.stepped and self.stepped[0].step <= step:
            out.append(self.stepped.pop(0))
        return out


def read_trace(path: str | Path) -> list[Failure]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror or e}") from None
    rows: list[dict]
    try:
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        elif text.lstrip().startswith("{"):
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows = list(csv.DictReader(text.splitlines()))
    except (json.JSONDecodeError, csv.Error) as e:
        raise TraceError(f"{path}: not JSON lines, a JSON list or CSV ({e})") from None
    out = []
    for i, row in enumerate(rows, 1):
        try:
            kind = str(row.get("kind") or "gpu")
            if kind not in KINDS:
                raise ValueError(f"kind {kind!r} not in {', '.join(KINDS)}")
            t, step = row.get("t"), row.get("step")
            if (t in (None, "")) == (step in (None, "")):
                raise ValueError("give exactly one of t (seconds) and step")
            n = int(row.get("replicas") or 1)
            if n < 1:
                raise ValueError(f"replicas {n} < 1")
            out.append(Failure(float(t) if t not in (None, "") else 0.0, kind, n,
                               row.get("role") or None,
                               int(step) if step not in (None, "") else None))
        except (TypeError, ValueError, AttributeError) as e:
            raise TraceError(f"{path}: entry {i}: {e}") from None
    return out
