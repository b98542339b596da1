"""Side by side: the bus bandwidth (GB/s) of each build in a log of several odc_bench runs, per
section and size. A run starts with a line "=== <transport> <build> round <n> ..." (the round
scripts in docs/results/round30_2xh200/ write them); the table has one column per build and
round, so alternated runs of the same build show their spread.

  python dev/analysis/nvshmem_bench_table.py LOG [SECTIONS]

SECTIONS: comma-separated, of gather (all ranks at once), gather-solo (one rank at a time),
gather-in-minibatch, push1 (one push per minibatch with its barriers), b2b (back-to-back
pushes); default push1,b2b.
"""

from __future__ import annotations

import collections
import re
import sys

RUN = re.compile(r"=== (\S+) (\S+) round (\d+)")
ROW = re.compile(r"\s+(\d+)MiB\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x")


def section_of(title: str) -> str:
    if "back-to-back" in title:
        return "b2b"
    if "one push" in title:
        return "push1"
    if "per minibatch" in title:
        return "gather-in-minibatch"
    if "one rank at a time" in title:
        return "gather-solo"
    return "gather"


def read(path: str) -> dict:
    """{(section, MiB): {"build.round": GB/s}}"""
    rows: dict = collections.defaultdict(dict)
    run = section = None
    with open(path) as log:
        for line in log:
            started = RUN.match(line)
            if started:
                run = f"{started.group(2)}.{started.group(3)}"
                continue
            if line.startswith(("gather", "scatter")):
                section = section_of(line)
                continue
            row = ROW.match(line)
            if row and run and section:
                rows[(section, int(row.group(1)))][run] = float(row.group(3))
    return rows


def main(argv: list) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    rows = read(argv[1])
    wanted = (argv[2] if len(argv) == 3 else "push1,b2b").split(",")
    runs = sorted({r for cells in rows.values() for r in cells}, key=lambda r: (r[-1], r))
    print("section  size     " + " ".join(f"{r:>9}" for r in runs))
    for (section, mib), cells in sorted(rows.items()):
        if section in wanted:
            values = " ".join(f"{cells[r]:9.1f}" if r in cells else " " * 9 for r in runs)
            print(f"{section:8} {mib:4}MiB  {values}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
