#!/usr/bin/env python3
"""Summary of `benches/gpu/ab.sh`'s output (lines `build,` + the bench's CSV row).

For each stack, workload and thread count: each build's minimum and median of the
rounds' best times (ns per op), and the median of the per-round ratios of each build to
the first build named (the rounds' pairing cancels part of an instance's drift).

    bash benches/gpu/ab.sh ... > ab.csv; python3 benches/gpu/ab_summary.py ab.csv
"""
import statistics
import sys


def main(path):
    rows, builds = {}, []
    for line in open(path):
        p = line.strip().split(",")
        if len(p) < 8:
            continue
        try:
            best = float(p[6])
        except ValueError:
            continue
        if p[0] not in builds:
            builds.append(p[0])
        rows.setdefault((p[2], p[3], p[4]), {}).setdefault(p[0], []).append(best)
    base = builds[0] if builds else None
    for key in sorted(rows):
        runs = rows[key]
        cells = [f"{b} min {min(v):.1f} med {statistics.median(v):.1f}" for b, v in runs.items()]
        for b, v in runs.items():
            if b != base and base in runs:
                ratios = [x / y for x, y in zip(v, runs[base])]
                cells.append(f"{b}/{base} {statistics.median(ratios):.3f}")
        print(",".join(key), "; ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1])
