"""Where a jitted step's device time goes, from a ``jax.profiler`` trace: kernel time per
family, the busiest kernels, and the time the device sat idle inside the traced steps.

``profile_steps(run, n, logdir)`` traces ``n`` calls of ``run()`` dispatched back to back and
reads the trace back with ``jax.profiler.ProfileData``. Kernels are the events of the
GPU planes (``/device:GPU:*``); on a CPU, the XLA thunks of the host plane (events with an
``hlo_op``), so the code path runs anywhere, though only the GPU's numbers mean much.

Families (first rule that matches the kernel name or its HLO op, lower case):

  ours: Pallas kernels     mhc_sinkhorn, sparse_attn, indexer_, mosaic (the MoE kernel)
  GEMM (library)           gemm, cublas, cutlass, xmma, sm90_, nvjet
  convert fusions          convert (dequantised weights written to HBM)
  other fusions            fusion
  copies                   memcpy, memset, copy
  other                    anything else

``trace_engine_decode(engine, prompts, sp, n)`` runs an engine until its steps are decode only
and traces the next ``n`` (``bench_offline.py --trace-idle``, ``bench_spec.py --trace-steps``,
``kernel_census.py --trace-steps``).

``idle_fraction``: the traced span (first kernel start to last kernel end) less the union of the
kernel intervals, over the span: with the steps queued ahead, the device waiting on launches.
"""

from __future__ import annotations

import glob
import os
import tempfile

FAMILIES = (
    ("ours: Pallas kernels", ("mhc_sinkhorn", "sparse_attn", "indexer_", "mosaic")),
    ("GEMM (library)", ("gemm", "cublas", "cutlass", "xmma", "sm90_", "nvjet")),
    ("convert fusions", ("convert",)),
    ("other fusions", ("fusion",)),
    ("copies", ("memcpy", "memset", "copy")),
)


def family(name: str, hlo_op: str = "") -> str:
    text = f"{name} {hlo_op}".lower()
    for fam, keys in FAMILIES:
        if any(k in text for k in keys):
            return fam
    return "other"


def kernel_events(xplane_path: str) -> list[tuple[str, str, int, int]]:
    """``(name, hlo_op, start_ns, duration_ns)`` of every kernel in the trace."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(xplane_path)
    gpu = [p for p in pd.planes if p.name.startswith("/device:GPU")]
    out = []
    for plane in gpu or [p for p in pd.planes if p.name.startswith("/host:CPU")]:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if not gpu and "hlo_op" not in stats:
                    continue  # host plane: only XLA's thunks are the CPU's "kernels"
                out.append((e.name, str(stats.get("hlo_op", "")), int(e.start_ns), int(e.duration_ns)))
    return out


def _union_ns(intervals) -> int:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def breakdown(events, steps: int, top: int = 15) -> dict:
    """Per-step milliseconds per family and of the ``top`` kernels, busy and idle time."""
    if not events:
        return dict(steps=steps, kernels=0, families={}, top_kernels=[], busy_ms=0.0, span_ms=0.0, idle_fraction=None)
    fam: dict[str, float] = {}
    per_kernel: dict[str, list] = {}
    for name, op, _, dur in events:
        f = family(name, op)
        fam[f] = fam.get(f, 0.0) + dur
        k = per_kernel.setdefault(name, [0.0, 0, f])
        k[0] += dur
        k[1] += 1
    intervals = [(s, s + d) for _, _, s, d in events]
    busy = _union_ns(intervals)
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    ms = 1e-6 / steps
    tops = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(steps=steps, kernels=len(events) // max(steps, 1),
                families={f: t * ms for f, t in sorted(fam.items(), key=lambda kv: -kv[1])},
                top_kernels=[dict(name=n[:120], family=f, ms=t * ms, calls=c // max(steps, 1))
                             for n, (t, c, f) in tops],
                busy_ms=busy * ms, span_ms=span * ms, idle_fraction=1.0 - busy / span if span else None)


def profile_steps(run, steps: int = 5, logdir: str | None = None) -> dict:
    """Trace ``steps`` calls of ``run()`` dispatched back to back (``run`` returns without
    waiting; the last result is waited for), and return ``breakdown`` of their kernels. With the
    host ahead of the device, the idle time left is the device's own (launch gaps inside and
    between steps), not the host's think time."""
    import jax

    logdir = logdir or tempfile.mkdtemp(prefix="step_profile_")
    with jax.profiler.trace(logdir):
        last = None
        for _ in range(steps):
            last = run()
        jax.block_until_ready(last)
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no trace under {logdir}")
    out = breakdown(kernel_events(paths[-1]), steps)
    out["trace"] = paths[-1]
    return out


def trace_engine_decode(engine, prompts, sp, steps: int, prefix: str = "trace",
                        on_trace=None) -> tuple[list, list]:
    """Add ``prompts`` to ``engine`` and run it; once a processed step had no prompt token and
    nothing waits, call ``on_trace()`` (if given) and trace the next ``steps`` steps with
    ``jax.profiler`` (fewer where the requests finish first); the rest of the run finishes
    untraced. Returns ``(kernel_events of the trace, the traced steps' StepStats)``."""
    import jax

    engine.add_requests([(f"{prefix}{i}", p, sp) for i, p in enumerate(prompts)])
    while engine.has_unfinished_requests():
        engine.step()
        last = engine.stats.steps[-1] if engine.stats.steps else None
        if last is not None and last.num_prefill_tokens == 0 and not engine.scheduler.waiting:
            break
    logdir = tempfile.mkdtemp(prefix=f"{prefix}_")
    # no step on the device as the trace starts and none left after it: the traced steps are
    # exactly those dispatched inside it (with async scheduling a step's results are applied a
    # step later, so without this the count would include one step run before the trace)
    engine.flush()
    first = len(engine.stats.steps)
    if on_trace is not None:
        on_trace()
    with jax.profiler.trace(logdir):
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        engine.flush()  # (its fetch waits for the last step's executable)
    traced = engine.stats.steps[first:]
    while engine.has_unfinished_requests():
        engine.step()
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    return (kernel_events(paths[-1]) if paths and traced else []), traced
