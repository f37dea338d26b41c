#!/usr/bin/env python3
"""DSpark throughput simulator: no speculation vs fixed verification lengths vs varlen.

    python scripts/dspark_sim.py benchmarks/results/v41_small_code_H200/dspark_acceptance.json.gz
    python scripts/dspark_sim.py TRACE --sps CURVE.json          # (tokens, step seconds) points
    python scripts/dspark_sim.py TRACE --sps-linear 11.19 0.02008  # fixed ms + per-token ms

Trace: the JSON of ``scripts/eval/dspark_acceptance.py``: per temperature (``results[i]``),
``pred_cum`` [verifications, K] = predicted cumulative acceptance prod_{i<=k} sigmoid(conf_i) and
``obs_cum`` [verifications, K] = 1 where drafts 1..k were all accepted.  A file that carries only
the summary (``accepted_hist``, ``mean_pred_cum``; the per-verification arrays are not in
``AcceptanceReport.summary()``) is simulated in SUMMARY mode: the observed accepted counts are
the histogram's verifications exactly, and every row's prediction is the mean prediction
(``--summary-pred pred``: ``mean_pred_cum``; ``obs``: ``mean_obs_cum``, a calibrated mean).  The
confidences then carry no per-row information, so varlen can only pick a length per step
from the count of rows; the mode is printed and stored in the JSON.

Simulation: a step of R sequences (per rank) samples R verification events from the trace (with
replacement; the same events for every strategy).  A strategy gives each row a verification
length l_r in 0..K; the step runs B = R + sum(l_r) tokens in ``seconds(B)`` (the SPS curve,
interpolated piecewise linearly, extrapolated linearly) and emits sum(1 + min(A_r, l_r)) tokens,
A_r the observed accepted drafts of the event.  Strategies: ``none`` (l = 0), ``fixed-L``
(L = 1..K), ``varlen`` (``plan_varlen`` on the event's ``pred_cum``), ``varlen-async``
(``plan_varlen_async``: budget from the step two earlier, split by the current ``pred_cum``),
``varlen+plain`` (varlen, and plain steps where verification does not pay: the engine's
``spec_switch.DraftSwitch`` on ``AcceptanceRates`` of the simulated verifications; a plain step
has no drafts for the step after it). ``--verify-overhead-ms X`` adds X ms to every verification
step, drafts or not (the K + 1 logits rows per row, the undo log and the drafting that a plain
step does not do; 0 by default, where a verification step with no drafts costs what a plain
step does). Throughput = emitted tokens / simulated seconds, per rank.

Writes ``--out-dir``/dspark_sim_<trace>_<curve>.json and .png (matplotlib, imported lazily).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deepinfer_jax.host_scheduler.spec_switch import AcceptanceRates, DraftSwitch  # noqa: E402
from deepinfer_jax.host_scheduler.spec_varlen import (  # noqa: E402
    ForwardRuntimeEstimator,
    plan_varlen,
    plan_varlen_async,
)

DEFAULT_CURVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "sps_curves",
                             "modelled_linear_e2e_H200.json")
DEEPSEEK_NOTE = ("DeepSeek's reported comparison points (their model and hardware; NOT reproduced here): "
                 "varlen vs fixed verification length 5: mean verification length 5 -> 3.58, mean acceptance "
                 "3.30 -> 3.21, throughput +5.4% at 60 sequences/rank, +11% at 96, a loss at 16.")


# ----------------------------------------------------------------------------- inputs


def load_trace(path: str, summary_pred: str = "pred") -> list[dict]:
    """One entry per temperature: ``temperature``, ``pred_cum`` [N, K], ``accepted`` [N], ``mode``."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        d = json.load(f)
    results = d["results"] if isinstance(d, dict) and "results" in d else d
    out = []
    for res in results:
        if "pred_cum" in res and "obs_cum" in res:
            pred = np.asarray(res["pred_cum"], dtype=np.float64)
            obs = np.asarray(res["obs_cum"], dtype=np.float64)
            if pred.shape != obs.shape or pred.ndim != 2:
                raise SystemExit(f"{path}: pred_cum {pred.shape} and obs_cum {obs.shape} must be one [N, K] shape")
            accepted = np.cumprod(obs > 0.5, axis=1).sum(axis=1)  # leading accepted drafts
            mode = "per-verification"
        elif "accepted_hist" in res and "mean_pred_cum" in res:
            hist = np.asarray(res["accepted_hist"], dtype=np.int64)
            accepted = np.repeat(np.arange(len(hist)), hist)
            mean = res["mean_pred_cum"] if summary_pred == "pred" else res["mean_obs_cum"]
            pred = np.tile(np.asarray(mean, dtype=np.float64), (len(accepted), 1))
            mode = f"summary (every row predicts mean_{summary_pred}_cum)"
        else:
            raise SystemExit(f"{path}: a result has neither pred_cum/obs_cum nor accepted_hist/mean_pred_cum")
        if len(accepted) == 0:
            continue
        out.append(dict(temperature=res.get("temperature"), pred_cum=pred, accepted=accepted, mode=mode))
    if not out:
        raise SystemExit(f"{path}: no verifications")
    return out


