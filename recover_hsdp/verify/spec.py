"""What a run directory says about how to replay it: ``RunSpec.load(run_dir)``.

Reads ``meta.json`` (w_init, g_init, B, shard_size, seed, data_fingerprint, param_layout) and
``config.yaml`` (model, data, parallel, policy, optim) through ``recover_hsdp.record.read_run``
and turns them into what the replay needs: the model config, the REPLICA microbatch data config
(``micro_batch_size = parallel.micro_batch_size * shard_size``, docs/interfaces.md), the policy
kind, the optimizer config and the flat-parameter layout. Anything missing or contradictory raises
:class:`VerifyInputError` with a one-line message (verify exits 2).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from recover_hsdp.record import RecordError, RunRecord, read_run


class VerifyInputError(RuntimeError):
    """The run directory cannot be verified (missing, unreadable, inconsistent): exit 2."""


POLICIES = ("static", "adaptive")


def _section(config: Mapping | None, key: str) -> Any:
    if not isinstance(config, Mapping):
        return None
    return config.get(key)


def _policy_kind(config: Mapping | None, meta: Mapping) -> tuple[str, str]:
    """(kind, where it came from)."""
    for where, value in (("meta.policy", meta.get("policy")),
                         ("config.policy", _section(config, "policy"))):
        if isinstance(value, Mapping):
            for key in ("name", "kind", "type"):
                if isinstance(value.get(key), str):
                    value = value[key]
                    where = f"{where}.{key}"
                    break
        if isinstance(value, str):
            kind = value.strip().lower()
            if kind not in POLICIES:
                raise VerifyInputError(f"{where}={value!r}: unknown policy (known: "
                                       f"{', '.join(POLICIES)})")
            return kind, where
    return "static", "default"


def _known(cls: type, section: Mapping, group: str, ignored: list[str]) -> dict:
    fields = {f.name for f in dataclasses.fields(cls)}
    ignored.extend(f"{group}.{k}" for k in section if k not in fields)
    return {k: v for k, v in section.items() if k in fields}


@dataclass
class RunSpec:
    run_dir: Path
    record: RunRecord
    w_init: int
    g_init: int
    B: int
    shard_size: int
    seed: int
    policy: str
    policy_source: str
    model_cfg: Any              # recover_hsdp.model.ModelConfig (vocab resolved)
    data_cfg: Any               # recover_hsdp.data.DataConfig of the REPLICA microbatch
    mbs: int                    # per-rank micro batch size (sequences)
    seq_len: int
    optim_cfg: Any              # recover_hsdp.optim.OptimConfig (total_steps resolved)
    layout: list                # FlatParamLayout (fsdp1) / RowShardLayout (fsdp2), bucket order
    data_fingerprint: str | None
    ignored_keys: list = dataclasses.field(default_factory=list)   # config keys not used
    restore_enabled: bool | None = None     # meta.restore_enabled (debug switch), if recorded
    # (first step, OptimConfig) of each resumed segment that trained under other optimizer
    # settings (segments.jsonl "optim": a resume may change the schedule; docs/checkpoint.md)
    optim_segments: list = dataclasses.field(default_factory=list)
    # a custom loop's run (meta.json "custom"): its user code, rebuilt (verify/custom.py)
    custom: Any = None

    def optim_at(self, step: int) -> Any:
        """The optimizer settings step ``step`` trained under: its segment's."""
        cfg = self.optim_cfg
        for first, seg_cfg in self.optim_segments:
            if step >= first:
                cfg = seg_cfg
        return cfg

    @property
    def tokens_per_microbatch(self) -> int:
        """Normaliser of next_token_loss for one replica microbatch: S * mbs * seq_len."""
        return self.shard_size * self.mbs * self.seq_len

    @classmethod
    def load(cls, run_dir: str | Path, record: RunRecord | None = None) -> "RunSpec":
        run_dir = Path(run_dir)
        try:
            record = record or read_run(run_dir)
        except RecordError as e:
            raise VerifyInputError(str(e)) from None
        except OSError as e:
            raise VerifyInputError(f"{run_dir}: cannot read: {e}") from None
        meta = record.meta
        if not isinstance(meta, Mapping):
            raise VerifyInputError(f"{run_dir}: no meta.json")
        if not isinstance(record.config, Mapping):
            raise VerifyInputError(f"{run_dir}: no config.yaml (or it is not a mapping)")
        ints = {}
        for key in ("w_init", "g_init", "B", "shard_size", "seed"):
            v = meta.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and key != "seed"):
                raise VerifyInputError(f"{run_dir}/meta.json: {key}={v!r} must be "
                                       f"{'an integer' if key == 'seed' else 'a positive integer'}")
            ints[key] = v
        if ints["B"] != ints["w_init"] * ints["g_init"]:
            raise VerifyInputError(f"{run_dir}/meta.json: B={ints['B']} != w_init({ints['w_init']})"
                                   f" * g_init({ints['g_init']})")
        config = record.config
        kind, kind_src = _policy_kind(config, meta)
        if isinstance(meta.get("custom"), Mapping):    # a custom loop's record (workers/custom.py)
            from recover_hsdp.verify.custom import load_custom_spec

            return load_custom_spec(cls, run_dir, record, meta, ints, kind, kind_src)

        from recover_hsdp.data import DataConfig, DataConfigError, Tokenizer
        from recover_hsdp.hsdp.layout import layout_from_dict
        from recover_hsdp.model import ConfigError, ModelConfig
        from recover_hsdp.optim import OptimConfig, OptimConfigError

        data_section = _section(config, "data") or {}
        model_section = _section(config, "model")
        parallel = _section(config, "parallel") or {}
        run = _section(config, "run") or {}
        if not isinstance(model_section, Mapping):
            raise VerifyInputError(f"{run_dir}/config.yaml: no model section")
        for name, sec in (("data", data_section), ("parallel", parallel), ("run", run),
                          ("optim", _section(config, "optim") or {})):
            if not isinstance(sec, Mapping):
                raise VerifyInputError(f"{run_dir}/config.yaml: {name} must be a mapping")
        ignored: list[str] = []
        try:
            # the trainer (recover_hsdp.workers.resilient) builds these from the same sections,
            # keeping only the dataclass fields; parallel.* is the authority for the shape
            data_fields = _known(DataConfig, data_section, "data", ignored)
            if isinstance(data_fields.get("paths"), list):
                data_fields["paths"] = tuple(data_fields["paths"])
            data_cfg = DataConfig(**data_fields)
            mbs = int(parallel.get("micro_batch_size", data_cfg.micro_batch_size))
            seq_len = int(parallel.get("seq_len", data_cfg.seq_len))
            data_cfg = dataclasses.replace(data_cfg, micro_batch_size=mbs * ints["shard_size"],
                                           seq_len=seq_len)
            model_cfg = ModelConfig(**_known(ModelConfig, model_section, "model", ignored))
            if model_cfg.vocab_size is None:
                model_cfg = model_cfg.with_vocab(Tokenizer(data_cfg.tokenizer).vocab_size)
            optim_cfg = OptimConfig.from_mapping(
                _known(OptimConfig, _section(config, "optim") or {}, "optim", ignored))
            if optim_cfg.total_steps is None:
                if not isinstance(run.get("steps"), int):
                    raise VerifyInputError(f"{run_dir}/config.yaml: optim.total_steps is null "
                                           f"and run.steps is missing: the lr schedule is unknown")
                optim_cfg = optim_cfg.with_total_steps(int(run["steps"]))
        except (ConfigError, DataConfigError, OptimConfigError, TypeError, ValueError) as e:
            raise VerifyInputError(f"{run_dir}/config.yaml: {' '.join(str(e).split())}") from None
        except OSError as e:
            raise VerifyInputError(f"{run_dir}: tokenizer: {e}") from None
        raw_layout = meta.get("param_layout")
        if not isinstance(raw_layout, list) or not raw_layout:
            raise VerifyInputError(f"{run_dir}/meta.json: param_layout missing or empty")
        try:
            layout = [layout_from_dict(d) for d in raw_layout]
        except (KeyError, TypeError, ValueError) as e:
            raise VerifyInputError(f"{run_dir}/meta.json: param_layout: {e!r}") from None
        for fl in layout:
            if fl.shard_size != ints["shard_size"]:
                raise VerifyInputError(f"meta.json: param_layout[{fl.index}].shard_size="
                                       f"{fl.shard_size} != shard_size={ints['shard_size']}")
        if [fl.index for fl in layout] != list(range(len(layout))):
            raise VerifyInputError("meta.json: param_layout indices are not 0..n-1 in order")
        optim_segments = _optim_segments(run_dir, optim_cfg)
        return cls(run_dir=run_dir, record=record, policy=kind, policy_source=kind_src,
                   optim_segments=optim_segments,
                   model_cfg=model_cfg, data_cfg=data_cfg, mbs=mbs, seq_len=seq_len,
                   optim_cfg=optim_cfg, layout=layout, ignored_keys=ignored,
                   restore_enabled=meta.get("restore_enabled"),
                   data_fingerprint=meta.get("data_fingerprint"),
                   w_init=ints["w_init"], g_init=ints["g_init"], B=ints["B"],
                   shard_size=ints["shard_size"], seed=ints["seed"])


