#!/usr/bin/env python3
"""Where the train step's time goes: every ``kernels_pallas/ops.py`` op the training forward
calls, timed alone at the shapes the forward gives it, then the whole jitted train step.

1. One ``jax.eval_shape`` of ``train_forward`` (on the abstract model, no weights allocated)
   with each public op of ``ops.py`` (the functions that ``_pick`` a kernel) wrapped by a
   recorder: each distinct call signature (array shapes/dtypes + static args) is kept with the
   number of times the forward makes it and the layers it comes from. The LM head's input and
   the taps / compressed KV the indexer KL reads are recorded the same way.
2. Per signature: fresh random inputs of those shapes (index arrays synthesised to be valid and
   realistic: window-like or sorted in-range pool indices with ``-1`` padding, per-row entry
   tables, ``n_visible`` growing with the position, distinct experts per token), the jnp
   reference jitted, fwd and fwd+bwd (grad of the output's sum w.r.t. the float inputs; ops with
   int/bool outputs have no backward) timed as the median of a few runs after one compile.
   Also the LM head (fp32 matmul) + cross-entropy, the CE alone, and the indexer KL term.
3. "op sum vs step": sum over rows of fwd+bwd x calls per step, against the measured step.
4. The whole step (``Trainer.step``, AdamW + balance): compile, median over ``--steps``, tok/s.

Rows print as they are measured and the JSON is rewritten after each one, so a run cut short
still leaves its rows. ``--budget-s``: no new row starts after that many seconds (the op phase
also leaves ``--step-reserve-s`` for the whole step unless ``--skip-step``).

    python scripts/bench_train_step.py [--preset v41-small] [--batch 16] [--seq-len 1024]
        [--steps 5] [--reps 5] [--skip-step] [--budget-s 180] [--out FILE]
    python scripts/bench_train_step.py --preset v41-train-tiny --batch 2 --seq-len 64   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

_HELPERS = ("_pick",)


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- recording
def public_ops(ops_mod) -> list[str]:
    """The ops' public functions: those in ``ops.py`` whose body dispatches through ``_pick``."""
    names = []
    for name, fn in vars(ops_mod).items():
        if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != ops_mod.__name__:
            continue
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        if "_pick(" in src:
            names.append(name)
    return names


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _caller_layer():
    """The model layer a call comes from: the nearest frame whose ``self`` has an int ``layer``."""
    f = inspect.currentframe()
    for _ in range(12):
        f = f.f_back if f is not None else None
        if f is None:
            return None
        s = f.f_locals.get("self")
        lay = getattr(s, "layer", None)
        if isinstance(lay, int):
            return lay
    return None


@dataclasses.dataclass
class OpCall:
    """One distinct call signature of an op during the forward."""
    op: str
    treedef: object            # of (args, kwargs) with the array leaves
    leaves: list               # ShapeDtypeStruct for arrays, the python value otherwise
    calls: int = 0
    layers: list = dataclasses.field(default_factory=list)

    def key(self):
        return (self.op, str(self.treedef), tuple(
            (tuple(x.shape), str(x.dtype)) if isinstance(x, _SDS()) else ("static", repr(x)) for x in self.leaves))

    def describe(self) -> str:
        arrs = [f"{str(x.dtype)}{list(x.shape)}" for x in self.leaves if isinstance(x, _SDS())]
        stat = [repr(x) for x in self.leaves if not isinstance(x, _SDS()) and x is not None]
        return " ".join(arrs) + ((" | " + ",".join(stat)) if stat else "")


def _SDS():
    import jax

    return jax.ShapeDtypeStruct


class Recorder:
    """Patches ``ops.<name>`` (the model calls ``ops.name(...)`` through the module) with
    recorders that keep each distinct signature and count its calls, then call through."""

    def __init__(self, ops_mod, names):
        self.ops, self.names, self.calls, self._orig = ops_mod, names, {}, {}

    def _wrap(self, name, fn):
        import jax

        def rec(*args, **kwargs):
            leaves, treedef = jax.tree.flatten((args, kwargs))
            sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_array(x) else x for x in leaves]
            c = OpCall(name, treedef, sds)
            c = self.calls.setdefault(c.key(), c)
            c.calls += 1
            lay = _caller_layer()
            if lay is not None and lay not in c.layers:
                c.layers.append(lay)
            return fn(*args, **kwargs)

        return rec

    def __enter__(self):
        for n in self.names:
            self._orig[n] = getattr(self.ops, n)
            setattr(self.ops, n, self._wrap(n, self._orig[n]))
        return self

    def __exit__(self, *exc):
        for n, fn in self._orig.items():
            setattr(self.ops, n, fn)
        return False


