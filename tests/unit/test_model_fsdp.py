"""The decoder under FSDP on CPU (one gloo rank, in a subprocess to keep torch.distributed state
out of the test process): one unit per decoder block + the root, gradients equal to the plain
model's, FSDP2 per-block sharding runs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import _procs

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
    from recover_hsdp.model import *
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    cfg = get_config("llama_debug", 512)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 512, (2, 32), generator=g)
    y = torch.randint(0, 512, (2, 32), generator=g)
    ref = build_model(cfg, seed=0)
    next_token_loss(ref(x), y).backward()
    m = FSDP(build_model(cfg, seed=0), auto_wrap_policy=fsdp_wrap_policy(),
             device_id=torch.device("cpu"), use_orig_params=True,
             mixed_precision=mixed_precision("cpu"))
    units = [u for u in m.modules() if isinstance(u, FSDP)]
    assert len(units) == cfg.n_layers + 1, len(units)
    assert all(isinstance(u.module, decoder_block_class) for u in units[1:])
    next_token_loss(m(x), y).backward()
    grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad for n, p in m.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    m2 = build_model(cfg, seed=0)
    for b in decoder_blocks(m2):
        fully_shard(b, mp_policy=mixed_precision_policy("cpu") or
                    torch.distributed.fsdp.MixedPrecisionPolicy())
    fully_shard(m2)
    l2 = next_token_loss(m2(x), y)
    torch.testing.assert_close(l2, next_token_loss(ref(x), y))
    l2.backward()
    dist.destroy_process_group()
    print("OK")
""")


def test_fsdp1_per_block_units_and_fsdp2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = _procs.run([sys.executable, "-c", SCRIPT, str(tmp_path / "store")],
                     capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-3000:]