def _optim_segments(run_dir: Path, base) -> list:
    """[(first step, OptimConfig)] of every resumed segment that recorded its optimizer
    settings (sorted by first step; config.yaml's hold before the first)."""
    from recover_hsdp.optim import OptimConfig, OptimConfigError
    from recover_hsdp.record.checkpoint import read_segments

    out = []
    try:
        segs = read_segments(run_dir)
    except (OSError, RecordError):
        return out
    for seg in segs:
        if seg.get("event") != "start" or not isinstance(seg.get("optim"), dict) \
                or seg.get("resume_step") is None:
            continue
        try:
            cfg = OptimConfig.from_mapping(_known(OptimConfig, seg["optim"], "optim", []))
        except (OptimConfigError, TypeError, ValueError) as e:
            raise VerifyInputError(f"{run_dir}/segments.jsonl: segment {seg.get('segment')}: "
                                   f"{' '.join(str(e).split())}") from None
        if cfg.total_steps is None:
            cfg = cfg.with_total_steps(int(seg.get("steps") or base.total_steps))
        out.append((int(seg["resume_step"]), cfg))
    out.sort(key=lambda t: t[0])
    # a later segment that resumed EARLIER (a relaunch after a kill) replaces the steps from
    # its start: keep, per first step, the last launch's settings
    dedup: dict[int, Any] = {}
    for first, cfg in out:
        dedup[first] = cfg
    return sorted(dedup.items())
