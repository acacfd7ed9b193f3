"""Figures from ulfm_dvm_run.sh output: per scenario, median (min, max, n) of
newcomer launch -> MPI up, Connect, Merge, kill -> last survivor's detection, shrink, root Accept.

    bash experiments/probes/ulfm_dvm_run.sh ok a e ok a e ok a e > /tmp/dvm.txt 2>&1
    python experiments/probes/ulfm_dvm_times.py /tmp/dvm.txt
"""
import re, statistics as st, sys

txt = open(sys.argv[1], errors="replace").read()
parts = re.split(r"===== scenario (\w+)\n", txt)[1:]
rows = {}
for scen, body in zip(parts[0::2], parts[1::2]):
    r = rows.setdefault(scen, {})
    f = lambda pat: [float(x) for x in re.findall(pat, body)]
    add = lambda k, v: r.setdefault(k, []).extend(v)
    launched = f(r"B launched at=([\d.]+)")
    conn = re.search(r"\[B0\] connected in ([\d.]+)s t=([\d.]+) at=([\d.]+)", body)
    if launched and conn:   # B's T0 (after MPI_Init) = at - t
        add("launch->MPI up s", [float(conn.group(3)) - float(conn.group(2)) - launched[0]])
        add("connect s", [float(conn.group(1))])
    add("merge s", f(r"\[B0\] merged size \d+ rank \d+ in ([\d.]+)s"))
    kill = f(r"SIGKILL self t=[\d.]+ at=([\d.]+)")
    det = f(r"\[[AB]\d\] [AB]-(?:merged|world): round \d failed class \d+ t=[\d.]+ at=([\d.]+)")
    if kill and det:
        add("kill->last detection s", [max(det) - kill[0]])
    add("shrink s", f(r"\[[AB]\d\] [AB]-(?:merged|world): shrink -> \d in ([\d.]+)s"))
    add("root accept s", f(r"\[A0\] accepted in ([\d.]+)s"))
for scen, r in rows.items():
    print(scen, "; ".join(f"{k} {st.median(v):.3f} ({min(v):.3f}-{max(v):.3f}, n={len(v)})"
                          for k, v in r.items() if v))
