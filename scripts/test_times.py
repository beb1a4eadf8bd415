"""Per-file test time from the JUnit XML report ``scripts/test.sh`` writes: the files that
decide the suite's wall time (with whole files per worker, the longest files are what to mark
``slow``, so they start first, or to trim).

    python scripts/test_times.py [build/test-report.xml] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def per_file(report: Path) -> list[tuple[str, float, int]]:
    """(file, seconds, tests) for every file in the report, longest first."""
    seconds: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("file") or case.get("classname", "?").split("::")[0]
        if not name.endswith(".py"):  # classname is the dotted module (and class)
            name = name.replace(".", "/")
            while name and not Path(name + ".py").exists() and "/" in name:
                name = name.rsplit("/", 1)[0]
            name += ".py"
        seconds[name] += float(case.get("time", 0))
        counts[name] += 1
    return sorted(((f, s, counts[f]) for f, s in seconds.items()), key=lambda r: -r[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", nargs="?", default="build/test-report.xml", type=Path)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    rows = per_file(args.report)
    total = sum(s for _, s, _ in rows)
    print(f"{'file':<72} {'s':>8} {'tests':>6}")
    for name, s, n in rows[:args.top]:
        print(f"{name:<72} {s:8.1f} {n:6d}")
    print(f"{'all ' + str(len(rows)) + ' files (serial time)':<72} {total:8.1f}")


if __name__ == "__main__":
    main()
