"""The custom loop's factory reference (recover_hsdp/record/custom.py): what the run record names,
how the verifier imports and calls it, and the one-line refusals when it cannot
(docs/custom_loop.md, "The run record and verify")."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from recover_hsdp.record import RecordError
from recover_hsdp.record.custom import (CustomParts, build_parts, data_slices, factory_ref,
                                        import_factory)

pytestmark = pytest.mark.quick


def make_parts_here(scale: int = 1) -> CustomParts:
    return CustomParts(model=lambda: None, optimizer_factory=lambda m: None,
                       loss_fn=lambda m, x, y: None, microbatch=lambda i: (i * scale, -i),
                       fingerprint=f"test:{scale}")


def test_a_module_level_function_is_named_with_its_directory():
    ref = factory_ref(make_parts_here, {"scale": 3})
    assert ref["factory"] == f"{__name__}:make_parts_here"
    assert ref["kwargs"] == {"scale": 3} and ref["path"]
    parts = CustomParts.build(make_parts_here, scale=3)
    assert parts.ref == ref
    assert parts.microbatch_fn(5, 7) == (21, -7)    # the id alone; the replica is ignored
    assert parts.microbatch_fn(0, 7) == (21, -7)


@pytest.mark.parametrize("bad, what", [
    (lambda **kw: None, "module-level function"),
    ("no_colon", "expected 'module:function'"),
    ("a:b:c", "expected 'module:function'"),
])
def test_unnameable_factories_are_refused(bad, what):
    with pytest.raises(RecordError, match=what):
        factory_ref(bad, {})


def test_non_json_arguments_are_refused():
    with pytest.raises(RecordError, match="JSON"):
        factory_ref(make_parts_here, {"scale": object()})


def test_the_verifier_imports_a_script_from_the_recorded_directory(tmp_path):
    (tmp_path / "my_loop_abc.py").write_text(textwrap.dedent("""
        from recover_hsdp.record.custom import CustomParts

        def parts(k):
            return CustomParts(model=None, optimizer_factory=None, loss_fn=None,
                               microbatch=lambda i: (i + k,), fingerprint="f")

        def wrong():
            return 1
    """))
    ref = {"factory": "my_loop_abc:parts", "path": str(tmp_path), "kwargs": {"k": 10}}
    before = list(sys.path)
    try:
        p = build_parts(ref)
        assert p.microbatch(5) == (15,) and p.ref == ref
        assert sys.path == before                      # the path is not left behind
        with pytest.raises(RecordError, match="returned int, not CustomParts"):
            build_parts({**ref, "factory": "my_loop_abc:wrong", "kwargs": {}})
        with pytest.raises(RecordError, match="has no function 'nope'"):
            import_factory({**ref, "factory": "my_loop_abc:nope"})
        with pytest.raises(RecordError, match=r"raised TypeError"):
            build_parts({**ref, "kwargs": {"zzz": 1}})
    finally:
        sys.modules.pop("my_loop_abc", None)


def test_an_unimportable_factory_is_one_line(tmp_path):
    with pytest.raises(RecordError) as e:
        import_factory({"factory": "no_such_mod_xyz:f", "path": str(tmp_path)})
    msg = str(e.value)
    assert "cannot import 'no_such_mod_xyz'" in msg and str(tmp_path) in msg
    assert "\n" not in msg


def test_verify_refuses_a_record_whose_factory_cannot_be_imported(tmp_path):
    from recover_hsdp.verify import verify_run

    meta = {"w_init": 2, "g_init": 2, "B": 4, "shard_size": 1, "seed": 0,
            "custom": {"factory": "no_such_mod_xyz:f", "path": str(tmp_path), "kwargs": {}}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "config.yaml").write_text("custom: {}\n")
    res = verify_run(tmp_path)
    assert res.exit_code == 2 and not res.ok
    assert "no_such_mod_xyz" in res.message and "\n" not in res.message


def test_data_slices_is_the_first_launch_width(tmp_path):
    assert data_slices(tmp_path, default=4) == 4          # no record yet: this launch's
    (tmp_path / "meta.json").write_text(json.dumps({"w_init": 2}))
    assert data_slices(tmp_path, default=4) == 2          # a resume at W=4 keeps W0=2
    (tmp_path / "meta.json").write_text(json.dumps({"w_init": 0}))
    with pytest.raises(RecordError, match="w_init=0"):
        data_slices(tmp_path, default=4)


def test_the_replay_reads_the_loops_optimizer_and_lr():
    """verify/custom.py: the strict check's view (AdamW / plain SGD, else none); the lr is the
    loop's lr_fn, or the optimizer's own (left alone: no set_lr)."""
    import torch

    from recover_hsdp.verify.custom import CustomReplay

    m = torch.nn.Linear(2, 2)

    def view(opt, **kw):
        parts = CustomParts(model=lambda: m, optimizer_factory=lambda mod: opt,
                            loss_fn=None, microbatch=None, **kw)
        r = CustomReplay(parts, {"factory": "x:y"})
        r.optimizer(m)
        return r, r.optim_view(opt)

    r, v = view(torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.8, 0.9), eps=1e-6),
                grad_clip=1.0)
    assert (v.name, v.betas, v.eps, v.clip, r.strict_ok) == ("adamw", (0.8, 0.9), 1e-6, 1.0, True)
    assert r.lr_at(5) == 1e-3
    calls = []
    r.set_lr(lambda o, lr: calls.append(lr))(None, 0.5)
    assert calls == []                            # no lr_fn: the optimizer's lr is kept
    assert view(torch.optim.SGD(m.parameters(), lr=0.1))[1].name == "sgd"
    for opt in (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(m.parameters()),
                torch.optim.AdamW(m.parameters(), amsgrad=True)):
        r, v = view(opt)
        assert v.name == "custom" and not r.strict_ok, type(opt).__name__
    r, _ = view(torch.optim.SGD(m.parameters(), lr=0.1), lr_fn=lambda s: 0.01 * s)
    assert r.lr_at(3) == pytest.approx(0.03)
    r.set_lr(lambda o, lr: calls.append(lr))(None, 0.5)
    assert calls == [0.5]