def record_forward(cfg, batch: int, seq_len: int):
    """``(op calls, extras)`` of one abstract trace of ``train_forward``: the op signatures and
    the shapes of the LM head's input/weight and of what ``indexer_kl`` reads."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from deepinfer_jax.kernels_pallas import ops
    from deepinfer_jax.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer_jax.models.weights import abstract_model
    from deepinfer_jax.training.forward import engram_shape, train_forward
    from deepinfer_jax.training.indexer_loss import indexer_layers

    graphdef, abstract = abstract_model(cfg)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    eids = jax.ShapeDtypeStruct(engram_shape(cfg, batch, seq_len), jnp.int32) if cfg.engram_enabled else None
    head_in = {}
    orig_logits = DeepseekV41ForCausalLM.logits

    def logits_rec(self, h_TD):
        head_in.setdefault("h", jax.ShapeDtypeStruct(h_TD.shape, h_TD.dtype))
        w = self.head.weight[...]
        head_in.setdefault("w", jax.ShapeDtypeStruct(w.shape, w.dtype))
        return orig_logits(self, h_TD)

    def fwd(state, toks, e):
        taps = {}
        model = nnx.merge(graphdef, state)
        logits, cache, _ = train_forward(model, toks, e, taps)
        want = {k: v for k, v in taps.items()
                if any(k in (f"attn{l}_q", f"index{l}_scores") for l in indexer_layers(cfg))}
        return logits, want, list(cache.comp_kv)

    rec = Recorder(ops, public_ops(ops))
    DeepseekV41ForCausalLM.logits = logits_rec
    try:
        with rec:
            logits, taps, comp_kv = jax.eval_shape(fwd, abstract, tokens, eids)
    finally:
        DeepseekV41ForCausalLM.logits = orig_logits
    return list(rec.calls.values()), {"head": head_in, "logits": logits, "taps": taps, "comp_kv": comp_kv}


# ----------------------------------------------------------------------------- synthesis
def _np_dtype(dt):
    import numpy as np

    return np.dtype(dt)


def _randn(rng, sds, scale=1.0):
    import jax.numpy as jnp

    return jnp.asarray((rng.standard_normal(sds.shape) * scale).astype("float32"), sds.dtype)


def _n_visible(T: int, L: int, N: int):
    """Entries visible to token t at position t % L of a row whose N entries cover L positions."""
    import numpy as np

    pos = np.arange(T) % L
    return np.minimum(((pos + 1) * N) // L, N).astype(np.int32)


def _scores(rng, T, N, L, dtype):
    import jax.numpy as jnp
    import numpy as np

    s = rng.standard_normal((T, N)).astype(np.float32)
    s = np.where(np.arange(N)[None, :] < _n_visible(T, L, N)[:, None], s, -np.inf)
    return jnp.asarray(s, dtype)


def synth_args(call: OpCall, seq_len: int, seed: int = 0):
    """Concrete ``(args, kwargs)`` for ``call``: floats random, index arrays valid (see module doc)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    SDS = jax.ShapeDtypeStruct
    (args_s, kwargs_s) = jax.tree.unflatten(call.treedef, call.leaves)
    op, L = call.op, seq_len

    def generic(x):
        if not isinstance(x, SDS):
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return _randn(rng, x)
        if x.dtype == jnp.bool_:
            return jnp.asarray(rng.random(x.shape) < 0.5)
        return jnp.zeros(x.shape, x.dtype)

    if op == "sparse_attention":
        q, pools, idxs, sink, *rest = args_s
        T = q.shape[0]
        new_idx = []
        for i, (p, ix) in enumerate(zip(pools, idxs)):
            P, M = p.shape[0], ix.shape[1]
            base = (np.arange(T) * P) // T  # token t's newest entry: the pool grows with t
            if i == 0 and P >= T:  # window: ring, then this step's T new entries; the M newest of the row
                pos = np.arange(T) % L
                v = (P - T) + np.arange(T)[:, None] - np.arange(M)[None, :]
                v = np.where(pos[:, None] >= np.arange(M)[None, :], v, -1)
            elif i == 0:
                start = (np.arange(T) // L) * L * P // T
                v = base[:, None] - np.arange(M)[None, :]
                v = np.where(v >= start[:, None], v, -1)
            else:  # compressed top-k: sorted in-range entries of the row, -1 where fewer exist
                start = (np.arange(T) // L) * (L * P // T)
                span = np.maximum(base - start + 1, 1)
                v = start[:, None] + (rng.random((T, M)) * span[:, None]).astype(np.int64)
                v = np.sort(v, axis=1)
                v = np.where(np.arange(M)[None, :] < span[:, None], v, -1)
            new_idx.append(jnp.asarray(v, ix.dtype))
        args = (_randn(rng, q), tuple(_randn(rng, p) for p in pools), tuple(new_idx), _randn(rng, sink), *rest)
        return args, kwargs_s
    if op in ("indexer_scores_pool", "indexer_scores"):
        if op == "indexer_scores_pool":
            q, pool, entry, token_row, w, n_vis, *scale = args_s
            R, N = entry.shape
            T = q.shape[0]
            P = pool.shape[0]
            ent = (np.arange(R)[:, None] * N + np.arange(N)[None, :]) % P
            args = (_randn(rng, q), _randn(rng, pool), jnp.asarray(ent, entry.dtype),
                    jnp.asarray(np.minimum(np.arange(T) // L, R - 1), token_row.dtype), _randn(rng, w),
                    jnp.asarray(_n_visible(T, L, N), n_vis.dtype),
                    *[None if s is None else jnp.asarray(np.ones(s.shape), s.dtype) for s in scale])
        else:
            q, k, w, n_vis = args_s
            T, N = k.shape[0], k.shape[1]
            args = (_randn(rng, q), _randn(rng, k), _randn(rng, w), jnp.asarray(_n_visible(T, L, N), n_vis.dtype))
        return args, kwargs_s
    if op == "candidate_blocks":
        score, n_vis, *rest = args_s
        T, N = score.shape
        return (_scores(rng, T, N, L, score.dtype), jnp.asarray(_n_visible(T, L, N), n_vis.dtype), *rest), kwargs_s
    if op == "topk_positions":
        score, *rest = args_s
        T, N = score.shape
        return (_scores(rng, T, N, L, score.dtype), *rest), kwargs_s
    if op == "sinkhorn_iterate":
        comb, *rest = args_s
        return (jnp.asarray(rng.random(comb.shape) + 0.05, comb.dtype), *rest), kwargs_s
    if op == "moe_experts":
        x, idx, wt, w1, w2, w3, fmt, limit, n_exp = args_s
        T, X = idx.shape
        ids = np.argsort(rng.random((T, n_exp)), axis=1)[:, :X]
        g = rng.random((T, X)).astype(np.float32)
        g = g / g.sum(1, keepdims=True)

        def ws(w):
            return tuple(generic(a) if a is None or jnp.issubdtype(a.dtype, jnp.floating)
                         else jnp.asarray(rng.integers(0, 255, a.shape), a.dtype) for a in w)

        return (_randn(rng, x), jnp.asarray(ids, idx.dtype), jnp.asarray(g, wt.dtype), ws(w1), ws(w2), ws(w3),
                fmt, limit, n_exp), kwargs_s
    return jax.tree.map(generic, (args_s, kwargs_s), is_leaf=lambda x: isinstance(x, SDS))


# ----------------------------------------------------------------------------- timing
def _block(x):
    import jax

    jax.block_until_ready(x)
    return x


def time_fn(fn, inputs, reps: int):
    """``(compile+first run s, median s)`` of jitted ``fn(*inputs)``."""
    t0 = time.perf_counter()
    _block(fn(*inputs))
    first = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _block(fn(*inputs))
        ts.append(time.perf_counter() - t0)
    return first, statistics.median(ts)


def split_float(tree):
    """``(float leaves, rebuild(float leaves) -> tree)``: the differentiable inputs of a call."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(tree)
    fl_pos = [i for i, x in enumerate(leaves) if _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)]
    arr_pos = [i for i, x in enumerate(leaves) if _is_array(x) and i not in fl_pos]

    def rebuild(fl, other):
        out = list(leaves)
        for i, v in zip(fl_pos, fl):
            out[i] = v
        for i, v in zip(arr_pos, other):
            out[i] = v
        return jax.tree.unflatten(treedef, out)

    return [leaves[i] for i in fl_pos], [leaves[i] for i in arr_pos], rebuild


def fwd_bwd_fns(f, tree):
    """Jitted ``fwd(fl, other)`` and ``fwd+bwd(fl, other)`` of ``f(tree)`` over its array leaves
    (non-array leaves are static); bwd is None when the output is not float."""
    import jax
    import jax.numpy as jnp

    fl, other, rebuild = split_float(tree)
    fwd = jax.jit(lambda fl, other: f(rebuild(fl, other)))
    out = jax.eval_shape(fwd, fl, other)
    outs = jax.tree.leaves(out)
    if not fl or not all(jnp.issubdtype(o.dtype, jnp.floating) for o in outs):
        return fwd, None, (fl, other)

    def loss(fl, other):
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(f(rebuild(fl, other))))

    return fwd, jax.jit(jax.grad(loss)), (fl, other)


# ----------------------------------------------------------------------------- main
def _label(c: OpCall, cfg) -> str:
    extra = ""
    if c.layers:
        ratios = sorted({cfg.compress_ratios[l] for l in c.layers if l < len(cfg.compress_ratios)})
        extra = f" L{','.join(map(str, sorted(c.layers)))}"
        if c.op == "sparse_attention" and ratios:
            extra = f" r{'/'.join(map(str, ratios))}" + extra
    return c.op + extra


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v41-small", help="training config (training/presets.py)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5, help="timed train steps after the compiling one")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per op after its compile")
    ap.add_argument("--skip-step", action="store_true", help="per-op rows only")
    ap.add_argument("--budget-s", type=float, default=180.0, help="no new row starts after this many seconds")
    ap.add_argument("--step-reserve-s", type=float, default=None,
                    help="seconds of the budget kept for the whole step (default 100 on GPU, 30 on CPU)")
    ap.add_argument("--gather-step", action="store_true",
                    help="also time the step on the general (gather) references, full_rows=False, if the budget allows")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train_step_<device>.json)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    import deepinfer_jax  # noqa: F401  (first: it sets the XLA numerics flags before a backend starts)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.kernels_pallas import ops
    from deepinfer_jax.training.indexer_loss import indexer_kl
    from deepinfer_jax.training.loss import next_token_loss
    from deepinfer_jax.training.presets import train_config

    elapsed = lambda: time.perf_counter() - t_start  # noqa: E731
    device = jax.devices()[0].device_kind
    cfg = train_config(args.preset)
    B, L = args.batch, args.seq_len
    reserve = args.step_reserve_s if args.step_reserve_s is not None else (100.0 if jax.default_backend() == "gpu" else 30.0)
    op_budget = args.budget_s - (0.0 if args.skip_step else reserve)
    out = args.out or os.path.join("benchmarks", "results", f"train_step_{device.replace(' ', '_')}.json")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device, "platform": jax.default_backend(), "jax": jax.__version__,
              "preset": args.preset, "batch": B, "seq_len": L, "tokens_per_step": B * L,
              "ops": [], "step": None, "summary": None, "complete": False}

    def write():
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    log(f"== bench_train_step: {args.preset} B={B} L={L} on {device} ({jax.default_backend()}), jax {jax.__version__}")
    t0 = time.perf_counter()
    calls, extras = record_forward(cfg, B, L)
    result["trace_s"] = round(time.perf_counter() - t0, 2)
    log(f"traced the forward in {result['trace_s']:.1f}s: {len(calls)} op signatures, "
        f"{sum(c.calls for c in calls)} op calls")
    hdr = f"{'row':<44} {'calls':>5} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x calls ms':>11} {'compile s':>9}  shapes"
    log(hdr)
    log("-" * len(hdr))

    def add_row(name, n_calls, f, tree, shapes, in_sum=True):
        if elapsed() > op_budget:
            log(f"{name:<44} skipped: the op phase's budget ({op_budget:.0f}s) is spent")
            result["ops"].append({"name": name, "calls": n_calls, "skipped": "budget", "shapes": shapes,
                                  "in_sum": in_sum})
            write()
            return
        row = {"name": name, "calls": n_calls, "shapes": shapes, "in_sum": in_sum}
        try:
            fwd, fb, inputs = fwd_bwd_fns(f, tree)
            c1, t_f = time_fn(fwd, inputs, args.reps)
            row.update(fwd_ms=t_f * 1e3, compile_s=c1 - t_f)
            if fb is not None:
                c2, t_fb = time_fn(fb, inputs, args.reps)
                row.update(fwd_bwd_ms=t_fb * 1e3, compile_s=row["compile_s"] + c2 - t_fb)
            else:
                row.update(fwd_bwd_ms=t_f * 1e3, no_bwd=True)
            row["per_step_ms"] = row["fwd_bwd_ms"] * n_calls
            fb_s = f"{row['fwd_bwd_ms']:11.3f}" if fb is not None else f"{'(no bwd)':>11}"
            log(f"{name:<44} {n_calls:5d} {row['fwd_ms']:9.3f} {fb_s} {row['per_step_ms']:11.3f} "
                f"{row['compile_s']:9.2f}  {shapes}")
        except Exception as e:  # one op failing must not hide the others' numbers
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"{name:<44} failed: {row['error'][:300]}")
        result["ops"].append(row)
        write()

    order = {n: i for i, n in enumerate(("sparse_attention", "indexer_scores_pool", "indexer_scores",
                                         "candidate_blocks", "topk_positions", "moe_experts", "sinkhorn_iterate"))}
    calls.sort(key=lambda c: (order.get(c.op, 99), min(c.layers) if c.layers else 99))
    for i, c in enumerate(calls):
        ref_fn = getattr(ops, c.op)

        def f(tree, ref_fn=ref_fn):
            a, kw = tree
            with ops.use_backend("reference"):
                return ref_fn(*a, **kw)

        tree = synth_args(c, L, seed=i)
        rows_form = c.op in ("sparse_attention", "indexer_scores_pool")  # the training forward's per-row forms
        # the LM head is an f32_matmul call too; its row below times it with the cross-entropy
        is_head = c.op == "f32_matmul" and tuple(c.leaves[1].shape) == tuple(extras["head"]["w"].shape)[::-1]
        # the sum counts the form the step runs (full rows, train_forward's default)
        add_row(_label(c, cfg) + (" (the LM head, in the row below)" if is_head else ""), c.calls, f, tree,
                c.describe(), in_sum=not (rows_form or is_head))
        if rows_form:

            def f_rows(tree, ref_fn=ref_fn):
                a, kw = tree
                with ops.use_backend("reference"), ops.full_rows(B, L):
                    return ref_fn(*a, **kw)

            add_row(_label(c, cfg) + " (full rows)", c.calls, f_rows, tree, c.describe())

    # LM head (fp32 matmul at full precision, as layers/linear.py "f32") + cross-entropy
    rng = np.random.default_rng(123)
    toks = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, L)), jnp.int32)
    h, w = extras["head"]["h"], extras["head"]["w"]
    from deepinfer_jax.layers.linear import matmul_f32

    def head_ce(tree):
        hh, ww, tk = tree
        return next_token_loss(matmul_f32(hh, ww.T).reshape(B, L, -1), tk, cfg.pad_token_id)[0]

    add_row("lm_head(f32)+cross_entropy", 1, head_ce, (_randn(rng, h), _randn(rng, w, 0.05), toks),
            f"h {h.dtype}{list(h.shape)} W {w.dtype}{list(w.shape)}")
    lg = extras["logits"]
    add_row("cross_entropy", 1, lambda t: next_token_loss(t[0], t[1], cfg.pad_token_id)[0],
            (_randn(rng, jax.ShapeDtypeStruct((B, L, lg.shape[-1]), lg.dtype)), toks),
            f"logits {lg.dtype}[{B}, {L}, {lg.shape[-1]}] (part of the row above: not in the sum)", in_sum=False)
    # indexer KL: the taps it reads and the filled cache's compressed KV
    if extras["taps"]:
        taps_s, ckv_s = extras["taps"], extras["comp_kv"]

        def kl(tree):
            taps, ckv = tree
            return indexer_kl(cfg, taps, types.SimpleNamespace(comp_kv=list(ckv)), B, L)

        tree = ({k: _randn(rng, v) for k, v in taps_s.items()}, tuple(_randn(rng, c) for c in ckv_s))
        add_row("indexer_kl", 1, kl, tree, " ".join(f"{k}{list(v.shape)}" for k, v in sorted(taps_s.items())))

    done = [r for r in result["ops"] if "per_step_ms" in r and r["in_sum"]]
    op_sum = sum(r["per_step_ms"] for r in done)
    result["summary"] = {"op_sum_ms": op_sum, "rows_measured": len(done),
                         "rows_total": sum(r["in_sum"] for r in result["ops"])}
    log("-" * len(hdr))
    log(f"op sum (fwd+bwd x calls, {len(done)} rows measured of {sum(r['in_sum'] for r in result['ops'])}): "
        f"{op_sum:.2f} ms per step")
    write()

    if not args.skip_step:
        if elapsed() > args.budget_s:
            log(f"whole step skipped: budget {args.budget_s:.0f}s spent")
            result["step"] = {"skipped": "budget"}
        else:
            result["step"] = bench_step(cfg, B, L, args.steps)
            st = result["step"]
            if "median_ms" in st:
                frac = op_sum / st["median_ms"]
                result["summary"].update(step_ms=st["median_ms"], op_fraction=frac)
                log(f"op sum vs step: {op_sum:.2f} ms of {st['median_ms']:.2f} ms = {100 * frac:.1f}% explained "
                    f"by the rows above; {st['median_ms'] - op_sum:.2f} ms elsewhere (dense layers, mHC mixing, "
                    "quantization QDQ, compressor, Engram, gate, optimizer, ...)")
        if args.gather_step and elapsed() < args.budget_s:
            result["step_gather"] = g = bench_step(cfg, B, L, args.steps, full_rows=False)
            if "median_ms" in g and "median_ms" in (result["step"] or {}):
                log(f"full rows vs gather references: {result['step']['median_ms']:.1f} ms vs {g['median_ms']:.1f} ms "
                    f"per step ({g['median_ms'] / result['step']['median_ms']:.2f}x)")
    result["complete"] = True
    result["total_s"] = round(elapsed(), 1)
    write()
    log(f"wrote {out} ({result['total_s']:.0f}s)")
    return 0


def bench_step(cfg, B: int, L: int, steps: int, full_rows: bool = True) -> dict:
    """The whole jitted train step on random tokens: compile (first call minus a step), median."""
    import numpy as np

    from deepinfer_jax.training.init import init_model
    from deepinfer_jax.training.optimizer import OptimConfig
    from deepinfer_jax.training.step import Trainer

    res = {}
    try:
        t0 = time.perf_counter()
        trainer = Trainer(init_model(cfg, 0), OptimConfig(warmup_steps=1, total_steps=1000), full_rows=full_rows)
        state = trainer.init_state()
        rng = np.random.default_rng(0)
        toks = rng.integers(3, cfg.vocab_size, (B, L)).astype(np.int32)
        eids = None
        if cfg.engram_enabled:
            from deepinfer_jax.runner.engram_hash import EngramHasher

            hasher = EngramHasher.from_model_config(cfg, None)
            eids = np.stack([hasher.hash_positions(t, np.arange(L)) for t in toks])
        res["setup_s"] = time.perf_counter() - t0
        log(f"whole step (full_rows={full_rows}): model + optimizer set up in {res['setup_s']:.1f}s; compiling ...")
        t0 = time.perf_counter()
        state, m = trainer.step(state, toks, eids)
        first = time.perf_counter() - t0
        ts = []
        for i in range(steps):
            t0 = time.perf_counter()
            state, m = trainer.step(state, toks, eids)
            ts.append(time.perf_counter() - t0)
            log(f"  step {i + 1}: {ts[-1] * 1e3:.1f} ms (loss {m['loss']:.3f})")
        med = statistics.median(ts) if ts else first
        res.update(compile_s=first - (med if ts else 0.0), first_call_s=first, median_ms=med * 1e3,
                   step_ms=[t * 1e3 for t in ts], tokens_per_s=B * L / med, loss=m["loss"])
        log(f"whole step: compile {res['compile_s']:.1f}s, median {res['median_ms']:.1f} ms over {len(ts)} steps, "
            f"{res['tokens_per_s']:,.0f} tokens/s")
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"whole step failed: {res['error'][:500]}")
    return res


if __name__ == "__main__":
    sys.exit(main())
