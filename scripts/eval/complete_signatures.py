#!/usr/bin/env python
"""Greedy completions of function signatures taken from held-out files (the README's examples):

    python scripts/eval/complete_signatures.py --root /usr/lib/python3.12 \
        --at string.py:37 logging/__init__.py:208 [--model v41-small-code] [--max-tokens 48]

Each ``FILE:LINE`` is a ``def`` line of a file under ``--root`` (pick files of the model's
held-out list, ``heldout_files.txt``); the prompt is that line without its newline (byte-level BPE merges
the newline with the next line's indent, so a prompt ending in one is an unusual split) and the
completion is greedy.
Prints prompt and completion per example (``--json`` for machine-readable output).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--at", nargs="+", required=True, help="FILE:LINE of def lines under --root")
    ap.add_argument("--model", default=None, help="model dir or name (default: the shipped model)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    prompts = []
    for spec in a.at:
        path, _, line = spec.rpartition(":")
        if not path or not line.isdigit():
            ap.error(f"--at {spec!r}: expected FILE:LINE")
        lines = open(os.path.join(a.root, path), encoding="utf-8").read().splitlines()
        n = int(line)
        if not 1 <= n <= len(lines) or not lines[n - 1].lstrip().startswith("def "):
            ap.error(f"--at {spec!r}: line {n} is not a def line")
        prompts.append((spec, lines[n - 1]))  # no newline: the tokenizer merges it with the indent
    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.models.registry import DEFAULT_MODEL

    llm = LLM(a.model or DEFAULT_MODEL, max_num_seqs=len(prompts), progress=False)
    outs = llm.generate([p for _, p in prompts], SamplingParams(temperature=0.0, max_tokens=a.max_tokens),
                        use_tqdm=False)
    rows = [{"at": s, "prompt": p, "completion": o.outputs[0].text} for (s, p), o in zip(prompts, outs)]
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"# {r['at']}\n{r['prompt']}{r['completion']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
