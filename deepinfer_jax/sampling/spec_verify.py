"""Device-side verification of speculative (DSpark) drafts: one jitted, batched, seeded call.

The rule is the design's FEATURES section 4 ("Verification"), for a point-mass draft
``q = delta(d_i)``. Per request row ``r`` with ``l_r`` drafts ``d_1..d_l`` (``0 <= l_r <= K``),
the target scored the ``l_r + 1`` verification positions; ``p_i`` is the sampler's distribution
at position ``i`` exactly as ``sample`` builds it: banned ids and the (optional) structured-output
bitmask set to ``-inf``, then temperature, then min-p / top-k / top-p.

* Greedy rows (``temperature < SAMPLING_EPS``): accept ``d_i`` while ``d_i == argmax p_i``; the
  first mismatch emits ``argmax p_i`` (the correction); if all ``l_r`` pass, emit the bonus
  ``argmax p_{l+1}``. Ties go to the lowest id, as in ``sample``.
* Sampled rows: accept ``d_i`` iff ``u_i < p_i(d_i)`` (``min(1, p/q)`` with ``q(d_i) = 1``); on
  the first rejection emit a sample from ``p_i`` with ``d_i`` removed and renormalised
  (``norm(max(p - q, 0))``); if all pass, sample the bonus from ``p_{l+1}``. This keeps the
  target distribution exactly (tested with chi-square tests in ``tests/test_spec_verify.py``).
  A draft outside the allowed set has ``p_i(d_i) = 0`` and is always rejected.

Randomness: verification slot ``i`` of row ``r`` is the absolute position
``sb.position[r] + i``, with ``key_i = row_keys(seed, position + i)`` (see ``sampler.py``). Every
sample (correction or bonus) is Gumbel-max with ``gumbel_noise`` of ``key_i``, i.e. the very noise
``sample`` uses for that (seed, position); so a row with ``l_r = 0`` gives bit for bit what
``sample`` gives, and a row's result never depends on the rest of the batch or on the padding.
The acceptance uniform is ``u_i = uniform(fold_in(key_i, ACCEPT_SALT))``.

``rule="coupled"`` (static) is an alternative with the same distribution: accept ``d_i`` iff the
Gumbel-max sample ``x_i = argmax(log p_i + g_i)`` equals ``d_i``, else emit ``x_i``.
``P(x_i = d_i) = p_i(d_i)`` and, given ``x_i != d_i``, ``x_i`` follows ``p_i`` without ``d_i``,
renormalised, so it is the same rule in distribution; in addition every emitted token is exactly
the token ``sample`` would have drawn at that (seed, position) from the same logits, so seeded
output with speculation equals seeded output without it (given equal logits), as greedy does.

Glossary (see layers/README.md): R = request rows, K = draft slots (the logits, the bitmask and
the outputs have K + 1 along that axis: slot ``i`` judges ``d_{i+1}``, slot ``l_r`` gives the
bonus), V = vocab, W = ``ceil(V / 32)`` bitmask words, N = top logprobs (static), B = banned ids.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.sampling.params import SAMPLING_EPS
from deepinfer_jax.sampling.sampler import (SamplingBatch, apply_filters, ban_tokens, gumbel_noise, row_keys,
                                            unpack_bitmask)  # noqa: F401  (unpack_bitmask: re-exported)

RULES = ("uniform", "coupled")
# fold_in data of the acceptance uniform's key ("SPEC"); the Gumbel noise uses the key itself.
ACCEPT_SALT = 0x53504543


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecVerifyOutput:
    num_accepted: jax.Array  # int32 [R]: accepted drafts a_r, 0..l_r
    token_ids: jax.Array     # int32 [R, K+1]: d_1..d_a then the correction / bonus; -1 beyond
    num_emitted: jax.Array   # int32 [R]: a_r + 1
    logprob: jax.Array       # f32 [R, K+1]: raw log_softmax(logits)[token] per emitted slot; 0 beyond
    top_ids: jax.Array       # int32 [R, K+1, N]: raw top-N ids per slot (every slot, emitted or not)
    top_logprobs: jax.Array  # f32 [R, K+1, N]


@functools.partial(jax.jit, static_argnames=("num_logprobs", "rule", "batch_invariant"))
def verify_drafts(logits_RKV: jax.Array, draft_RK: jax.Array, num_drafts_R: jax.Array, sb: SamplingBatch,
                allowed_RKW: jax.Array | None = None, num_logprobs: int = 0,
                rule: str = "uniform", batch_invariant: bool = False) -> SpecVerifyOutput:
    """Verify each row's drafts against the target logits (see the module docstring).

    ``logits_RKV``: the target's logits ``[R, K+1, V]`` at the verification slots (slot ``i`` is
    the position of ``d_{i+1}``; slot ``l_r`` the bonus; slots beyond ``l_r`` are ignored).
    ``draft_RK``: int ``[R, K]`` draft ids (beyond ``l_r`` ignored). ``num_drafts_R``: ``l_r``
    (clipped to ``[0, K]``). ``sb``: the rows' ``SamplingBatch`` with ``position`` = the position
    of slot 0; its ``banned_RB`` applies to every slot, or give ``[R, K+1, B]`` for per-slot bans
    (e.g. min_tokens ending inside the block). ``allowed_RKW``: optional int32 bitmask
    ``[R, K+1, ceil(V/32)]`` per slot (``None`` = all allowed). ``num_logprobs``: static N of the
    raw top logprobs per slot. ``rule``: static, ``"uniform"`` (default) or ``"coupled"``.
    ``batch_invariant`` (static): the row reductions in a fixed order (``base/batch_invariant.py``).
    """
    with bi.use(batch_invariant):
        return _verify(logits_RKV, draft_RK, num_drafts_R, sb, allowed_RKW, num_logprobs, rule)


def _verify(logits_RKV, draft_RK, num_drafts_R, sb: SamplingBatch, allowed_RKW, num_logprobs: int,
            rule: str) -> SpecVerifyOutput:
    if rule not in RULES:
        raise ValueError(f"verify_drafts: rule={rule!r}: must be one of {RULES}")
    logits_RKV = jnp.asarray(logits_RKV, jnp.float32)
    R, K1, V = logits_RKV.shape
    K = K1 - 1
    if sb.num_rows != R:
        raise ValueError(f"verify_drafts: logits have {R} rows but the SamplingBatch has {sb.num_rows}")
    if draft_RK.shape != (R, K):
        raise ValueError(f"verify_drafts: draft_RK shape {draft_RK.shape}, want {(R, K)} (logits {logits_RKV.shape})")
    if allowed_RKW is not None and allowed_RKW.shape != (R, K1, -(-V // 32)):
        raise ValueError(f"verify_drafts: allowed_RKW shape {allowed_RKW.shape}, want {(R, K1, -(-V // 32))}")
    RK = R * K1

    def per_slot(x_R):  # [R, ...] -> [R*(K+1), ...], each row repeated for its slots
        x_R = jnp.asarray(x_R)
        return jnp.repeat(x_R, K1, axis=0)

    num_R = jnp.clip(jnp.asarray(num_drafts_R, jnp.int32), 0, K)
    draft_RK = jnp.asarray(draft_RK, jnp.int32)
    slot_K = jnp.arange(K1, dtype=jnp.int32)
    # the draft judged at each slot; -1 at the bonus slot (and beyond l_r: never used)
    judged_RK = jnp.concatenate([draft_RK, jnp.full((R, 1), -1, jnp.int32)], axis=1)
    judged_RK = jnp.where(slot_K[None] < num_R[:, None], judged_RK, -1)
    judged_X = judged_RK.reshape(RK)  # X = R*(K+1) flat slots

    logits_XV = logits_RKV.reshape(RK, V)
    banned = jnp.asarray(sb.banned_RB, jnp.int32)
    banned_XB = banned.reshape(RK, -1) if banned.ndim == 3 else per_slot(banned)
    masked_XV = ban_tokens(logits_XV, banned_XB)
    if allowed_RKW is not None:
        allowed_XV = unpack_bitmask(allowed_RKW, V).reshape(RK, V)
        masked_XV = jnp.where(allowed_XV, masked_XV, -jnp.inf)
    vocab_V = jnp.arange(V, dtype=jnp.int32)
    is_draft_XV = vocab_V[None] == judged_X[:, None]

    plain_X = jnp.argmax(masked_XV, axis=-1).astype(jnp.int32)  # greedy; ties -> lowest id
    accept_X = plain_X == judged_X
    excl_X = plain_X  # greedy correction: the argmax (!= the rejected draft)
    if not sb.all_greedy:
        temperature_X = per_slot(jnp.asarray(sb.temperature, jnp.float32))
        greedy_X = temperature_X < SAMPLING_EPS
        scaled_XV = masked_XV / jnp.where(greedy_X, 1.0, temperature_X)[:, None]
        if sb.needs_filter:
            scaled_XV = apply_filters(scaled_XV, per_slot(jnp.asarray(sb.top_k, jnp.int32)),
                                      per_slot(jnp.asarray(sb.top_p, jnp.float32)),
                                      per_slot(jnp.asarray(sb.min_p, jnp.float32)))
        seed_X2 = per_slot(jnp.asarray(sb.seed, jnp.uint32))
        position_X = (jnp.asarray(sb.position, jnp.int32)[:, None] + slot_K[None]).reshape(RK)
        noisy_XV = scaled_XV + gumbel_noise(seed_X2, position_X, V)
        drawn_X = jnp.argmax(noisy_XV, axis=-1).astype(jnp.int32)  # = sample()'s token at this slot
        # a sample from p_i with the judged draft removed (renormalisation is implicit in argmax)
        drawn_excl_X = jnp.argmax(jnp.where(is_draft_XV, -jnp.inf, noisy_XV), axis=-1).astype(jnp.int32)
        if rule == "coupled":
            s_accept_X = drawn_X == judged_X
        else:
            p_draft_X = bi.row_sum(jnp.where(is_draft_XV, bi.softmax(scaled_XV, axis=-1), 0.0), axis=-1)
            u_X = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, ACCEPT_SALT), (), jnp.float32))(
                row_keys(seed_X2, position_X))
            s_accept_X = u_X < p_draft_X  # p = 0 (filtered / banned / masked) -> always rejected
        plain_X = jnp.where(greedy_X, plain_X, drawn_X)
        excl_X = jnp.where(greedy_X, excl_X, drawn_excl_X)
        accept_X = jnp.where(greedy_X, accept_X, s_accept_X)
    # a draft is never accepted where it is masked out (covers fully masked slots, and -1 padding)
    draft_ok_X = jnp.take_along_axis(masked_XV, jnp.clip(judged_X, 0, V - 1)[:, None], axis=-1)[:, 0] > -jnp.inf
    accept_RK = (accept_X & draft_ok_X & (judged_X >= 0)).reshape(R, K1)

    # accepted = the first rejected slot among 0..l_r-1, else l_r
    rejected_RK = (~accept_RK) & (slot_K[None] < num_R[:, None])
    a_R = jnp.where(rejected_RK.any(axis=-1), jnp.argmax(rejected_RK, axis=-1), num_R).astype(jnp.int32)
    last_RK = jnp.where(slot_K[None] < num_R[:, None], excl_X.reshape(R, K1), plain_X.reshape(R, K1))
    last_R = jnp.take_along_axis(last_RK, a_R[:, None], axis=-1)[:, 0]
    token_RK = jnp.where(slot_K[None] < a_R[:, None], judged_RK, -1)
    token_RK = jnp.where(slot_K[None] == a_R[:, None], last_R[:, None], token_RK)

    lse_RK = bi.logsumexp(logits_RKV, axis=-1)
    emitted_RK = slot_K[None] <= a_R[:, None]
    tok_lp_RK = jnp.take_along_axis(logits_RKV, jnp.maximum(token_RK, 0)[..., None], axis=-1)[..., 0]
    logprob_RK = jnp.where(emitted_RK, tok_lp_RK - lse_RK, 0.0)
    if num_logprobs > 0:
        top_vals_RKN, top_ids_RKN = jax.lax.top_k(logits_RKV, num_logprobs)
        top_logprobs_RKN = top_vals_RKN - lse_RK[..., None]
    else:
        top_ids_RKN = jnp.zeros((R, K1, 0), jnp.int32)
        top_logprobs_RKN = jnp.zeros((R, K1, 0), jnp.float32)
    return SpecVerifyOutput(num_accepted=a_R, token_ids=token_RK.astype(jnp.int32), num_emitted=a_R + 1,
                            logprob=logprob_RK, top_ids=top_ids_RKN.astype(jnp.int32),
                            top_logprobs=top_logprobs_RKN)
