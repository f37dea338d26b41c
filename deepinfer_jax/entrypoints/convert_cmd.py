"""``deepinfer-jax convert --model SRC --out DST``: safetensors model directory -> Orbax model
directory (``checkpoint/orbax_io.py``). ``SRC`` may be a preset name, resolved as ``generate`` does
(its random-weight checkpoint, ``models/registry.py``). ``--dp/--cp`` spread the weights over a
device mesh while converting (for models larger than one device)."""

from __future__ import annotations

import argparse
import time


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert", help="convert a safetensors model directory to an Orbax model directory",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="SRC",
                   help="model directory (config.json + safetensors shards (+ tokenizer.json)) or a preset")
    p.add_argument("--model-seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--out", required=True, metavar="DST", help="output Orbax model directory")
    p.add_argument("--dp", type=int, default=1, help="data-parallel mesh size used while converting (default 1)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel mesh size used while converting (default 1)")
    p.add_argument("--force", action="store_true", help="overwrite DST/params if it exists")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from deepinfer_jax.models.convert import convert
    from deepinfer_jax.models.registry import resolve_model

    src = resolve_model(args.model, seed=getattr(args, "model_seed", 0), progress=getattr(args, "progress", True))
    mesh = None
    if getattr(args, "dp", 1) * getattr(args, "cp", 1) > 1:
        from deepinfer_jax.sharding.mesh import ParallelConfig, make_mesh

        mesh = make_mesh(ParallelConfig(dp=args.dp, cp=args.cp))
    t0 = time.perf_counter()
    out = convert(src, args.out, progress=getattr(args, "progress", True), mesh=mesh,
                  force=getattr(args, "force", False))
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s")
    return 0
