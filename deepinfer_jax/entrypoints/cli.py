"""``deepinfer-jax`` command line: ``generate`` (offline generation through ``LLM.generate``) and
``convert`` (safetensors -> Orbax).

``--model`` takes a model directory (safetensors or Orbax) or a preset name; a preset has no
released weights here, so on first use a random-weight checkpoint of that preset is written to
``$DEEPINFER_CACHE`` (default ``~/.cache/deepinfer_jax``) and reused afterwards
(``models/registry.py``).
"""

from __future__ import annotations

import argparse
import sys

from deepinfer_jax.models.registry import DEFAULT_MODEL

DEFAULT_PROMPTS = ["the quick brown fox", "once upon a time there was", "a b c d e f g",
                   "hello world , this is a test of the engine"]


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    return ids


def cmd_generate(args) -> int:
    from deepinfer_jax import LLM, SamplingParams

    prompts: list = list(args.prompt or []) + [parse_ids(t) for t in (args.prompt_ids or [])]
    if not prompts:
        prompts = DEFAULT_PROMPTS
    prompts = prompts * args.repeat
    engine = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  async_scheduling=not args.sync, yoco_truncation=args.yoco_truncation,
                  enable_prefix_caching=not args.no_prefix_caching, kernels=args.kernels,
                  index_key_dtype=args.index_key_dtype,
                  precompile=not args.no_precompile)
    if args.token_buckets:
        engine["token_buckets"] = tuple(int(b) for b in args.token_buckets.split(","))
    if args.max_model_len:
        engine["max_model_len"] = args.max_model_len
    llm = LLM(args.model, model_seed=args.model_seed, **engine)
    sp = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
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
    g.add_argument("--kernels", default=None, choices=["auto", "reference"],
                   help="kernel backend (default: $DEEPINFER_KERNELS or auto)")
    g.add_argument("--no-precompile", action="store_true", help="compile buckets on first use")
    g.add_argument("--index-key-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="index-key cache format: fp8 = e5m2 codes + a scale per key (same results, ~half the bytes)")
    g.add_argument("--model-seed", type=int, default=0, help="seed of a preset's random weights")
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
