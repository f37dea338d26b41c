"""``deepinfer-jax`` command line: ``generate`` (greedy continuation of a token-id prompt) and
``convert`` (safetensors -> Orbax).

``--model`` takes a model directory (safetensors or Orbax) or a preset name. A preset has no
released weights here, so on first use a random-weight checkpoint of that preset is written to
``$DEEPINFER_CACHE`` (default ``~/.cache/deepinfer_jax``) and reused afterwards. Until the
engine lands (``LLM.generate``), ``generate`` drives the model directly, one sequence at a time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "v41-tiny"
DEFAULT_PROMPT = "0,17,42,99,7,128,64,33,200,5,71,19,88"


def cache_root() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer_jax"))


def resolve_model(model: str, seed: int = 0, progress: bool = True) -> str:
    """A model directory for ``model``: an existing directory, or a preset's random checkpoint
    (written on first use)."""
    from deepinfer_jax.config import PRESETS, preset

    if os.path.isdir(model):
        return model
    if model not in PRESETS:
        raise ValueError(f"--model {model!r}: not a directory and not a preset (presets: {sorted(PRESETS)})")
    out = cache_root() / f"{model}-random-seed{seed}"
    if not (out / "config.json").exists():
        from deepinfer_jax.models.random_checkpoint import write_random_checkpoint

        print(f"writing a random-weight {model} checkpoint to {out} (first use)", file=sys.stderr)
        tmp = out.with_name(out.name + ".partial")
        write_random_checkpoint(preset(model), tmp, seed=seed, progress=progress)
        tmp.rename(out)
    return str(out)


def parse_ids(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    if not ids:
        raise ValueError("--prompt-ids: the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"--prompt-ids: token ids {bad} outside the vocabulary [0, {vocab})")
    return ids


def cmd_generate(args) -> int:
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.cache import CacheConfig
    from deepinfer_jax.models.engram_hash import EngramHasher
    from deepinfer_jax.models.greedy import SequenceDriver
    from deepinfer_jax.models.weights import load_model

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    model_dir = resolve_model(args.model, seed=args.seed)
    cfg = ModelConfig.from_json(model_dir)
    prompt = parse_ids(args.prompt_ids, cfg.vocab_size)
    t0 = time.perf_counter()
    model = load_model(model_dir, cfg, progress=True)
    tok = os.path.join(model_dir, "tokenizer.json")
    hasher = None
    if cfg.engram_enabled:
        hasher = EngramHasher.from_model_config(cfg, tok if os.path.exists(tok) else None)
    block = 64
    need = len(prompt) + args.max_new_tokens
    cc = CacheConfig(num_slots=1, num_blocks=-(-need // block), block_tokens=block,
                     max_blocks_per_seq=-(-need // block))
    drv = SequenceDriver(model, cc, hasher)
    t1 = time.perf_counter()
    out = drv.generate_greedy(prompt, args.max_new_tokens, chunk=args.chunk)
    t2 = time.perf_counter()
    print(f"model:  {model_dir}")
    print(f"prompt: {prompt}")
    print(f"greedy: {out}")
    if os.path.exists(tok):
        from tokenizers import Tokenizer

        print(f"text:   {Tokenizer.from_file(tok).decode(out, skip_special_tokens=False)!r}")
    print(f"load {t1 - t0:.1f}s, generate {len(out)} tokens in {t2 - t1:.1f}s (includes compilation)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from deepinfer_jax.entrypoints import convert_cmd

    p = argparse.ArgumentParser(prog="deepinfer-jax", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy continuation of a token-id prompt")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"model dir or preset (default {DEFAULT_MODEL})")
    g.add_argument("--prompt-ids", default=DEFAULT_PROMPT, help="comma-separated token ids")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--chunk", type=int, default=None, help="prefill chunk size (default: whole prompt)")
    g.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    g.set_defaults(func=cmd_generate)
    convert_cmd.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"deepinfer-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
