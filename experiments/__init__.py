"""Reproduction experiments: how the numbers and figures in docs/ were made. Not installed.

This folder sits next to the package (`recover_hsdp/`), not inside it: `pip install .` ships
the toolkit and the benchmarks a user runs (`recover-hsdp bench gpu|collectives|hsdp|stack|
snapshot|planner`); the experiments run from a checkout, from the repository root, as
``python -m experiments.NAME [args]`` (``--help`` on each; docs/ has the readings). They import
the package; nothing in the package imports them (tests/unit/test_layering.py). Their tests are
in tests/experiments/ (and verify's tests use verify_synthetic).

  paper               the paper's section 5 / appendix A.1 runs at this scale   docs/results.md
  longrun             one long run with every kind of interruption              docs/results.md 7
  peers               the same job under torchft, side by side with ours        docs/results.md 5
                      (peers_runs, peers_analysis; peers_worker is the torchft worker process,
                      peers_probe decodes the divisor torchft applied)
  verify_sensitivity  verify against single faults injected into the run       docs/verify.md
  verify_seam_table   the same with the real trainer (the test-only fault seam) docs/verify.md
  verify_calibrate    verify's default tolerances, calibrated                   docs/verify.md
  verify_synthetic    write a synthetic run directory (one process)             docs/verify.md
  measure_fsdp_s1_cost  FSDP's cost at shard size 1 vs the plain module         docs/results.md 5
  measure_fsdp_accum  microbatch accumulation (pytest experiments/measure_fsdp_accum.py -s,
                      RECOVER_HSDP_MEASURE=1)                                   docs/hsdp.md
  gpu_check           the GPU-only paths, on a machine with a GPU
  probes/             ULFM / DVM / rejoin probes (scripts, mpirun)              docs/rejoin.md
"""
