"""A LLaMA-style decoder-only transformer.

Pieces (each a small module, tested against a straightforward reference in
tests/unit/test_model.py): RMSNorm, rotary position embeddings (rotate-half form), grouped-query
attention (`n_kv_heads` key/value heads shared by `n_heads // n_kv_heads` query heads each),
SwiGLU MLP, pre-norm residual blocks, tied or untied output projection.

Invariants:
* The model holds no buffers. Rotary cos/sin are computed in fp32 from positions (cached per
  length/device in a plain attribute), so FSDP's buffer_dtype (bf16) never rounds them and a
  meta-device construction needs nothing re-materialised but the parameters.
* Norm statistics, rotary rotation and the loss are computed in fp32 whatever the parameter
  dtype (bf16 under FSDP mixed precision), then cast back.
* Initialisation is a function of (seed, parameter name) only: see `init_weights`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

#: the attention kernel (a test seam replaces it: recover_hsdp/hsdp/fault_seam.py)
attention_fn = F.scaled_dot_product_attention


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half rotary embeddings (GPT-NeoX/HF-LLaMA layout).

    Frequencies theta^(-2i/head_dim), i < head_dim/2; position p rotates the pair
    (x[i], x[i + head_dim/2]) by angle p * freq[i].
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self._cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} > model.max_seq_len({self.max_seq_len})")
        key = (seq_len, str(device))
        if key not in self._cache:
            inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64,
                                                     device=device) / self.head_dim))
            ang = torch.arange(seq_len, dtype=torch.float64, device=device)[:, None] * inv[None]
            ang = torch.cat([ang, ang], dim=-1)                    # (T, head_dim)
            self._cache[key] = (ang.cos().float(), ang.sin().float())
        return self._cache[key]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, head_dim); cos/sin: (T, head_dim) fp32. Rotation in fp32, result in x.dtype."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            # query head h reads kv head h // (n_heads // n_kv_heads)
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = attention_fn(q, k, v, is_causal=True)   # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block; the FSDP wrapping unit (see fsdp.fsdp_wrap_policy)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """input_ids (B, T) int64 -> logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        vocab = cfg.require_vocab()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(vocab, cfg.d_model)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, vocab, bias=False)
        self.tie_weights()
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def tie_weights(self) -> None:
        """Share the output projection with the embedding (again after `to_empty`, which can
        untie parameters)."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids)
        cos, sin = self.rope(input_ids.shape[1], input_ids.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


# ------------------------------------------------------------------------------ initialisation
def _param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, parameter name): stable across processes, runs and versions."""
    import hashlib

    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_std(cfg: ModelConfig, name: str) -> float | None:
    """None: ones (norm weights). Residual-branch outputs (wo, w2) are scaled by 1/sqrt(2L)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith("attention.wo.weight") or name.endswith("feed_forward.w2.weight"):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Deterministic initialisation: every parameter is a function of (seed, its name) only.

    Each tensor is drawn on the CPU from its own torch.Generator seeded from sha256(seed, name),
    then copied to the parameter's device/dtype. So the result does not depend on the global
    RNG state, the device, the construction order, or which other parameters exist (a model
    materialised block by block from the meta device gets the same values), and every rank
    computes the same model without a broadcast. Tied weights are drawn once (first name).
    """
    cfg = model.cfg
    model.tie_weights()
    for name, p in model.named_parameters():          # deduplicates tied parameters
        std = _init_std(cfg, name)
        if std is None:
            value = torch.ones(p.shape, dtype=torch.float32)
        else:
            g = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
            value = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
        p.copy_(value.to(device=p.device, dtype=p.dtype))


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    """Construct and initialise. device="meta" constructs without storage (call
    `model.to_empty(device=...)` and `init_weights(model, seed)` yourself, e.g. after FSDP
    wrapping); any other device gets initialised weights."""
    device = torch.device(device)
    with torch.device(device):
        model = Transformer(cfg)
    if device.type != "meta":
        init_weights(model, seed)
    return model