def load_curve(args) -> tuple[ForwardRuntimeEstimator, str, dict]:
    if args.sps_linear is not None:
        fixed, per = args.sps_linear
        pts = [(1, (fixed + per) / 1e3), (2, (fixed + 2 * per) / 1e3)]
        name = f"linear_{fixed:g}ms_{per:g}ms"
        meta = dict(kind="linear", fixed_ms=fixed, per_token_ms=per, modelled=True)
    else:
        path = args.sps or DEFAULT_CURVE
        with open(path) as f:
            c = json.load(f)
        pts = c["points"] if isinstance(c, dict) else c
        name = os.path.splitext(os.path.basename(path))[0]
        meta = dict(kind="file", path=os.path.relpath(path), **({k: v for k, v in c.items() if k != "points"}
                                                                 if isinstance(c, dict) else {}))
    return ForwardRuntimeEstimator([(float(b), float(s)) for b, s in pts]), name, meta


# ----------------------------------------------------------------------------- the simulation


def simulate(trace: dict, curve: ForwardRuntimeEstimator, seqs: int, steps: int, rng,
             verify_overhead_s: float = 0.0) -> dict:
    """Throughput of every strategy at ``seqs`` rows per step; returns {strategy: stats}.
    ``verify_overhead_s``: what a verification step costs beyond a plain step of its tokens."""
    pred, acc = trace["pred_cum"], trace["accepted"]
    K = pred.shape[1]
    strategies = ["none"] + [f"fixed-{L}" for L in range(1, K + 1)] + ["varlen", "varlen-async", "varlen+plain"]
    tot = {s: dict(tokens=0.0, seconds=0.0, verified=0.0, accepted=0.0, plain=0) for s in strategies}
    history = []  # pred_cum of earlier steps (for the async budget)
    ovh = verify_overhead_s

    def sps(B):  # a verification step's rate
        return 1.0 / (curve.seconds(B) + ovh)

    switch, rates, drafted = DraftSwitch(), AcceptanceRates(K), True
    for _ in range(steps):
        idx = rng.integers(0, len(acc), size=seqs)
        p, a = pred[idx], acc[idx]
        history.append(p)
        for s in strategies:
            plain = s == "none"
            if s == "none":
                lengths = np.zeros(seqs, dtype=np.int64)
            elif s.startswith("fixed-"):
                lengths = np.full(seqs, int(s.split("-")[1]), dtype=np.int64)
            elif s == "varlen":
                lengths = plan_varlen(p, sps, cumulative=True)
            elif s == "varlen-async":
                old = history[-3] if len(history) >= 3 else p  # two steps back (the first steps: current)
                lengths = plan_varlen_async(p, old, sps, cumulative=True)
            else:  # varlen+plain: the engine's choice (host_scheduler/spec_switch.py)
                conf = p if drafted else np.tile(np.cumprod(rates.rates()), (seqs, 1))
                lengths = plan_varlen(conf, sps, cumulative=True)
                verified = np.arange(K)[None, :] < lengths[:, None]
                theta_spec = (seqs + float((conf * verified).sum())) * sps(seqs + int(lengths.sum()))
                plain = switch.choose(seqs, drafted, theta_spec, seqs / curve.seconds(seqs))
                if plain or not drafted:
                    lengths = np.zeros(seqs, dtype=np.int64)  # plain, or drafting with nothing to verify
                drafted = not plain
            got = np.minimum(a, lengths)
            if s == "varlen+plain":
                for n, g in zip(lengths.tolist(), got.tolist()):
                    rates.observe(n, g)
            t = tot[s]
            t["tokens"] += float((1 + got).sum())
            t["seconds"] += curve.seconds(seqs + int(lengths.sum())) + (0.0 if plain else ovh)
            t["verified"] += float(lengths.sum())
            t["accepted"] += float(got.sum())
            t["plain"] += int(plain and s != "none")
        if len(history) > 3:
            history.pop(0)
    base = tot["none"]["tokens"] / tot["none"]["seconds"]
    out = {}
    for s, t in tot.items():
        n = steps * seqs
        tps = t["tokens"] / t["seconds"]
        out[s] = dict(tokens_per_s=tps, vs_none=tps / base, mean_verify_len=t["verified"] / n,
                      mean_accepted=t["accepted"] / n, step_ms=1e3 * t["seconds"] / steps,
                      plain_steps=t["plain"] / steps)
    best_fixed = max((s for s in strategies if s.startswith("fixed-")), key=lambda s: out[s]["tokens_per_s"])
    for s in ("varlen", "varlen-async", "varlen+plain"):
        out[s]["vs_fixed_max"] = out[s]["tokens_per_s"] / out[f"fixed-{K}"]["tokens_per_s"]
        out[s]["vs_best_fixed"] = out[s]["tokens_per_s"] / out[best_fixed]["tokens_per_s"]
    out["_best_fixed"] = best_fixed
    return out


