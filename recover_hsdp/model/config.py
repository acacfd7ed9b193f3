"""Model configuration: a typed dataclass that validates itself, plus the named configs.

`vocab_size=None` means "take it from the tokenizer" (`cfg.with_vocab(tokenizer.vocab_size)`);
a model cannot be built until it is resolved. The named configs are also shipped as YAML in
conf/model/<name>.yaml with exactly the dataclass's fields (tests/unit/test_model_config.py checks
that they agree).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the values."""


@dataclass(frozen=True)
class ModelConfig:
    """A LLaMA-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention."""

    name: str = "custom"
    vocab_size: int | None = None   # None: from the tokenizer (see with_vocab)
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2             # grouped-query attention: n_heads // n_kv_heads q-heads per kv
    ffn_dim: int = 352              # SwiGLU hidden width
    max_seq_len: int = 128          # longest sequence the model accepts (rotary table length)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True     # output projection shares the token-embedding matrix
    init_std: float = 0.02          # std of every weight matrix; residual outputs / sqrt(2*L)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"model.{msg}")

        for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{key}({v!r}) must be a positive integer")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int)
                                            or isinstance(self.vocab_size, bool)
                                            or self.vocab_size <= 0):
            bad(f"vocab_size({self.vocab_size!r}) must be a positive integer or null "
                f"(null: from the tokenizer)")
        if self.n_heads % self.n_kv_heads:
            bad(f"n_heads({self.n_heads}) must be divisible by "
                f"model.n_kv_heads({self.n_kv_heads})")
        if self.d_model % self.n_heads:
            bad(f"d_model({self.d_model}) must be divisible by model.n_heads({self.n_heads})")
        if self.head_dim % 2:
            bad(f"d_model({self.d_model}) / model.n_heads({self.n_heads}) = head_dim"
                f"({self.head_dim}) must be even for rotary embeddings")
        if not self.rope_theta > 0:
            bad(f"rope_theta({self.rope_theta}) must be > 0")
        if not self.norm_eps > 0:
            bad(f"norm_eps({self.norm_eps}) must be > 0")
        if not self.init_std > 0:
            bad(f"init_std({self.init_std}) must be > 0")
        if not isinstance(self.tie_embeddings, bool):
            bad(f"tie_embeddings({self.tie_embeddings!r}) must be true or false")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def with_vocab(self, vocab_size: int) -> "ModelConfig":
        """The same config with the tokenizer's vocabulary size filled in."""
        return dataclasses.replace(self, vocab_size=vocab_size)

    def require_vocab(self) -> int:
        if self.vocab_size is None:
            raise ConfigError("model.vocab_size(None) is unresolved: call "
                              "cfg.with_vocab(tokenizer.vocab_size) before building the model")
        return self.vocab_size

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        v, d, L = self.require_vocab(), self.d_model, self.n_layers
        kv = self.n_kv_heads * self.head_dim
        attn = d * d * 2 + d * kv * 2
        mlp = 3 * d * self.ffn_dim
        block = attn + mlp + 2 * d
        return v * d * (1 if self.tie_embeddings else 2) + L * block + d

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"model.{unknown[0]} is not a model key (known: "
                              f"{', '.join(sorted(known))})")
        return cls(**dict(d))

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ModelConfig":
        import yaml

        with open(path) as f:
            d = yaml.safe_load(f) or {}
        d.pop("defaults", None)  # Hydra's composition list (e.g. llama_1b selects optim=llama)
        return cls.from_dict(d)


# LLaMA-3.2-1B's shape (16 layers, d_model 2048, 32 heads / 8 KV heads, FFN 8192, tied
# embeddings, rope_theta 5e5). The vocabulary comes from our tokenizer, and Meta's "llama3" rope
# frequency scaling for long context is not implemented (irrelevant at max_seq_len 2048).
LLAMA_1B = ModelConfig(
    name="llama_1b", vocab_size=None, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
    ffn_dim=8192, max_seq_len=2048, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
    init_std=0.02,
)

# Tiny, for tests and the 2-core CPU demo (docs/data.md has its step time). The vocabulary is
# the embedded tokenizer's (4096).
LLAMA_DEBUG = ModelConfig(
    name="llama_debug", vocab_size=None, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
    ffn_dim=352, max_seq_len=128, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True,
    init_std=0.02,
)

NAMED_CONFIGS: dict[str, ModelConfig] = {c.name: c for c in (LLAMA_1B, LLAMA_DEBUG)}


def get_config(name: str, vocab_size: int | None = None) -> ModelConfig:
    """A named config, with `vocab_size` filled in if given."""
    if name not in NAMED_CONFIGS:
        raise ConfigError(f"model.name({name!r}) is not a named config "
                          f"(have: {', '.join(sorted(NAMED_CONFIGS))})")
    cfg = NAMED_CONFIGS[name]
    return cfg.with_vocab(vocab_size) if vocab_size is not None else cfg
