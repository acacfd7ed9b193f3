"""Optimizer helpers: config validation, the lr schedule, param groups (FSDP names), AdamW."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from recover_hsdp.optim import (
    OptimConfig,
    OptimConfigError,
    build_optimizer,
    clean_param_name,
    is_no_decay,
    lr_at,
    param_groups,
    set_lr,
)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


@pytest.mark.parametrize("kwargs, message", [
    ({"lr": 0}, r"optim.lr\(0\) must be a number > 0"),
    ({"lr": "x"}, r"optim.lr\('x'\) must be a number > 0"),
    ({"eps": -1.0}, r"optim.eps\(-1.0\) must be a number > 0"),
    ({"betas": [0.9, 1.0]}, r"optim.betas\(\[0.9, 1.0\]\) must be two numbers in \[0, 1\)"),
    ({"betas": [0.9]}, r"optim.betas\(\[0.9\]\)"),
    ({"weight_decay": -0.1}, r"optim.weight_decay\(-0.1\) must be a number >= 0"),
    ({"warmup_steps": -1}, r"optim.warmup_steps\(-1\) must be an integer >= 0"),
    ({"warmup_steps": 1.5}, r"optim.warmup_steps\(1.5\)"),
    ({"min_lr_ratio": 1.5}, r"optim.min_lr_ratio\(1.5\) must be a number in \[0, 1\]"),
    ({"total_steps": 0}, r"optim.total_steps\(0\) must be an integer >= 1 or null"),
    ({"total_steps": 3, "warmup_steps": 4}, r"optim.warmup_steps\(4\) must be <= "
                                            r"optim.total_steps\(3\)"),
])
def test_config_errors_name_the_key(kwargs, message):
    with pytest.raises(OptimConfigError, match=message):
        OptimConfig(**kwargs)


def test_from_mapping():
    cfg = OptimConfig.from_mapping(OmegaConf.create({"lr": 0.01, "betas": [0.8, 0.9]}))
    assert cfg.lr == 0.01 and cfg.betas == [0.8, 0.9] and cfg.total_steps is None
    assert cfg.with_total_steps(10).total_steps == 10
    assert OptimConfig(total_steps=5).with_total_steps(10).total_steps == 5
    with pytest.raises(OptimConfigError, match="optim.lrr: unknown key"):
        OptimConfig.from_mapping({"lrr": 1})


def test_lr_schedule_shape():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, total_steps=20)
    lrs = [lr_at(s, cfg) for s in range(25)]
    # warm-up: lr * (s + 1) / warmup: step 0 gets lr / warmup, never 0
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # cosine from the peak at s = warmup ...
    assert lrs[4] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(lrs[4:19], lrs[5:20]))
    # ... to min_lr_ratio * lr at the last step (total - 1), then held
    assert lrs[19] == pytest.approx(0.1) and lrs[24] == pytest.approx(0.1)
    mid = 4 + (19 - 4) / 2
    assert lr_at(int(mid), cfg) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 4) / 15)))


def test_lr_schedule_edges():
    # no warm-up: step 0 already at the peak
    assert lr_at(0, OptimConfig(lr=2.0, warmup_steps=0, total_steps=10)) == pytest.approx(2.0)
    # one-step run: the peak (warmup 0) or lr / 1 (warmup 1)
    assert lr_at(0, OptimConfig(lr=1.0, warmup_steps=0, total_steps=1)) == pytest.approx(1.0)
    assert lr_at(0, OptimConfig(lr=1.0, warmup_steps=1, total_steps=1)) == pytest.approx(1.0)
    # warm-up == total: the run ends at the peak; past it the floor
    c = OptimConfig(lr=1.0, warmup_steps=3, total_steps=3, min_lr_ratio=0.0)
    assert [lr_at(s, c) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.0])
    # a mapping / DictConfig works too (the manager passes whatever it holds)
    d = {"lr": 1.0, "warmup_steps": 2, "min_lr_ratio": 0.5, "total_steps": 4}
    assert lr_at(1, d) == lr_at(1, OmegaConf.create(d)) == pytest.approx(1.0)
    with pytest.raises(OptimConfigError, match="total_steps"):
        lr_at(0, OptimConfig())
    with pytest.raises(ValueError):
        lr_at(-1, OptimConfig(total_steps=3))


@pytest.mark.parametrize("name, clean, no_decay", [
    ("layers.0.attention_norm.weight", "layers.0.attention_norm.weight", True),
    ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.ffn_norm.weight",
     "layers.0.ffn_norm.weight", True),
    ("_orig_mod._fsdp_wrapped_module.norm.weight", "norm.weight", True),
    ("layers.1._checkpoint_wrapped_module.attention.wq.weight", "layers.1.attention.wq.weight",
     False),
    ("_fsdp_wrapped_module.tok_embeddings.weight", "tok_embeddings.weight", False),
])
def test_param_names(name, clean, no_decay):
    assert clean_param_name(name) == clean
    assert is_no_decay(name) is no_decay


def test_build_optimizer_groups_and_step():
    from recover_hsdp.model import build_model, get_config

    torch.manual_seed(0)
    model = build_model(get_config("llama_debug", 64), seed=0)
    opt = build_optimizer(model.named_parameters(), OptimConfig(lr=0.01, weight_decay=0.1,
                                                                total_steps=5))
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert (decay["name"], no_decay["name"]) == ("decay", "no_decay")
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert no_decay["param_names"] and all("norm" in n for n in no_decay["param_names"])
    assert not any("norm" in n for n in decay["param_names"])
    n_params = sum(1 for p in model.parameters())
    assert len(decay["params"]) + len(no_decay["params"]) == n_params
    assert decay["betas"] == (0.9, 0.95)
    set_lr(opt, 0.123)
    assert all(g["lr"] == 0.123 for g in opt.param_groups)
    x = torch.randint(0, 64, (2, 8))
    model(x).float().pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_groups_always_both_present_and_frozen_skipped():
    a = torch.nn.Parameter(torch.ones(2))
    b = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    groups = param_groups([("x.weight", a), ("y.norm.weight", b)], 0.1)
    assert [len(g["params"]) for g in groups] == [1, 0]
    opt = build_optimizer([("x.weight", a)], {"lr": 1e-3})
    assert len(opt.param_groups) == 2
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([("y", b)], {"lr": 1e-3})