def run(trace_path, curve, seqs_list, steps, seed, summary_pred="pred", verify_overhead_s: float = 0.0) -> dict:
    traces = load_trace(trace_path, summary_pred)
    rows = []
    for tr in traces:
        for seqs in seqs_list:
            rng = np.random.default_rng([seed, seqs])
            res = simulate(tr, curve, seqs, steps, rng, verify_overhead_s)
            rows.append(dict(temperature=tr["temperature"], seqs_per_rank=seqs, mode=tr["mode"],
                             verifications=int(len(tr["accepted"])), best_fixed=res.pop("_best_fixed"),
                             strategies=res))
    return dict(rows=rows)


def format_table(rows) -> str:
    strategies = list(rows[0]["strategies"])
    head = f"{'temp':>5} {'seqs':>5} " + " ".join(f"{s:>12}" for s in strategies)
    lines = ["tokens/s per rank (and x vs none)", head]
    for r in rows:
        cells = " ".join(f"{r['strategies'][s]['tokens_per_s']:7.0f} x{r['strategies'][s]['vs_none']:.2f}"
                         for s in strategies)
        lines.append(f"{r['temperature']!s:>5} {r['seqs_per_rank']:>5} {cells}")
    lines.append("")
    lines.append(f"{'temp':>5} {'seqs':>5} {'best fixed':>10} {'varlen len':>10} {'varlen acc':>10} "
                 f"{'fixedK len':>10} {'fixedK acc':>10} {'varlen/fixedK':>13} {'varlen/best':>11} "
                 f"{'async/fixedK':>12} {'+plain/none':>11} {'plain share':>11}")
    K = max(int(s.split("-")[1]) for s in strategies if s.startswith("fixed-"))
    for r in rows:
        s = r["strategies"]
        lines.append(f"{r['temperature']!s:>5} {r['seqs_per_rank']:>5} {r['best_fixed']:>10} "
                     f"{s['varlen']['mean_verify_len']:10.2f} {s['varlen']['mean_accepted']:10.2f} "
                     f"{s[f'fixed-{K}']['mean_verify_len']:10.2f} {s[f'fixed-{K}']['mean_accepted']:10.2f} "
                     f"{s['varlen']['vs_fixed_max'] - 1:+12.1%} {s['varlen']['vs_best_fixed'] - 1:+10.1%} "
                     f"{s['varlen-async']['vs_fixed_max'] - 1:+11.1%} "
                     f"{s['varlen+plain']['vs_none']:11.2f} {s['varlen+plain']['plain_steps']:11.0%}")
    return "\n".join(lines)


