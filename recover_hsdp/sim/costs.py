"""The simulator's inputs: the job (`Scenario`) and the cost model (`CostModel`), with every
default's source, and the Young/Daly closed forms the checkpoint-restart engine is checked against.

What the POLICY decides (recover_hsdp.policy.CountModel, the tested count-level twin of
StaticWorldPolicy / AdaptiveWorldPolicy): after each loss, whether the step crossed a boundary,
G_ext, the layout installed next (G_cur, majors, minor R, spares) and therefore P = microbatches
every survivor computes per step. What the COST MODEL adds: seconds. A step lasts
P x t_mb + t_sync; a loss costs detect (or hang timeout) + repair + G_ext x t_mb; a restart costs
restart + load; a checkpoint save costs save. Nothing else is charged.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

HOUR = 3600.0
DAY = 86400.0

# Llama 3 405B (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days on
# 16,384 H100 -> 54 x 24 x 16384 / 419 = 50,677 GPU-hours per interruption.
LLAMA3_GPU_HOURS_PER_FAILURE = 54 * 24 * 16384 / 419


@dataclass
class CostModel:
    """Seconds charged by the simulator. `sources` says where each value came from."""

    t_mb: float = 0.35          # one microbatch (fwd+bwd) on one replica, seconds
    t_sync: float = 0.5         # per step: cross-replica reduction + optimizer, seconds
    detect: float = 10.0        # hard failure -> survivors know (ULFM heartbeat timeout)
    repair: float = 5.0         # agree + shrink + rewind of the snapshots, at scale
    hang_timeout: float = 120.0  # a hung rank is only declared dead after this timeout
    cr_detect: float = 10.0     # checkpoint-restart: failure -> job torn down
    restart: float = 600.0      # relaunch: allocation, init, load, first step (all in)
    load: float = 0.0           # checkpoint load when not already inside `restart`
    save: float = 30.0          # blocking part of a checkpoint save
    rejoin_after: float = 600.0  # a replaced replica can rejoin this long after its loss
    rejoin_stall: float = 5.0   # the survivors' pause to admit a rejoining replica
    cr_step_factor: float = 1.0  # checkpoint-restart's step time / ours (its plain stack)
    # small-scale contention (this 2-core box): per-microbatch time by alive processes.
    t_mb_by_alive: dict[int, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_SOURCES))

    def mb_time(self, alive_processes: int) -> float:
        if self.t_mb_by_alive:
            if alive_processes in self.t_mb_by_alive:
                return self.t_mb_by_alive[alive_processes]
            k = min(self.t_mb_by_alive, key=lambda a: abs(a - alive_processes))
            return self.t_mb_by_alive[k]
        return self.t_mb

    def set(self, name: str, value, source: str) -> None:
        setattr(self, name, value)
        self.sources[name] = source

    def as_dict(self) -> dict:
        d = asdict(self)
        d["t_mb_by_alive"] = {str(k): v for k, v in self.t_mb_by_alive.items()}
        return d


DEFAULT_SOURCES = {
    "t_mb": "assumed: Llama 3 405B at 16k H100 (~400 TFLOP/s/GPU, 16M tokens/step) is ~6 s/step "
            "over 16 microbatches per data-parallel rank -> ~0.35 s each",
    "t_sync": "assumed: 0.5 s per step for the deferred cross-replica reduction + optimizer",
    "detect": "Open MPI 5.0.11 default mpi_ft_detector_timeout = 10 s (ompi_info); a process "
              "crash on a live node is reported sooner by the runtime",
    "repair": "assumed (unmeasured at scale): agree + shrink over the failure domain, rewind; "
              "0.07 s measured at 4 ranks here (section 4 of docs/results.md minus the extension)",
    "hang_timeout": "torchtitan's recommended 120 s process-group timeout with torchft (#2899)",
    "cr_detect": "assumed = detect: the job is torn down after the same timeout",
    "restart": "10 min relaunch at ~100k GPUs (FT-HSDP, arXiv 2602.00277; ReCoVer paper [29])",
    "load": "0: inside the 10-minute restart at scale",
    "save": "assumed: 30 s blocking save (the async part overlaps training)",
    "rejoin_after": "assumed = restart: a replacement replica is up 10 min after the loss",
    "rejoin_stall": "assumed: one pause of ~10 steps' sync to re-layout and send state",
    "cr_step_factor": "assumed 1: at parity before any failure (docs/results.md section 2)",
}


@dataclass
class Scenario:
    """The job and its failure process."""

    gpus: int = 100_000
    gpus_per_replica: int = 128       # shard size x tensor width (Llama 3 405B: TP8 x PP16)
    grad_accum: int = 16              # G_init microbatches per replica per step
    tokens_per_mb: int = 8192         # Llama 3: 1 sequence x 8192 tokens per microbatch
    spares: int = 0                   # extra replicas allocated beyond W_train
    days: float = 30.0
    gpu_hours_per_failure: float = LLAMA3_GPU_HOURS_PER_FAILURE   # per-GPU MTBF
    gpus_per_node: int = 8
    node_fraction: float = 0.0        # failures that take a whole node
    hang_fraction: float = 0.0        # failures that hang (detected after hang_timeout)
    fatal_fraction: float = 0.0       # failures no replica-level scheme survives
    restart_below: float = 0.95       # in-place: scale back up when alive < this x W_train
    ckpt_interval_s: float | None = None   # in-place periodic checkpoints (None: 1 h)
    seed: int = 0

    @property
    def replicas(self) -> int:
        """W_train: replicas that contribute at the start (the spares are on top)."""
        return max(1, self.gpus // self.gpus_per_replica)

    @property
    def duration_s(self) -> float:
        return self.days * DAY

    @property
    def job_mtbf_s(self) -> float:
        """Mean time between failures of the whole allocation (W_train + spares)."""
        alloc = (self.replicas + self.spares) * self.gpus_per_replica
        return self.gpu_hours_per_failure * HOUR / alloc

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(replicas=self.replicas, job_mtbf_min=self.job_mtbf_s / 60.0)
        return d


# ---- closed forms ---------------------------------------------------------------------------
def young_interval(save: float, mtbf: float) -> float:
    """Young (1974): tau = sqrt(2 delta M)."""
    return math.sqrt(2.0 * save * mtbf)


def daly_interval(save: float, mtbf: float) -> float:
    """Daly (2006) first-order optimum: tau = sqrt(2 delta M) - delta (delta < 2M), else M."""
    if save >= 2.0 * mtbf:
        return mtbf
    return math.sqrt(2.0 * save * mtbf) - save


def daly_ettr(tau: float, save: float, restart: float, mtbf: float) -> float:
    """Fraction of wall time that is useful work for checkpoint-restart with exponential failures
    (rate 1/M at all times, also during saves and restarts; a failure during a restart starts it
    again): Daly (2006) eq. 13, T_wall / T_solve = M e^{R/M} (e^{(tau+delta)/M} - 1) / tau."""
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1((tau + save) / mtbf))


def stall_ettr(stall: float, mtbf: float) -> float:
    """Every failure stops the whole job for `stall` (failures queue): 1 - stall / M."""
    return max(0.0, 1.0 - stall / mtbf)
