"""One process, one thread: forward+backward of llama_debug on a 2 x 64-token microbatch, plain
module vs the resilient trainer's FSDP wrapping at shard size 1 (NO_SHARD units over a size-1 gloo
group). Run from the repository root: `.venv/bin/python -m experiments.measure_fsdp_s1_cost`.
The number behind docs/results.md section 5's overhead attribution."""
import os, time, statistics, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR","127.0.0.1"); os.environ.setdefault("MASTER_PORT","29677")
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=0, world_size=1)
from recover_hsdp.model import build_model, fsdp_wrap_policy, next_token_loss, ModelConfig
from recover_hsdp.hsdp import fsdp_hybrid as fh
import yaml
c = yaml.safe_load(open("conf/model/llama_debug.yaml"))
cfg = ModelConfig(**{k:v for k,v in c.items() if k in ModelConfig.__dataclass_fields__}).with_vocab(4096)
x = torch.randint(0, 4096, (2, 64)); y = torch.randint(0, 4096, (2, 64))
def bench(m, n=60):
    ts=[]
    for i in range(n):
        t=time.perf_counter()
        loss = next_token_loss(m(x), y, tokens_per_microbatch=128); loss.backward()
        ts.append(time.perf_counter()-t)
    return statistics.median(ts[10:])
plain = build_model(cfg, seed=0)
pg = dist.new_group([0])
topo = fh.HybridTopology.for_world(1, 1, 0, 1)
f1 = fh.wrap_hybrid_shard(build_model(cfg, seed=0), pg, auto_wrap_policy=fsdp_wrap_policy(), device="cpu", topology=topo)
for _ in range(2):
    print("plain", round(bench(plain)*1000,2), "ms   fsdp(ours)", round(bench(f1)*1000,2), "ms")
f2 = fh.wrap_hybrid_shard(build_model(cfg, seed=0), pg, auto_wrap_policy=fsdp_wrap_policy(), device="cpu", topology=topo, use_orig_params=False)
for _ in range(2):
    print("plain", round(bench(plain)*1000,2), "ms   fsdp(orig=False)", round(bench(f2)*1000,2), "ms", "fsdp(ours)", round(bench(f1)*1000,2))
# parallel.fsdp_units=one: the whole model in one unit (docs/hsdp.md "One unit"; results.md
# "One FSDP unit at S = 1"): 4 rounds of 150 microbatches each
f3 = fh.wrap_hybrid_shard(build_model(cfg, seed=0), pg, auto_wrap_policy=fsdp_wrap_policy("one"), device="cpu", topology=topo)
for _ in range(4):
    print("plain", round(bench(plain, 150)*1000,2), "ms   blocks", round(bench(f1, 150)*1000,2), "ms   one unit", round(bench(f3, 150)*1000,2), "ms", flush=True)
