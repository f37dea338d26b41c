"""Training data for the DSpark stages written by the target model itself: prompts cut from the
training split, each continued by the model (greedy, or sampled at a temperature), stored as
fixed-length sequences ``[prompt | continuation]``.

Why: at serving time the stages draft what the *target* will generate, in contexts that the
target generated. Teacher forcing on human text trains them on other contexts (the data's next
tokens, where the target would often have chosen differently). On the target's own greedy
continuations the data's next token is the target's argmax, so the stages' objective and the
greedy acceptance test are the same thing (the usual practice for draft models: EAGLE, SpecForge's
"regenerate datasets").

``prompt_windows`` cuts prompts from documents; ``continue_prompts`` runs the model with
``SequenceDriver`` (many prompts as slots of one padded step, one compile).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.runner.sequence_driver import SequenceDriver
from deepinfer_jax.runner.spec_acceptance import acceptance_cache_config

__all__ = ["prompt_windows", "continue_prompts"]


def prompt_windows(documents: Sequence[np.ndarray], n: int, length: int, seed: int = 0) -> np.ndarray:
    """int32 ``[n, length]``: windows of ``length`` tokens at seeded offsets inside documents of
    at least ``length`` tokens (documents drawn in proportion to their number of windows, so long
    files are not over-represented per token)."""
    if n < 1 or length < 1:
        raise ValueError(f"prompt_windows: n={n} and length={length} must be >= 1")
    lens = np.asarray([len(d) for d in documents], np.int64)
    room = np.maximum(lens - length + 1, 0)
    if room.sum() == 0:
        raise ValueError(f"prompt_windows: no document has {length} tokens (longest {lens.max(initial=0)})")
    rng = np.random.default_rng(seed)
    docs = rng.choice(len(documents), size=n, p=room / room.sum())
    offs = (rng.random(n) * room[docs]).astype(np.int64)
    return np.stack([np.asarray(documents[d][o:o + length], np.int32) for d, o in zip(docs, offs)])


def _choose(logits_RV: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    if temperature <= 0:
        return np.argmax(logits_RV, axis=-1)
    z = logits_RV.astype(np.float64) / temperature
    z -= z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    c = np.cumsum(p, axis=-1)
    u = rng.random(len(c))[:, None] * c[:, -1:]
    return np.minimum((c <= u).sum(axis=-1), logits_RV.shape[-1] - 1)


def continue_prompts(model, prompts_NP: np.ndarray, new_tokens: int, batch_size: int = 256,
                     temperature: float = 0.0, seed: int = 0, hasher: EngramHasher | None = None,
                     prefill_rows: int = 16, banned_ids: Sequence[int] = (),
                     progress: Callable[[int], None] | None = None) -> np.ndarray:
    """int32 ``[N, P + new_tokens]``: each prompt followed by ``new_tokens`` tokens the model
    chose (argmax at ``temperature == 0``, else sampled from softmax(logits / T), seeded).
    ``banned_ids`` never appear in a continuation (e.g. the DSpark noise id); an ``<eos>`` does
    not stop a row (the sequences keep one length; a continuation past the end of a file is
    still the model's behaviour). ``batch_size`` prompts share one step; every step has one
    padded shape (prefill: ``prefill_rows`` prompts per step)."""
    prompts_NP = np.asarray(prompts_NP)
    if prompts_NP.ndim != 2 or prompts_NP.shape[1] < 1:
        raise ValueError(f"continue_prompts: prompts must be [N, P] with P >= 1, got {prompts_NP.shape}")
    if new_tokens < 1:
        raise ValueError(f"continue_prompts: new_tokens={new_tokens} must be >= 1")
    N, P = prompts_NP.shape
    cfg = model.cfg
    if cfg.engram_enabled and hasher is None:
        hasher = EngramHasher.from_model_config(cfg)
    rng = np.random.default_rng(seed)
    R = min(batch_size, N)
    prefill_rows = max(1, min(prefill_rows, R))
    cc = acceptance_cache_config(cfg, R, P + new_tokens)
    out = np.zeros((N, P + new_tokens), np.int32)
    out[:, :P] = prompts_NP
    ban = np.asarray(sorted(set(int(b) for b in banned_ids)), np.int64)
    for g0 in range(0, N, R):
        rows = list(range(g0, min(g0 + R, N)))
        drv = SequenceDriver(model, cc, hasher)
        last = np.zeros((len(rows), cfg.vocab_size), np.float32)
        for c0 in range(0, len(rows), prefill_rows):
            part = rows[c0:c0 + prefill_rows]
            lg, _, _ = drv.step([(s - g0, prompts_NP[s].tolist()) for s in part], logits="last",
                                num_tokens=prefill_rows * P, num_rows=prefill_rows)
            last[c0:c0 + len(part)] = lg[:len(part)]
        for t in range(new_tokens):
            if len(ban):
                last[:, ban] = -np.inf
            tok = _choose(last, temperature, rng)
            out[rows, P + t] = tok
            if progress:
                progress(len(rows))
            if t + 1 == new_tokens:
                break
            last = np.array(drv.decode_step([s - g0 for s in rows], tok, num_rows=R)[:len(rows)])
    return out
