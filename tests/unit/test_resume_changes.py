"""What a resume may change (recover_hsdp/launcher/resume.py check_resume, resume_changes): a
longer run.steps and the optimizer's schedule and clip go through with a notice; the model, the
seed and the optimizer's kind and moments stay refused, one line naming the key."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from recover_hsdp.config import compose_config, resolve_config
from recover_hsdp.hsdp.checkpoint import identity_of
from recover_hsdp.launcher.resume import check_resume, resume_changes

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

CK = Path("ck/step_000004")


def resolved(*overrides):
    return resolve_config(compose_config(list(overrides)), cwd=Path("/tmp/cwd"))


def _saved(*overrides) -> dict:
    c = OmegaConf.to_container(resolved(*overrides), resolve=True)
    return {**identity_of(c, "fp"), "step": 4, "B": 4, "w_init": 2}


def test_longer_run_and_new_schedule_resume_with_a_notice():
    st = _saved("run.steps=6")
    cfg = resolved("run.steps=12", "optim.lr=5e-4", "optim.warmup_steps=1", "optim.grad_clip=1.0")
    assert check_resume(cfg, st, CK) is None
    ch = resume_changes(cfg, st)
    assert "run.steps: 6 -> 12" in ch and "optim.lr: 0.001 -> 0.0005" in ch, ch
    assert any(c.startswith("optim.total_steps: 6 -> 12") for c in ch), ch
    assert any(c.startswith("optim.grad_clip") for c in ch), ch
    assert resume_changes(resolved("run.steps=6"), st) == []


def test_what_a_resume_must_keep_is_refused_naming_the_key():
    st = _saved("run.steps=6")
    why = check_resume(resolved("run.steps=6", "optim.betas=[0.8,0.9]"), st, CK)
    assert why and "optim.betas" in why and "\n" not in why, why
    why = check_resume(resolved("run.steps=6", "model.n_layers=3"), st, CK)
    assert why and "model.n_layers" in why, why
    why = check_resume(resolved("run.steps=6", "run.seed=7"), st, CK)
    assert why and "run.seed" in why, why
    why = check_resume(resolved("run.steps=4"), st, CK)
    assert why and "run.steps(4) must exceed the step it resumes at (4)" in why, why
