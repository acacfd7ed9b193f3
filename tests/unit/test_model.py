"""The decoder against straightforward reference implementations, piece by piece and whole."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from recover_hsdp.model import (Attention, ModelConfig, RMSNorm, RotaryEmbedding, SwiGLU,
                                TransformerBlock, apply_rotary, build_model,
                                decoder_block_class, decoder_blocks, fsdp_wrap_policy,
                                get_config, init_weights, mixed_precision,
                                mixed_precision_policy, next_token_loss)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

torch.set_num_threads(1)
TINY = ModelConfig(name="tiny", vocab_size=37, d_model=24, n_layers=1, n_heads=6, n_kv_heads=2,
                   ffn_dim=40, max_seq_len=16, rope_theta=10000.0)


# ------------------------------------------------------------------------------- references
def ref_rmsnorm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_rotary(x, theta):
    """Complex-number form: the pair (x[i], x[i + d/2]) at position p is multiplied by
    exp(1j * p * theta**(-2i/d))."""
    B, H, T, d = x.shape
    half = d // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    i = torch.arange(half, dtype=torch.float64)
    p = torch.arange(T, dtype=torch.float64)
    ang = p[:, None] * theta ** (-2 * i / d)[None, :]
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def ref_attention(x, wq, wk, wv, wo, n_heads, n_kv_heads, theta):
    """Loops over heads; query head h reads kv head h // (n_heads / n_kv_heads)."""
    B, T, D = x.shape
    hd = D // n_heads
    q = (x @ wq.T).view(B, T, n_heads, hd).transpose(1, 2)
    k = (x @ wk.T).view(B, T, n_kv_heads, hd).transpose(1, 2)
    v = (x @ wv.T).view(B, T, n_kv_heads, hd).transpose(1, 2)
    q, k = ref_rotary(q, theta), ref_rotary(k, theta)
    mask = torch.ones(T, T).tril().bool()
    heads = []
    for h in range(n_heads):
        g = h // (n_heads // n_kv_heads)
        s = q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(hd)
        s = s.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(s, dim=-1) @ v[:, g])
    return torch.cat(heads, dim=-1) @ wo.T


def ref_swiglu(x, w1, w2, w3):
    a = x @ w1.T
    return (a * torch.sigmoid(a) * (x @ w3.T)) @ w2.T


def ref_model_loss(params, cfg, ids, targets):
    """A 1-layer model written out by hand from the references."""
    P = params
    h = P["tok_embeddings.weight"][ids]
    for i in range(cfg.n_layers):
        pre = f"layers.{i}."
        a = ref_rmsnorm(h, P[pre + "attention_norm.weight"], cfg.norm_eps)
        h = h + ref_attention(a, P[pre + "attention.wq.weight"], P[pre + "attention.wk.weight"],
                              P[pre + "attention.wv.weight"], P[pre + "attention.wo.weight"],
                              cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta)
        f = ref_rmsnorm(h, P[pre + "ffn_norm.weight"], cfg.norm_eps)
        h = h + ref_swiglu(f, P[pre + "feed_forward.w1.weight"],
                           P[pre + "feed_forward.w2.weight"], P[pre + "feed_forward.w3.weight"])
    h = ref_rmsnorm(h, P["norm.weight"], cfg.norm_eps)
    out_w = P["tok_embeddings.weight"] if cfg.tie_embeddings else P["output.weight"]
    logits = h @ out_w.T
    logp = logits.log_softmax(-1)
    nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
    return logits, nll.sum() / targets.numel()


# ------------------------------------------------------------------------------------ pieces
def test_rmsnorm_matches_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 24, generator=g)
    m = RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        m.weight.copy_(torch.randn(24, generator=g))
    torch.testing.assert_close(m(x), ref_rmsnorm(x, m.weight, 1e-5))


def test_rotary_matches_complex_reference_and_is_relative():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 16, 8, generator=g)
    cos, sin = RotaryEmbedding(8, 16, 10000.0)(16, torch.device("cpu"))
    torch.testing.assert_close(apply_rotary(x, cos, sin), ref_rotary(x, 10000.0))
    # <R_p q, R_s k> depends on p - s only: same q, k at (5, 2) and (13, 10)
    q = torch.randn(8, generator=g)
    k = torch.randn(8, generator=g)
    qs = apply_rotary(q.expand(1, 1, 16, 8), cos, sin)[0, 0]
    ks = apply_rotary(k.expand(1, 1, 16, 8), cos, sin)[0, 0]
    torch.testing.assert_close(qs[5] @ ks[2], qs[13] @ ks[10], rtol=1e-5, atol=1e-5)


