"""The rank side's entry points, together: each is the function (or ``python -m`` module) one
MPI rank runs, built from the TrainConfig the launcher validated (recover_hsdp/config).

* build.py       ONE builder (RankBuild): config -> tokenizer, model, optimizer factory,
                 microbatch sources, loss, recorder; every loop below (and the plain-FSDP
                 baselines, plain.py) builds its components there
* resilient.py   ``run_worker(cfg)``: the resilient trainer behind `recover-hsdp train`
                 (HSDPULFMTrainingManager; ReCoVer with policy=static, drop-and-go with adaptive)
* plain.py       ``run_plain_worker(cfg)``: plain PyTorch FSDP HYBRID_SHARD, the per-rank loop of
                 baseline=reference and baseline=checkpoint_restart (docs/baselines.md)
* bench_hsdp.py  the A/B worker of `recover-hsdp bench hsdp` (manager vs torch's FSDP, one
                 process per rank; ``python -m recover_hsdp.workers.bench_hsdp CFG OUT_DIR``)

This package sits above config/ and hsdp/ and below the launcher (tests/unit/test_layering.py):
it joins the config and the manager (the target layout, docs/architecture.md: the only package
that imports both).
"""
