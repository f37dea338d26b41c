"""``deepinfer-jax`` command line: ``generate`` (offline generation through ``LLM.generate``) and
``convert`` (safetensors -> Orbax).

``--model`` takes a model directory (safetensors or Orbax) or a preset name; a preset has no
released weights here, so on first use a random-weight checkpoint of that preset is written to
``$DEEPINFER_CACHE`` (default ``~/.cache/deepinfer_jax``) and reused afterwards
(``models/registry.py``). ``--load-format dummy`` reads only the config and tokenizer of the
model and draws the weights on the device (a preset then writes no checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys

from deepinfer_jax.entrypoints import compile_cache
from deepinfer_jax.models.registry import DEFAULT_MODEL

# Python, what the default model (v41-small-code) was trained on; a def line ends without its
# newline (the tokenizer merges it with the next line's indent)
DEFAULT_PROMPTS = ["def fibonacci(n):", "import numpy as np\n\n\ndef normalize(x, axis=-1):",
                   "class Stack:\n    def __init__(self):", "for i, line in enumerate(lines):"]


class CLIError(ValueError):
    """A bad command-line value: printed as ``error: --flag: why`` (exit code 2)."""

    def __init__(self, flag: str, why: str):
        super().__init__(f"{flag}: {why}")


def parse_int_list(flag: str, text: str) -> list[int]:
    """Comma-separated integers (spaces allowed); an empty entry is an error."""
    parts = text.replace(" ", "").split(",")
    try:
        if not all(parts):
            raise ValueError
        return [int(t) for t in parts]
    except ValueError:
        raise CLIError(flag, f"{text!r}: expected comma-separated integers, e.g. 1,2,3") from None


def parse_ids(text: str) -> list[int]:
    return parse_int_list("--prompt-ids", text)


# SamplingParams fields -> their flags
_SAMPLING_FLAGS = {"n": "--n", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                   "max_tokens": "--max-tokens", "seed": "--seed", "ignore_eos": "--ignore-eos"}


def sampling_params_of(args):
    """The run's SamplingParams, checked before any model is loaded."""
    from deepinfer_jax import SamplingParams

    kw = dict(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    sp = SamplingParams(**kw)
    for field, flag in _SAMPLING_FLAGS.items():  # one field at a time, to name its flag
        try:
            SamplingParams(**{field: kw[field]}).validate()
        except ValueError as e:  # "SamplingParams.top_p=1.5: must be in (0, 1]"
            raise CLIError(flag, f"{kw[field]!r}: {str(e).split(': ', 1)[-1]}") from None
    return sp.validate()


def check_output_path(flag: str, path: str) -> None:
    """Create the folder of an output file and check it can be written, before the run."""
    import os

    if os.path.isdir(path):
        raise CLIError(flag, f"{path!r} is a directory; expected a file path")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise CLIError(flag, f"cannot create the folder {folder!r}: {e.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise CLIError(flag, f"the folder {folder!r} is not writable")


def cmd_generate(args) -> int:
    from deepinfer_jax import LLM

    # everything the command line alone decides is checked before loading and compiling
    prompts: list = list(args.prompt or []) + [parse_ids(t) for t in (args.prompt_ids or [])]
    if not prompts:
        prompts = DEFAULT_PROMPTS
    if args.repeat < 1:
        raise CLIError("--repeat", f"{args.repeat}: must be >= 1")
    prompts = prompts * args.repeat
    sp = sampling_params_of(args)
    if args.stats_json:
        check_output_path("--stats-json", args.stats_json)
    engine = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  async_scheduling=not args.sync, yoco_truncation=args.yoco_truncation,
                  enable_prefix_caching=not args.no_prefix_caching, kernels=args.kernels,
                  index_key_dtype=args.index_key_dtype, kv_cache_dtype=args.kv_cache_dtype, load_format=args.load_format,
                  precompile=not args.no_precompile)
    if args.batch_invariant:
        engine["batch_invariant"] = True
    if args.token_buckets:
        engine["token_buckets"] = tuple(parse_int_list("--token-buckets", args.token_buckets))
    if args.max_model_len is not None:
        engine["max_model_len"] = args.max_model_len
    if args.no_compile_cache:
        cache = False
    elif args.compile_cache:
        cache = args.compile_cache
    else:  # on by default here; the environment, when set, decides
        cache = None if compile_cache.ENV in os.environ else True
    try:
        cache_dir = compile_cache.resolve(cache)
    except ValueError as e:
        raise CLIError("--compile-cache", str(e).split(": ", 1)[-1]) from None
    llm = LLM(args.model, model_seed=args.model_seed, compile_cache=cache_dir or False, **engine)
    outs = llm.generate(prompts, sp, use_tqdm=True)
    for o in outs:
        shown = repr(o.prompt) if o.prompt is not None else o.prompt_token_ids
        for c in o.outputs:
            tag = f"[{o.request_id}.{c.index}]" if len(o.outputs) > 1 else f"[{o.request_id}]"
            print(f"{tag} prompt: {shown}")
            print(f"{' ' * len(tag)} output: {c.text!r}  tokens {c.token_ids}  ({c.finish_reason})")
    print(f"model {llm.model_dir}; compile {llm.compile_time_s:.1f}s; " + llm.stats.summary_line())
    if args.stats_json:
        llm.stats.to_json(args.stats_json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from deepinfer_jax.entrypoints import convert_cmd

    p = argparse.ArgumentParser(prog="deepinfer-jax", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate continuations of prompts (LLM.generate)")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"model dir or preset (default {DEFAULT_MODEL})")
    g.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    g.add_argument("--prompt-ids", action="append", help="a token-id prompt, comma-separated (repeatable)")
    g.add_argument("--repeat", type=int, default=1, help="submit the prompt list this many times")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--seed", type=int, default=None, help="sampling seed of every request")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=128)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--token-buckets", default=None, help="comma-separated padded step sizes")
    g.add_argument("--yoco-truncation", default="compact", choices=["off", "mask", "compact"])
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--sync", action="store_true", help="synchronous loop (async scheduling off)")
    g.add_argument("--kernels", default=None, choices=["auto", "reference", "ffi"],
                   help="kernel backend (default: $DEEPINFER_KERNELS or auto)")
    g.add_argument("--no-precompile", action="store_true", help="compile buckets on first use")
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's output does not depend on its batch (default: $DEEPINFER_BATCH_INVARIANT)")
    g.add_argument("--index-key-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="index-key cache format: fp8 = e5m2 codes + a scale per key (same results, ~half the bytes)")
    g.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "packed"],
                   help="window and compressed KV caches: packed = fp8 / fp4 codes + scales (same results, "
                        "52%% / 28%% of the bytes)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto: the model's checkpoint; dummy: random weights drawn on the device "
                        "(the model dir gives only config.json and tokenizer.json)")
    g.add_argument("--model-seed", type=int, default=0,
                   help="seed of a preset's random weights, or of --load-format dummy's")
    g.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="persistent compilation cache: a second start loads its compiled steps "
                        f"(default ${compile_cache.ENV}, else ~/.cache/deepinfer_jax/xla)")
    g.add_argument("--no-compile-cache", action="store_true", help="compile every step afresh")
    g.add_argument("--stats-json", default=None, help="write per-step stats and the summary here")
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