def test_rotary_rejects_too_long():
    with pytest.raises(ValueError, match="max_seq_len"):
        RotaryEmbedding(8, 16, 1e4)(17, torch.device("cpu"))


@pytest.mark.parametrize("n_heads,n_kv_heads", [(6, 6), (6, 2), (6, 1)])
def test_gqa_attention_matches_reference_and_shapes(n_heads, n_kv_heads):
    cfg = ModelConfig(vocab_size=11, d_model=24, n_layers=1, n_heads=n_heads,
                      n_kv_heads=n_kv_heads, ffn_dim=32, max_seq_len=16)
    attn = Attention(cfg)
    hd = cfg.head_dim
    assert attn.wq.weight.shape == (n_heads * hd, 24)
    assert attn.wk.weight.shape == (n_kv_heads * hd, 24)
    assert attn.wv.weight.shape == (n_kv_heads * hd, 24)
    assert attn.wo.weight.shape == (24, n_heads * hd)
    x = torch.randn(2, 9, 24, generator=torch.Generator().manual_seed(2))
    cos, sin = RotaryEmbedding(hd, 16, cfg.rope_theta)(9, x.device)
    y = attn(x, cos, sin)
    assert y.shape == x.shape
    ref = ref_attention(x, attn.wq.weight, attn.wk.weight, attn.wv.weight, attn.wo.weight,
                        n_heads, n_kv_heads, cfg.rope_theta)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_attention_is_causal():
    attn = Attention(TINY)
    x = torch.randn(1, 10, 24, generator=torch.Generator().manual_seed(3))
    cos, sin = RotaryEmbedding(TINY.head_dim, 16, TINY.rope_theta)(10, x.device)
    y1 = attn(x, cos, sin)
    x2 = x.clone()
    x2[:, 7:] += 1.0                              # change the future
    torch.testing.assert_close(attn(x2, cos, sin)[:, :7], y1[:, :7])


def test_swiglu_matches_reference():
    m = SwiGLU(24, 40)
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(m(x), ref_swiglu(x, m.w1.weight, m.w2.weight, m.w3.weight))


# ---------------------------------------------------------------------------------- the model
@pytest.mark.parametrize("tie", [True, False])
def test_one_layer_model_loss_and_grads_match_manual(tie):
    cfg = ModelConfig(**{**TINY.to_dict(), "tie_embeddings": tie})
    model = build_model(cfg, seed=5)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, cfg.vocab_size, (3, 12), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (3, 12), generator=g)
    logits = model(ids)
    loss = next_token_loss(logits, targets)
    loss.backward()

    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    ref_logits, ref_loss = ref_model_loss(params, cfg, ids, targets)
    ref_loss.backward()
    assert logits.shape == (3, 12, cfg.vocab_size)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    if tie:
        assert model.output.weight is model.tok_embeddings.weight
        assert sum(1 for _ in model.parameters()) == 2 + 9 * cfg.n_layers  # emb+norm, 9 per block
    else:
        assert model.output.weight is not model.tok_embeddings.weight


def test_loss_is_sum_over_fixed_count_so_microbatch_grads_sum_to_batch_mean():
    model = build_model(TINY, seed=7)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, TINY.vocab_size, (4, 10), generator=g)
    tg = torch.randint(0, TINY.vocab_size, (4, 10), generator=g)
    # whole batch, mean over all tokens
    full = F.cross_entropy(model(ids).reshape(-1, TINY.vocab_size), tg.reshape(-1))
    gfull = torch.autograd.grad(full, list(model.parameters()))
    # two microbatches of 2 rows: per-microbatch loss, gradients summed, divided by B=2
    acc = [torch.zeros_like(p) for p in model.parameters()]
    for sl in (slice(0, 2), slice(2, 4)):
        lb = next_token_loss(model(ids[sl]), tg[sl], tokens_per_microbatch=2 * 10)
        for a, gr in zip(acc, torch.autograd.grad(lb, list(model.parameters()))):
            a += gr
    for a, gf in zip(acc, gfull):
        torch.testing.assert_close(a / 2, gf, rtol=1e-5, atol=1e-7)


