"""DSpark speculative-decoding acceptance, measured outside the engine with real
draft -> verify -> commit loops on the model's own jitted forward (``SequenceDriver``).

One round for a sequence whose target has computed positions ``0..p`` and chose ``y`` for
``p+1``:

* **draft**: the DSpark stages propose ``d_1..d_blk`` for positions ``p+2..p+1+blk``
  (``blk = cfg.dspark_block_size``) plus confidence logits ``c_1..c_blk``
  (``sigmoid(c_i)`` = P(d_i accepted | d_1..d_{i-1} accepted)).
* **verify**: one target step on ``[y, d_1..d_blk]`` at positions ``p+1..p+1+blk`` with logits at
  every token; the logits at row ``i`` judge ``d_{i+1}``, the last row gives the bonus.
  Greedy (``temperature == 0``): accept while ``d_i`` is the target's argmax; the first mismatch
  is replaced by the argmax (correction); all accepted -> the argmax after ``d_blk`` (bonus).
  ``temperature > 0``: lossless rejection sampling against a point-mass draft: accept ``d_i``
  with probability ``p_i(d_i)``; on rejection sample from ``p_i`` without ``d_i``
  (renormalised); all accepted -> sample the bonus from ``p_{blk+1}``.
* **commit**: the cache copied before verification is restored and the target runs on the
  accepted tokens ``[y, d_1..d_a]`` (the next ``y`` is the correction/bonus); when every row of
  the step accepted everything, the verification cache already is that state and is kept.

The rollback is exact: JAX arrays are immutable, so the copy (``jax.tree.map(jnp.copy, cache)``,
needed because the step donates its cache) plus the driver's host bookkeeping (token history,
block tables, next free block) is the whole pre-verification state. At ``temperature == 0`` the
tokens generated this way are therefore the plain greedy continuation (tested).

Several prompts run as several slots of one step (``batch_size``); each step has a fixed padded
shape, so one compile serves every round.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.base.block_size import default_block_tokens
from deepinfer_jax.models.cache import CacheConfig
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.runner.sequence_driver import SequenceDriver

__all__ = ["AcceptanceReport", "measure_acceptance", "verify_block", "expected_calibration_error",
           "acceptance_cache_config"]


# ----------------------------------------------------------------------------- verification rule


def _softmax(logits_V: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits_V, np.float64) / temperature
    z = np.exp(z - z.max())
    return z / z.sum()


def _sample(p_V: np.ndarray, rng: np.random.Generator) -> int:
    c = np.cumsum(p_V)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p_V) - 1))


def verify_block(logits_KV: np.ndarray, drafts: Sequence[int], temperature: float = 0.0,
                 rng: np.random.Generator | None = None) -> tuple[int, int]:
    """Judge ``drafts`` (``blk`` tokens) against the target logits ``[blk+1, V]`` of the
    verification step (row ``i`` predicts the position of ``drafts[i]``; the last row the bonus).
    Returns ``(number of accepted drafts a, next token)``: the correction at draft ``a+1`` or,
    when ``a == blk``, the bonus."""
    blk = len(drafts)
    if logits_KV.shape[0] != blk + 1:
        raise ValueError(f"verify_block: {logits_KV.shape[0]} logit rows for {blk} drafts (want blk+1)")
    if temperature <= 0:
        for i, d in enumerate(drafts):
            t = int(np.argmax(logits_KV[i]))
            if int(d) != t:
                return i, t
        return blk, int(np.argmax(logits_KV[blk]))
    if rng is None:
        raise ValueError("verify_block: temperature > 0 needs an rng")
    for i, d in enumerate(drafts):
        p = _softmax(logits_KV[i], temperature)
        d = int(d)
        if rng.random() < p[d]:
            continue
        p[d] = 0.0
        return i, _sample(p / p.sum(), rng)
    return blk, _sample(_softmax(logits_KV[blk], temperature), rng)


def _first_token(logits_V: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits_V))
    return _sample(_softmax(logits_V, temperature), rng)


# ----------------------------------------------------------------------------- calibration


def expected_calibration_error(pred: np.ndarray, obs: np.ndarray, n_bins: int = 10) -> float:
    """ECE with ``n_bins`` equal-width bins of ``pred`` over [0, 1]: sum over bins of
    (bin count / total) * |mean pred - mean obs|. ``nan`` for no data."""
    pred = np.asarray(pred, np.float64).ravel()
    obs = np.asarray(obs, np.float64).ravel()
    if pred.shape != obs.shape:
        raise ValueError(f"pred {pred.shape} and obs {obs.shape} differ")
    if pred.size == 0:
        return float("nan")
    b = np.clip((pred * n_bins).astype(np.int64), 0, n_bins - 1)
    ece = 0.0
    for k in range(n_bins):
        m = b == k
        if m.any():
            ece += m.sum() / pred.size * abs(pred[m].mean() - obs[m].mean())
    return float(ece)


# ----------------------------------------------------------------------------- report


@dataclasses.dataclass
class AcceptanceReport:
    block_size: int
    temperature: float
    verifications: int
    accepted_hist: list[int]            # [blk+1]: verifications that accepted a = 0..blk drafts
    tokens: list[list[int]]             # generated tokens per prompt (max_new_tokens each)
    pred_cum: np.ndarray                # [verifications, blk]: prod_{i<=k} sigmoid(conf_i)
    obs_cum: np.ndarray                 # [verifications, blk]: 1 if drafts 1..k were all accepted

    @property
    def tau(self) -> float:
        """Mean tokens per verification: accepted drafts + 1 (correction or bonus)."""
        h = np.asarray(self.accepted_hist)
        return float((h * (np.arange(len(h)) + 1)).sum() / max(h.sum(), 1))

    @property
    def position_acceptance(self) -> list[float]:
        """P(draft i accepted | drafts < i accepted), i = 1..blk (``nan`` where never reached)."""
        h = np.asarray(self.accepted_hist)
        reach = h[::-1].cumsum()[::-1]  # reach[i] = #(a >= i)
        return [float(reach[i] / reach[i - 1]) if reach[i - 1] else float("nan")
                for i in range(1, self.block_size + 1)]

    def ece(self, n_bins: int = 10) -> float:
        """ECE of the predicted cumulative acceptance over every (verification, k)."""
        return expected_calibration_error(self.pred_cum, self.obs_cum, n_bins)

    def ece_per_position(self, n_bins: int = 10) -> list[float]:
        return [expected_calibration_error(self.pred_cum[:, k], self.obs_cum[:, k], n_bins)
                for k in range(self.block_size)]

    def summary(self, n_bins: int = 10, trace: bool = False) -> dict:
        """JSON-ready numbers (no tokens); ``trace``: also the per-verification ``pred_cum`` /
        ``obs_cum`` arrays (what ``scripts/dspark_sim.py`` replays), rounded to 4 decimals."""
        extra = {}
        if trace:
            extra = dict(pred_cum=np.round(self.pred_cum, 4).tolist(), obs_cum=self.obs_cum.astype(int).tolist())
        return extra | dict(temperature=self.temperature, block_size=self.block_size,
                    verifications=self.verifications, tau=self.tau, accepted_hist=list(self.accepted_hist),
                    position_acceptance=self.position_acceptance, ece=self.ece(n_bins),
                    ece_per_position=self.ece_per_position(n_bins),
                    mean_pred_cum=[float(x) for x in self.pred_cum.mean(0)] if self.verifications else [],
                    mean_obs_cum=[float(x) for x in self.obs_cum.mean(0)] if self.verifications else [])


# ----------------------------------------------------------------------------- the loop


def acceptance_cache_config(cfg, n_slots: int, max_len: int) -> CacheConfig:
    """A cache for ``n_slots`` sequences of up to ``max_len`` positions each."""
    bt = default_block_tokens(cfg)
    per_seq = -(-max_len // bt)
    return CacheConfig(num_slots=n_slots, num_blocks=n_slots * per_seq, block_tokens=bt,
                       max_blocks_per_seq=per_seq)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _snapshot(drv: SequenceDriver):
    return (jax.tree.map(jnp.copy, drv.cache), {s: len(h) for s, h in drv.history.items()},
            {s: list(b) for s, b in drv.blocks.items()}, drv._next_block)


def _restore(drv: SequenceDriver, snap) -> None:
    cache, hist_len, blocks, next_block = snap
    drv.cache = cache
    for s in list(drv.history):
        if s in hist_len:
            del drv.history[s][hist_len[s]:]
        else:
            del drv.history[s]
    drv.blocks = blocks
    drv._next_block = next_block


def measure_acceptance(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                       seed: int = 0, hasher: EngramHasher | None = None,
                       cache_config: CacheConfig | None = None, batch_size: int | None = None,
                       step_tokens: int = 256,
                       progress: Callable[[int], None] | None = None) -> AcceptanceReport:
    """Generate ``max_new_tokens`` per prompt by DSpark draft -> verify -> commit and record
    every verification. ``batch_size`` prompts run together as slots of one step (default: all,
    or ``cache_config.num_slots``). Every target step runs at one padded shape of
    ``max(step_tokens, batch_size * (blk + 1))`` tokens (prompts prefill in chunks of that
    size), so the loop compiles one step and one draft. ``progress(n)`` is called with the number
    of tokens each round added (summed over rows), e.g. a tqdm ``update``."""
    cfg = model.cfg
    if not cfg.dspark_enabled or not cfg.num_nextn_predict_layers:
        raise ValueError("measure_acceptance: the model has no DSpark stages")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("measure_acceptance: need non-empty prompts")
    blk = cfg.dspark_block_size
    max_len = max(len(p) for p in prompts) + max_new_tokens + blk + 1
    if cache_config is None:
        n = batch_size or min(len(prompts), 32)
        cache_config = acceptance_cache_config(cfg, n, max_len)
    batch_size = min(batch_size or cache_config.num_slots, cache_config.num_slots)
    if cache_config.max_model_len < max_len:
        raise ValueError(f"cache max_model_len={cache_config.max_model_len} < {max_len} positions needed")
    if cfg.engram_enabled and hasher is None:
        hasher = EngramHasher.from_model_config(cfg)
    rng = np.random.default_rng(seed)

    hist = np.zeros(blk + 1, np.int64)
    pred, obs = [], []
    tokens: list[list[int]] = [[] for _ in prompts]
    for g0 in range(0, len(prompts), batch_size):
        group = list(range(g0, min(g0 + batch_size, len(prompts))))
        drv = SequenceDriver(model, cache_config, hasher)
        R = batch_size  # rows of every step (a short last group leaves padding rows)
        n_log = R * (blk + 1)
        n_tok = max(step_tokens, n_log)
        slots = list(range(len(group)))
        nxt = {}  # slot -> the token the target chose for the position after its history
        for s, i in zip(slots, group):
            for c in range(0, len(prompts[i]), n_tok):
                piece = prompts[i][c:c + n_tok]
                lg, _, _ = drv.step([(s, piece)], logits=[len(piece) - 1] + [0] * (n_log - 1),
                                    num_tokens=n_tok, num_rows=R)
            nxt[s] = _first_token(lg[0], temperature, rng)
            tokens[i].append(nxt[s])
        if progress:
            progress(R)
        while True:
            active = [s for s, i in zip(slots, group) if len(tokens[i]) < max_new_tokens]
            if not active:
                break
            pad = [slots[0]] * (R - len(slots))  # a short group drafts slot 0 again (read-only) for a fixed shape
            d_ids, _, d_conf, _ = drv.draft(slots + pad, [nxt[s] for s in slots + pad])
            snap = _snapshot(drv)
            chunks = [(s, [int(t) for t in d_ids[s]]) for s in active]
            n_ver = len(active) * (blk + 1)
            lg, _, _ = drv.step(chunks, logits=list(range(n_ver)) + [0] * (n_log - n_ver),
                                num_tokens=n_tok, num_rows=R)
            commits, all_accepted, added = [], True, 0
            for j, s in enumerate(active):
                i = group[s]
                a, t = verify_block(lg[j * (blk + 1):(j + 1) * (blk + 1)], d_ids[s, 1:], temperature, rng)
                hist[a] += 1
                pred.append(np.cumprod(_sigmoid(d_conf[s])))
                obs.append((np.arange(1, blk + 1) <= a).astype(np.float64))
                new = [int(x) for x in d_ids[s, 1:1 + a]] + [t]
                room = max_new_tokens - len(tokens[i])
                tokens[i].extend(new[:room])
                added += min(len(new), room)
                commits.append((s, [nxt[s]] + new[:-1]))
                nxt[s] = t
                all_accepted &= a == blk
            if not all_accepted:
                _restore(drv, snap)
                idx = []
                o = 0
                for _, toks in commits:
                    o += len(toks)
                    idx.append(o - 1)
                drv.step(commits, logits=idx + [0] * (n_log - len(idx)), num_tokens=n_tok, num_rows=R)
            del snap
            if progress:
                progress(added)
    return AcceptanceReport(block_size=blk, temperature=float(temperature), verifications=int(hist.sum()),
                            accepted_hist=[int(x) for x in hist], tokens=tokens,
                            pred_cum=np.asarray(pred, np.float64).reshape(-1, blk),
                            obs_cum=np.asarray(obs, np.float64).reshape(-1, blk))
