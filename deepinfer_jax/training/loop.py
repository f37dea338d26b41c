"""The training loop: resume from ``out_dir`` when asked, run up to ``steps`` optimizer steps (a
total, so repeated calls continue one run), save every ``save_every`` steps and at the end (also
when a wall-clock budget runs out), print the loss on a progress bar and append one JSON line
per step to ``metrics.jsonl``. With Engram layers, ``engram_ids_fn(tokens_BL) -> [B, L,
n_engram_layers, n_hash_cols]`` gives each batch's hash ids (the caller's host hasher: training
does not import ``runner/``). ``prefix`` names the run's files (``<prefix>state.npz``,
``<prefix>meta.json``, ``<prefix>metrics.jsonl``); any trainer with ``cfg``, ``init_state()`` and
``step(state, tokens, engram_ids)`` runs here (``Trainer``, ``DSparkTrainer``)."""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import numpy as np

from deepinfer_jax.training import state_io
from deepinfer_jax.training.step import Trainer, TrainState


PROBE_STEPS = 20  # timed steps (after the compiling one) that size an ``auto`` run


def run(trainer: Trainer, batches, steps: int | None, out_dir: str | os.PathLike, meta: dict, resume: bool = True,
        save_every: int = 50, time_budget_s: float | None = None, progress: bool = True,
        engram_ids_fn: Callable[[np.ndarray], np.ndarray] | None = None,
        train_seconds: float | None = None, prefix: str = "") -> TrainState:
    """``steps=None`` (``train.py --steps auto``): the run's length is set after
    ``PROBE_STEPS`` timed steps so that the whole run takes about ``train_seconds`` of stepping
    (over all calls); it is recorded in ``meta.json`` as ``total_steps`` and a resumed run reads it
    from there. ``prefix``: the state / meta / metrics file names' prefix (a DSpark run beside its
    backbone run)."""
    if trainer.cfg.engram_enabled and engram_ids_fn is None:
        raise ValueError(f"engram_ids_fn: required, the config has Engram layers engram_layer_ids="
                         f"{tuple(trainer.cfg.engram_layer_ids)} (pass tokens_BL -> the host hasher's ids)")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    state = trainer.init_state()
    if resume and state_io.has_state(out_dir, prefix):
        saved = state_io.load_meta(out_dir, prefix)
        for k in ("config", "optim", "batch", "seq_len", "data_seed", "anchors", "anchor_seed", "dspark_loss",
                  "repeat_tail"):
            if k in meta and saved.get(k) != meta[k]:
                raise ValueError(f"resume from {out_dir}: {k}={saved.get(k)!r} there, {meta[k]!r} now")
        state = state_io.load_state(out_dir, state, prefix)
        if steps is None:
            steps = saved.get("total_steps")
    if steps is None and not train_seconds:
        raise ValueError("steps=None (auto) needs train_seconds > 0")
    meta = dict(meta)
    if steps is not None:
        meta["total_steps"] = steps  # kept by every save, also a resumed call that takes no step
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=state.step, unit="step", desc=prefix + "train")
    t0 = time.monotonic()
    probe_t, probe_from = None, state.step + 3
    try:
        with open(os.path.join(out_dir, prefix + "metrics.jsonl"), "a") as log:
            while steps is None or state.step < steps:
                t = time.monotonic()
                if steps is None and state.step == probe_from:
                    probe_t = t
                if steps is None and state.step == probe_from + PROBE_STEPS:
                    per = (t - probe_t) / PROBE_STEPS
                    steps = max(state.step + 1, int((train_seconds - (t - t0)) / per) + state.step)
                    print(f"auto: {per * 1e3:.1f} ms/step -> total_steps={steps}", flush=True)
                    if bar is not None:
                        bar.total = steps
                        bar.refresh()
                if steps is not None:
                    meta["total_steps"] = steps
                toks = batches(state.step)
                eids = None if engram_ids_fn is None else engram_ids_fn(toks)
                state, m = trainer.step(state, toks, eids, total_steps=steps if steps is not None else 10 ** 9)
                m = {"step": state.step, **m, "step_s": round(time.monotonic() - t, 4)}
                log.write(json.dumps(m) + "\n")
                log.flush()
                if bar is not None:
                    bar.update(1)
                    extra = {"tau": f"{m['tau_prob']:.3f}"} if "tau_prob" in m else {}
                    bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}", **extra)
                if state.step % save_every == 0:
                    state_io.save_state(out_dir, state, meta, prefix)
                if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
                    break
    finally:
        if bar is not None:
            bar.close()
    state_io.save_state(out_dir, state, meta, prefix)
    return state
