"""Failure schedules: parse, validate and generate the (step, replica, local rank, location) list.

Invariants:
- A schedule is plain data and is a pure function of its inputs: every rank reads the same file or
  generates the same list from (parallel spec, seed, count, step range, location weights) with its
  own ``random.Random(seed)``; no communication, no global RNG.
- A schedule that validates kills at most W_init - 1 replicas, each replica at exactly one point of
  the iteration (several local ranks of one replica may die together at that point), and names only
  steps in [start_step, steps).
- Every error is a ScheduleError with a one-line message naming the entry
  ("failures.schedule[3]: replica 7 out of range [0, 4)").
"""
from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import yaml

from recover_hsdp.faults.locations import (
    ALWAYS_REACHED,
    BUCKET_LOCATIONS,
    DATA_PLANE,
    LOCATIONS,
    MICROBATCH_LOCATIONS,
    RECOVERY,
    index_field,
    position,
)

SOURCE = "failures.schedule"
_FIELDS = ("step", "replica", "local_rank", "location", "microbatch", "bucket", "kind")
#: what the rank does at the point: kill = SIGKILL itself; wedge = its main thread blocks
#: forever while its heartbeat thread beats on (a deadlocked loader, a stuck CUDA sync): only the
#: launcher's progress judgement (watchdog.progress_timeout_s) can end it
KINDS = ("kill", "wedge")


class ScheduleError(ValueError):
    """A malformed schedule or generation request. ``index`` is the entry index (or None)."""

    def __init__(self, message: str, index: int | None = None, field: str | None = None):
        super().__init__(message)
        self.index = index
        self.field = field


@dataclass(frozen=True)
class FailureEntry:
    """One scheduled kill: global rank (replica, local_rank) SIGKILLs itself at (step, location).

    ``microbatch`` is set exactly for forward/backward/extension, ``bucket`` exactly for
    reduce/re_reduce; both are None elsewhere.
    """

    step: int
    replica: int
    location: str
    local_rank: int = 0
    microbatch: int | None = None
    bucket: int | None = None
    kind: str = "kill"

    @property
    def index(self) -> int | None:
        """The microbatch or bucket index, whichever this location takes."""
        return self.microbatch if self.microbatch is not None else self.bucket

    @property
    def sort_key(self) -> tuple:
        return (self.step, position(self.location, self.index), self.replica, self.local_rank)

    def point(self) -> tuple:
        """Where in the run the kill happens (without who)."""
        return (self.step, self.location, self.microbatch, self.bucket)

    def describe(self) -> str:
        where = self.location
        if self.microbatch is not None:
            where += f" microbatch {self.microbatch}"
        if self.bucket is not None:
            where += f" bucket {self.bucket}"
        return (f"step {self.step}, {where}, replica {self.replica} local_rank {self.local_rank}"
                + (f" ({self.kind})" if self.kind != "kill" else ""))

    def to_dict(self) -> dict:
        d = {"step": self.step, "replica": self.replica, "local_rank": self.local_rank,
             "location": self.location}
        if self.microbatch is not None:
            d["microbatch"] = self.microbatch
        if self.bucket is not None:
            d["bucket"] = self.bucket
        if self.kind != "kill":
            d["kind"] = self.kind
        return d

    @classmethod
    def from_mapping(cls, item, index: int = 0, source: str = SOURCE) -> "FailureEntry":
        """Parse one entry; shape errors (types, unknown keys/location) raise ScheduleError."""
        where = f"{source}[{index}]"
        if not isinstance(item, Mapping):
            raise ScheduleError(f"{where}: expected a mapping with keys step, replica, location "
                                f"(local_rank, microbatch, bucket optional), got {item!r}", index)
        unknown = sorted(str(k) for k in item if k not in _FIELDS)
        if unknown:
            raise ScheduleError(f"{where}: unknown key {unknown[0]!r} (allowed: "
                                f"{', '.join(_FIELDS)})", index, unknown[0])
        for key in ("step", "replica", "location"):
            if key not in item:
                raise ScheduleError(f"{where}: missing required key {key!r}", index, key)
        kind = item.get("kind", "kill")
        if kind not in KINDS:
            raise ScheduleError(f"{where}: unknown kind {kind!r} (known: {', '.join(KINDS)})",
                                index, "kind")
        location = item["location"]
        if not isinstance(location, str) or location not in LOCATIONS:
            raise ScheduleError(f"{where}: unknown location {location!r} (known: "
                                f"{', '.join(LOCATIONS)})", index, "location")
        takes = index_field(location)
        for key in ("microbatch", "bucket"):
            if key in item and item[key] is not None and key != takes:
                raise ScheduleError(f"{where}: location {location!r} takes no {key!r}"
                                    + (f" (it takes {takes!r})" if takes else ""), index, key)

        def integer(key, default=None):
            value = item.get(key, default)
            if value is None and default is not None:
                value = default
            if isinstance(value, bool) or not isinstance(value, int):
                raise ScheduleError(f"{where}: {key} must be an integer, got {value!r}", index, key)
            if value < 0:
                raise ScheduleError(f"{where}: {key} {value} is negative", index, key)
            return value

        return cls(
            step=integer("step"),
            replica=integer("replica"),
            location=location,
            local_rank=integer("local_rank", 0),
            microbatch=integer("microbatch", 0) if location in MICROBATCH_LOCATIONS else None,
            bucket=integer("bucket", 0) if location in BUCKET_LOCATIONS else None,
            kind=kind,
        )