def plot(result, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG written (pip install matplotlib)", file=sys.stderr)
        return False
    rows = result["rows"]
    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        rs = [r for r in rows if r["temperature"] == temp]
        seqs = [r["seqs_per_rank"] for r in rs]
        for s in rs[0]["strategies"]:
            style = (dict(lw=3) if s == "varlen" else dict(lw=1.5, ls=":", color="black") if s == "varlen-async"
                     else dict(lw=2, ls="-.", color="tab:red") if s == "varlen+plain"
                     else dict(lw=1, ls="--" if s == "none" else "-"))
            ax.plot(seqs, [r["strategies"][s]["vs_none"] for r in rs], marker="o", label=s, **style)
        ax.set_xscale("log")
        ax.set_xticks(seqs, [str(x) for x in seqs])
        ax.minorticks_off()
        ax.set_xlabel("sequences per rank")
        ax.set_ylabel("throughput vs no speculation")
        ax.set_title(f"temperature {temp} ({rs[0]['mode'].split(' ')[0]})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    curve = result["meta"]["curve"]
    fig.suptitle(f"DSpark simulation: {result['meta']['trace_name']}, SPS curve {result['meta']['curve_name']}"
                 + (" (MODELLED)" if curve.get("modelled") else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="acceptance JSON of scripts/eval/dspark_acceptance.py")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--sps", help=f"SPS curve JSON: {{'points': [[tokens, step seconds], ...]}} (default: "
                                 f"{os.path.relpath(DEFAULT_CURVE)}, MODELLED)")
    g.add_argument("--sps-linear", nargs=2, type=float, metavar=("FIXED_MS", "PER_TOKEN_MS"))
    ap.add_argument("--seqs", type=int, nargs="+", default=[16, 60, 96, 256], help="sequences per rank")
    ap.add_argument("--steps", type=int, default=400, help="simulated steps per point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify-overhead-ms", type=float, default=0.0,
                    help="what a verification step costs beyond a plain step of its tokens (ms)")
    ap.add_argument("--summary-pred", choices=["pred", "obs"], default="pred",
                    help="summary-only traces: every row predicts mean_pred_cum or mean_obs_cum")
    ap.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--name", help="output stem (default dspark_sim_<trace>_<curve>)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    curve, curve_name, curve_meta = load_curve(args)
    trace_dir = os.path.basename(os.path.dirname(os.path.abspath(args.trace)))
    trace_name = trace_dir or os.path.splitext(os.path.basename(args.trace))[0]
    if args.verify_overhead_ms < 0:
        ap.error(f"--verify-overhead-ms: {args.verify_overhead_ms} is negative")
    result = run(args.trace, curve, args.seqs, args.steps, args.seed, args.summary_pred, args.verify_overhead_ms / 1e3)
    result["meta"] = dict(trace=os.path.relpath(args.trace), trace_name=trace_name, curve_name=curve_name,
                          curve=curve_meta, steps=args.steps, seed=args.seed, seqs=args.seqs,
                          verify_overhead_ms=args.verify_overhead_ms,
                          summary_pred=args.summary_pred, deepseek_note=DEEPSEEK_NOTE)
    modes = sorted({r["mode"] for r in result["rows"]})
    print(f"trace {args.trace} ({'; '.join(modes)}), SPS curve {curve_name}"
          + (" (MODELLED, not measured)" if curve_meta.get("modelled") else ""))
    if any(m.startswith("summary") for m in modes):
        print("NOTE: the trace has no per-verification pred_cum/obs_cum; varlen sees no per-row confidence "
              "information here, only the mean prediction.")
    print(format_table(result["rows"]))
    print(DEEPSEEK_NOTE)
    stem = args.name or (f"dspark_sim_{trace_name}_{curve_name}"
                         + (f"_verify{args.verify_overhead_ms:g}ms" if args.verify_overhead_ms else ""))
    os.makedirs(args.out_dir, exist_ok=True)
    jpath = os.path.join(args.out_dir, stem + ".json")
    with open(jpath, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {jpath}")
    if not args.no_plot:
        ppath = os.path.join(args.out_dir, stem + ".png")
        if plot(result, ppath):
            print(f"wrote {ppath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
