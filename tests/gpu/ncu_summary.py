#!/usr/bin/env python3
"""Per-kernel totals of an `ncu --csv --page raw` capture of whole decode steps (verify.sh --ncu).

    ncu_summary.py NCU_CSV STEPS

Prints, per kernel (template arguments kept, parameters dropped), the launches per step, the time
per step and per call, and DRAM bytes read per second of kernel time, longest first; then the
total per step. Times are ncu's (clocks locked to base), so they add up to more than a step takes
in a CUDA graph at full clocks.
"""
import collections
import csv
import re
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    steps = float(sys.argv[2])
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        sys.exit(f"ncu_summary.py: no 'Kernel Name' header in {sys.argv[1]}")
    h = rows[head]
    ki, ti = h.index("Kernel Name"), h.index("gpu__time_duration.sum")
    bi = h.index("dram__bytes_read.sum") if "dram__bytes_read.sum" in h else None
    agg = collections.OrderedDict()
    for r in rows[head + 2:]:  # the row after the header holds the units
        if len(r) != len(h):
            continue
        name = re.sub(r"\(.*", "", r[ki]).replace("void ", "")
        a = agg.setdefault(name, [0, 0.0, 0.0])
        a[0] += 1
        a[1] += float(r[ti].replace(",", ""))  # ns
        a[2] += float(r[bi].replace(",", "")) if bi is not None else 0.0
    total = sum(a[1] for a in agg.values())
    print(f"{'per step':>8} {'us/step':>9} {'us/call':>8} {'GB/s':>7}  kernel")
    for name, (n, t, b) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"{n / steps:8.0f} {t / steps / 1e3:9.1f} {t / n / 1e3:8.2f} {b / t if t else 0:7.0f}  {name}")
    print(f"total {total / steps / 1e3:.1f} us per step over {sum(a[0] for a in agg.values())} launches")


if __name__ == "__main__":
    main()
