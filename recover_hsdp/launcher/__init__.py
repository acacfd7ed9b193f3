"""The supervisor: everything that runs outside the ranks (docs/architecture.md, "Target layout").

command.py     the mpirun lines (the trainer's; mpirun_prefix for benchmarks and tests), the
               ranks' environment
store.py       the TCPStore served outside the ranks, the store host
run.py         run_job / stop_job: start a job, stream its output, stop it
job.py         a launched `recover-hsdp train` job: Job / JobResult, its mpirun line and env
judge.py       the verdict of a run from its record, the exit-code table
watchdog.py    HangWatchdog: stale heartbeats, stalled progress
reaper.py      the still mates of a rank that died uncleanly
startup.py     StartupWatch (deaths before the world forms), EndWatch (a hung mpirun)
nodeloss.py    mpirun's lost-daemon output -> the next segment's hosts
supervise.py   ONE supervised launch (store, watchdog + reaper, start-up watch and retries, end
               watch): every launcher below and baselines/checkpoint_restart.py start mpirun here
resume.py      the relaunch / resume / rejoin policy of `recover-hsdp train`
launch_cmd.py  `recover-hsdp launch -n N -- COMMAND`: any rank program, supervised
rank.py        the rank parent under `recover-hsdp launch` (exit and error records)

Pure Python at module level (no torch: tests/unit/test_launch_cost.py). This file imports
nothing, so that config/ can use launcher.store (a leaf placed below config in the layering).
"""