class FailureSchedule:
    """An ordered, immutable list of FailureEntry (file order is kept for error messages)."""

    def __init__(self, entries: Iterable[FailureEntry] = (), source: str = SOURCE):
        self.entries: tuple[FailureEntry, ...] = tuple(entries)
        self.source = source

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def empty(cls) -> "FailureSchedule":
        return cls(())

    @classmethod
    def from_list(cls, items, source: str = SOURCE) -> "FailureSchedule":
        """From a list of mappings (plain dicts, or OmegaConf ListConfig/DictConfig)."""
        if items is None:
            return cls((), source)
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
            raise ScheduleError(f"{source}: expected a list of entries, got {type(items).__name__}")
        return cls([FailureEntry.from_mapping(it, i, source) for i, it in enumerate(items)], source)

    @classmethod
    def from_yaml(cls, text: str, source: str = SOURCE) -> "FailureSchedule":
        """A YAML list of entries, or a mapping whose only key is ``schedule`` holding that list."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ScheduleError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
        if isinstance(data, Mapping):
            if set(data) != {"schedule"}:
                raise ScheduleError(f"{source}: a schedule file is a YAML list of entries "
                                    f"(or {{schedule: [...]}}), got keys {sorted(map(str, data))}")
            data = data["schedule"]
        return cls.from_list(data, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FailureSchedule":
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ScheduleError(f"{SOURCE}: cannot read schedule file {os.fspath(path)!r}: "
                                f"{e.strerror}") from None
        try:
            return cls.from_yaml(text)
        except ScheduleError as e:
            raise ScheduleError(f"{e} (in {os.fspath(path)})", e.index, e.field) from None

    # -- plain data ---------------------------------------------------------------------------
    def as_dicts(self) -> list[dict]:
        return [e.to_dict() for e in self.entries]

    def to_yaml(self) -> str:
        if not self.entries:
            return "[]\n"
        return yaml.safe_dump(self.as_dicts(), sort_keys=False, default_flow_style=None)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_yaml())

    def __iter__(self) -> Iterator[FailureEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __eq__(self, other) -> bool:
        return isinstance(other, FailureSchedule) and self.entries == other.entries

    def __repr__(self) -> str:
        return f"FailureSchedule({len(self.entries)} entries)"

    def sorted(self) -> "FailureSchedule":
        return FailureSchedule(sorted(self.entries, key=lambda e: e.sort_key), self.source)

    def for_rank(self, replica: int, local_rank: int) -> list[FailureEntry]:
        return [e for e in self.entries if e.replica == replica and e.local_rank == local_rank]

    def killed_replicas(self) -> set[int]:
        return {e.replica for e in self.entries}

    # -- validation ---------------------------------------------------------------------------
    def validate(self, replicas: int, shard_size: int, start_step: int = 0,
                 steps: int | None = None, n_buckets: int | None = None) -> "FailureSchedule":
        """Reject a schedule that cannot run as written; returns self.

        replicas = W_init, shard_size = S (ranks per replica), start_step = the first step this
        run executes (earlier steps are in the past), steps = run.steps (valid steps are
        [start_step, steps)), n_buckets = gradient buckets per reduction if known.
        """
        src = self.source
        if replicas < 1 or shard_size < 1:
            raise ScheduleError(f"{src}: need replicas >= 1 and shard_size >= 1, "
                                f"got {replicas} and {shard_size}")
        seen: dict[FailureEntry, int] = {}
        first_kill: dict[int, int] = {}  # replica -> index of its earliest entry
        for i, e in enumerate(self.entries):
            where = f"{src}[{i}]"
            if e.replica >= replicas:
                raise ScheduleError(f"{where}: replica {e.replica} out of range [0, {replicas})",
                                    i, "replica")
            if e.local_rank >= shard_size:
                raise ScheduleError(f"{where}: local_rank {e.local_rank} out of range "
                                    f"[0, {shard_size})", i, "local_rank")
            if e.step < start_step:
                raise ScheduleError(f"{where}: step {e.step} is in the past (the run starts at "
                                    f"step {start_step})", i, "step")
            if steps is not None and e.step >= steps:
                raise ScheduleError(f"{where}: step {e.step} is beyond run.steps={steps} (valid "
                                    f"steps are [{start_step}, {steps}))", i, "step")
            if n_buckets is not None and e.bucket is not None and e.bucket >= n_buckets:
                raise ScheduleError(f"{where}: bucket {e.bucket} out of range [0, {n_buckets})",
                                    i, "bucket")
            if e in seen:
                raise ScheduleError(f"{where}: duplicate of {src}[{seen[e]}] ({e.describe()})",
                                    i, "entry")
            seen[e] = i
        # A replica dies at its first kill point; a later point can never be reached by it (its
        # surviving ranks leave through the gate). Several local ranks at the SAME point is fine.
        order = sorted(range(len(self.entries)), key=lambda i: (self.entries[i].sort_key, i))
        for i in order:
            e = self.entries[i]
            j = first_kill.setdefault(e.replica, i)
            if j != i and self.entries[j].point() != e.point():
                k = self.entries[j]
                raise ScheduleError(
                    f"{src}[{i}]: replica {e.replica} is already killed by {src}[{j}] "
                    f"({k.describe()}) before this entry ({e.describe()})", i, "replica")
        if len(first_kill) >= replicas:
            last = max(first_kill.values())
            raise ScheduleError(f"{src}: kills every replica (all {replicas} of them; the last "
                                f"at {src}[{last}]); at least one replica must survive",
                                last, "replica")
        return self


def load_schedule(path: str | os.PathLike) -> FailureSchedule:
    return FailureSchedule.load(path)


# -- generation -----------------------------------------------------------------------------
DEFAULT_WEIGHTS: dict[str, float] = {loc: 1.0 for loc in LOCATIONS
                                     if loc in ALWAYS_REACHED and loc not in RECOVERY
                                     and loc not in DATA_PLANE}


def _weights(location_weights: Mapping[str, float] | None) -> tuple[list[str], list[float]]:
    given = DEFAULT_WEIGHTS if not location_weights else dict(location_weights)
    for loc, w in given.items():
        if loc not in LOCATIONS:
            raise ScheduleError(f"failures.location_weights: unknown location {loc!r} (known: "
                                f"{', '.join(LOCATIONS)})", field="location_weights")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
            raise ScheduleError(f"failures.location_weights.{loc}: weight must be a number >= 0, "
                                f"got {w!r}", field="location_weights")
    # iterate in LOCATIONS order, never in mapping order: identical on every rank by construction
    locs = [loc for loc in LOCATIONS if given.get(loc, 0) > 0]
    if not locs:
        raise ScheduleError("failures.location_weights: every weight is zero",
                            field="location_weights")
    return locs, [float(given[loc]) for loc in locs]


def generate(replicas: int, shard_size: int, grad_accum: int, n_buckets: int, seed: int,
             count: int, step_range: Sequence[int],
             location_weights: Mapping[str, float] | None = None) -> FailureSchedule:
    """A random but reproducible schedule of ``count`` kills, sorted by step.

    Distinct replicas (so never more than replicas - 1), steps drawn uniformly from the half-open
    ``step_range`` [lo, hi), locations by ``location_weights`` (default: equal weights over the
    locations every step reaches), local rank uniform in [0, shard_size), microbatch uniform in
    [0, grad_accum) for forward/backward (always reached: every alive replica computes at least
    G_init microbatches), microbatch 0 for extension (the first extension microbatch), bucket
    uniform in [0, n_buckets). Uses only ``random.Random(seed)``: the same call gives the same
    schedule in any process.
    """
    for name, value, low in (("replicas", replicas, 1), ("shard_size", shard_size, 1),
                             ("grad_accum", grad_accum, 1), ("n_buckets", n_buckets, 1),
                             ("count", count, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ScheduleError(f"failures: {name} must be an integer >= {low}, got {value!r}",
                                field=name)
    if count > replicas - 1:
        raise ScheduleError(f"failures.count: {count} kills of distinct replicas would leave no "
                            f"replica alive (W_init = {replicas}; at most {replicas - 1})",
                            field="count")
    if step_range is None or len(step_range) != 2:
        raise ScheduleError(f"failures.step_range: expected [lo, hi), got {step_range!r}",
                            field="step_range")
    lo, hi = step_range
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (lo, hi)) or not 0 <= lo < hi:
        raise ScheduleError(f"failures.step_range: expected integers 0 <= lo < hi, got "
                            f"[{lo!r}, {hi!r})", field="step_range")
    locs, weights = _weights(location_weights)
    rng = random.Random(seed)
    victims = rng.sample(range(replicas), count)
    entries = []
    for replica in victims:
        step = rng.randrange(lo, hi)
        location = rng.choices(locs, weights=weights)[0]
        local_rank = rng.randrange(shard_size)
        microbatch = bucket = None
        if location in MICROBATCH_LOCATIONS:
            microbatch = 0 if location == "extension" else rng.randrange(grad_accum)
        elif location in BUCKET_LOCATIONS:
            bucket = rng.randrange(n_buckets)
        entries.append(FailureEntry(step=step, replica=replica, location=location,
                                    local_rank=local_rank, microbatch=microbatch, bucket=bucket))
    entries.sort(key=lambda e: e.sort_key)
    return FailureSchedule(entries)
