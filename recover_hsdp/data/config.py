"""Data configuration (conf/data/*.yaml has the same fields) and its validation.

Three sources:
* ``embedded`` (default): the shipped public-domain corpus + shipped tokenizer; random access.
* ``local``: your .jsonl/.txt files (optionally .gz/.xz); random access.
* ``hf``: a Hugging Face hub dataset streamed with `datasets` (C4 ``allenai/c4``, ``en``); each
  initial replica streams its own shard; random access only through ``replay_dir``.
``streaming: true`` runs ``local`` files through the streaming path too (how that path is tested
offline).

Tokens per microbatch = micro_batch_size * seq_len; each sequence holds seq_len + 1 tokens (the
targets are the inputs shifted by one).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

SOURCES = ("embedded", "local", "hf")


class DataConfigError(ValueError):
    """A data configuration value is invalid; the message names the key and the values."""


@dataclass(frozen=True)
class DataConfig:
    source: str = "embedded"
    paths: tuple[str, ...] = ()          # source=local: files, read in this order
    text_field: str = "text"             # JSON field holding the document text
    hf_path: str = "allenai/c4"          # source=hf
    hf_name: str | None = "en"
    split: str = "train"
    tokenizer: str | None = None         # sentencepiece .model; None = the embedded one
    seq_len: int = 128
    micro_batch_size: int = 4
    seed: int = 0                        # random-access path: sequence order per epoch
    shuffle: bool = True                 # random-access path: permute sequences each epoch
    streaming: bool = False              # force the streaming path for source=local
    cache_dir: str | None = None         # packed-token cache; None: $RECOVER_HSDP_CACHE or
                                         # ~/.cache/recover_hsdp
    replay_dir: str | None = None        # streaming path: save each microbatch for get(id)
    position_every: int = 16             # streaming path: save the slice's stream position
                                         # every N microbatches (0: never; docs/data.md)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise DataConfigError(f"data.{msg}")

        if self.source not in SOURCES:
            bad(f"source({self.source!r}) must be one of {', '.join(SOURCES)}")
        if isinstance(self.paths, (str, Path)):          # a single path given as a string
            object.__setattr__(self, "paths", (str(self.paths),))
        object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))
        if self.source == "local" and not self.paths:
            bad("paths(()) must list at least one file when data.source='local'")
        for key in ("seq_len", "micro_batch_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{key}({v!r}) must be a positive integer")
        if self.source == "hf" and not self.hf_path:
            bad(f"hf_path({self.hf_path!r}) must name a dataset when data.source='hf'")
        if not isinstance(self.seed, int) or self.seed < 0:
            bad(f"seed({self.seed!r}) must be a non-negative integer")
        pe = self.position_every
        if not isinstance(pe, int) or isinstance(pe, bool) or pe < 0:
            bad(f"position_every({pe!r}) must be a non-negative integer")

    @property
    def tokens_per_microbatch(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def random_access(self) -> bool:
        """True when get(id) works for any id without a replay_dir."""
        return self.source in ("embedded", "local") and not self.streaming

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir)
        env = os.environ.get("RECOVER_HSDP_CACHE")
        if env:
            return Path(env)
        return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recover_hsdp"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["paths"] = list(self.paths)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DataConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DataConfigError(f"data.{unknown[0]} is not a data key (known: "
                                  f"{', '.join(sorted(known))})")
        d = dict(d)
        if "paths" in d and d["paths"] is not None and not isinstance(d["paths"], str):
            d["paths"] = tuple(d["paths"])
        elif d.get("paths") is None:
            d.pop("paths", None)
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "DataConfig":
        import yaml

        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f) or {})


def require_tokenizer(cfg: DataConfig) -> None:
    """data.source=hf (C4) trains only with a tokenizer made for its text: the shipped 4096-piece
    model was trained on public-domain verse and prose. Raised before anything opens the hub."""
    if cfg.source == "hf" and not cfg.tokenizer:
        raise DataConfigError(
            f"data.tokenizer(null): data.source=hf ({cfg.hf_path}) needs a sentencepiece model "
            f"trained on its text: recover-hsdp tokenizer train --hf-path {cfg.hf_path}"
            + (f" --hf-name {cfg.hf_name}" if cfg.hf_name else "")
            + " --documents 100000 --vocab-size 32000 --out tok, then data.tokenizer=tok.model")


def check_model_data(model_cfg, data_cfg: DataConfig, vocab_size: int) -> None:
    """Cross-checks between a ModelConfig (duck-typed) and the data: raise naming both keys."""
    if data_cfg.seq_len > model_cfg.max_seq_len:
        raise DataConfigError(f"data.seq_len({data_cfg.seq_len}) must be <= "
                              f"model.max_seq_len({model_cfg.max_seq_len})")
    if model_cfg.vocab_size is not None and model_cfg.vocab_size != vocab_size:
        raise DataConfigError(f"model.vocab_size({model_cfg.vocab_size}) must equal the "
                              f"tokenizer's vocab size ({vocab_size}); set it to null to take it "
                              f"from the tokenizer")