def test_loss_normaliser_is_fixed_even_with_ignored_targets():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(9))
    tg = torch.tensor([[1, 2, -100], [0, -100, 4]])
    manual = -(logits.log_softmax(-1)[0, 0, 1] + logits.log_softmax(-1)[0, 1, 2]
               + logits.log_softmax(-1)[1, 0, 0] + logits.log_softmax(-1)[1, 2, 4]) / 6
    torch.testing.assert_close(next_token_loss(logits, tg), manual)
    torch.testing.assert_close(next_token_loss(logits, tg, tokens_per_microbatch=12), manual / 2)
    with pytest.raises(ValueError, match="do not match"):
        next_token_loss(logits, tg[:, :2])


def test_bf16_forward_runs_and_keeps_rotary_fp32():
    model = build_model(TINY, seed=1).to(torch.bfloat16)
    ids = torch.randint(0, TINY.vocab_size, (2, 8))
    out = model(ids)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    cos, _ = model.rope(8, ids.device)
    assert cos.dtype == torch.float32
    assert list(model.buffers()) == []


# -------------------------------------------------------------------------------------- init
def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_init_is_deterministic_and_independent_of_global_rng():
    torch.manual_seed(123)
    a = _state(build_model(TINY, seed=42))
    torch.manual_seed(999)
    torch.randn(1000)
    b = _state(build_model(TINY, seed=42))
    c = _state(build_model(TINY, seed=43))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_init_depends_on_name_only_so_meta_then_materialise_matches():
    cfg = ModelConfig(**{**TINY.to_dict(), "n_layers": 2})
    ref = _state(build_model(cfg, seed=3))
    meta = build_model(cfg, seed=3, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    init_weights(meta, seed=3)
    assert meta.output.weight is meta.tok_embeddings.weight          # re-tied
    for k, v in meta.state_dict().items():
        assert torch.equal(v, ref[k]), k
    # a deeper model shares the first blocks' draws: init does not depend on what else exists
    # (only the residual-output std, init_std / sqrt(2 * n_layers), changes with depth)
    deeper = _state(build_model(ModelConfig(**{**TINY.to_dict(), "n_layers": 3}), seed=3))
    for k in ref:
        scale = math.sqrt(4 / 6) if k.endswith(("wo.weight", "w2.weight")) else 1.0
        torch.testing.assert_close(ref[k] * scale, deeper[k], rtol=1e-6, atol=0, msg=k)


def test_init_statistics():
    cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                      ffn_dim=352, max_seq_len=32)
    m = build_model(cfg, seed=0)
    assert torch.equal(m.norm.weight, torch.ones(128))
    assert abs(m.tok_embeddings.weight.std().item() - 0.02) < 1e-3
    assert abs(m.layers[0].attention.wo.weight.std().item() - 0.02 / math.sqrt(8)) < 5e-4


# -------------------------------------------------------------------------------- FSDP glue
def test_wrap_policy_targets_decoder_blocks_and_cpu_is_fp32():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    pol = fsdp_wrap_policy()
    assert isinstance(pol, ModuleWrapPolicy)
    assert decoder_block_class is TransformerBlock
    assert pol._module_classes == {TransformerBlock}
    model = build_model(TINY, seed=0)
    assert decoder_blocks(model) == list(model.layers)
    assert mixed_precision("cpu") is None and mixed_precision_policy("cpu") is None
    mp = mixed_precision("cuda")
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (
        torch.bfloat16, torch.float32, torch.bfloat16)
    mp2 = mixed_precision_policy("cuda:0")
    assert (mp2.param_dtype, mp2.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_named_configs_shapes():
    c = get_config("llama_1b", vocab_size=128256)
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.ffn_dim, c.head_dim) == (
        16, 2048, 32, 8, 8192, 64)
    assert c.tie_embeddings
    assert round(c.num_params() / 1e9, 2) == 1.24          # LLaMA-3.2-1B: 1.24 B
    d = get_config("llama_debug", vocab_size=4096)
    m = build_model(d, seed=0)
    assert sum(p.numel() for p in m.parameters()) == d.num_params()
