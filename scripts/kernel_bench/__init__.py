"""Kernel micro-benchmarks: one module per op, each with ``bench(quick) -> list[dict]`` and
``print_table(rows)``; ``scripts/bench_kernels.py`` runs them all, each also runs standalone."""

from __future__ import annotations

import argparse
import json


def standalone_main(doc: str, bench, print_table, argv=None) -> int:
    """``python scripts/kernel_bench/<op>.py [--quick] [--json FILE]``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = bench(a.quick)
    print_table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
