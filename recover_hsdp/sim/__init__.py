"""`recover-hsdp simulate`: a discrete-event simulation of a pre-training run at 1k-100k GPUs.

Pure Python (stdlib; matplotlib only for plots, imported lazily). It imports the policy
(`recover_hsdp.policy.CountModel` decides every layout: boundary steps, G_ext, algorithm 7) and
the torch-free run-record reader (`recover_hsdp.record.timeline`) for calibration; never torch,
hsdp, recovery or collectives (tests/unit/test_simulate.py checks the sources).

  costs.py      Scenario, CostModel (defaults with sources), Young/Daly closed forms
  failures.py   exponential per-GPU failures (node / hang / fatal kinds), trace files
  engine.py     in place (recover_hsdp, drop-and-go, rejoin), checkpoint-restart, stall model
  calibrate.py  cost model from measured runs; the throughput-experiment validation
  plan.py       modes side by side, the spare plan, sweeps over scale and MTBF, plots
  cli.py        the command
"""
