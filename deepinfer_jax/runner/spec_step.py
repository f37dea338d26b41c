"""The jitted step of speculative (DSpark) decoding: verify, roll back, draft, in one program.

Rows carry ``1 + l_r`` tokens: the request's newest token ``y`` and the ``l_r`` drafts the
previous step proposed (``0 <= l_r <= K``; prefill chunks and rows without drafts have
``l_r = 0``). One call:

0. (async) resolves the rows planned before the previous step's results from that step's carry
   (``resolve_device_rows``: tokens, positions shifted by the rejected count, Engram ids);
1. records the cache locations every token of the step will write (``cache_undo.record_undo``);
2. runs the target forward with logits at every verification slot (``K + 1`` per row);
3. verifies the drafts on the device (``sampling/spec_verify.verify_drafts``: greedy acceptance,
   lossless rejection sampling for sampled rows, seeded by (request seed, position));
4. rolls back the writes of each row's rejected drafts (``apply_undo``): the cache is what a run
   that never proposed them holds;
5. drafts the next block for every row from its last accepted position (the DSpark stages read
   their rings, which step 4 already restored) with the correction / bonus token as input.

The host receives the emitted tokens (``a_r + 1`` per row), the next drafts and their
confidence logits; the carry (``SpecCarry``) stays on the device for the next step. There is no
other host round trip.

A plain step (``SchedulerOutput.spec_plain``; its inputs have ``draft_RK`` of width 0) is the
same program without speculation: one logits row per row (step 3 is then exactly ``sample``),
no undo log (nothing can be rejected) and no drafting; its outputs have 1 token slot and no
drafts, and it leaves a carry of the same shapes (no drafts verified, none proposed), so that
verification and plain steps follow each other in any order, also asynchronously.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.kernels_pallas import ops
from deepinfer_jax.models.cache import cache_block_tokens
from deepinfer_jax.models.cache_undo import apply_undo, fence, record_undo
from deepinfer_jax.runner.row_update import set_rows
from deepinfer_jax.sampling.sampler import prompt_logprobs
from deepinfer_jax.sampling.spec_verify import verify_drafts


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecStepOutput:
    num_accepted: jax.Array   # int32 [R]
    token_ids: jax.Array      # int32 [R, Kv+1]: accepted drafts, then the correction / bonus
    logprob: jax.Array        # f32 [R, Kv+1]
    top_ids: jax.Array        # int32 [R, Kv+1, N]
    top_logprobs: jax.Array   # f32 [R, Kv+1, N]
    draft_ids: jax.Array      # int32 [R, K] (plain step: [R, 0]): the next block's drafts
    draft_conf: jax.Array     # f32 [R, K] (plain step: [R, 0]): their confidence logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecCarry:
    """What a spec step leaves on the device for the next one (rows of its own step, padded to
    ``max_num_seqs``): an async verification row reads its tokens and its shift from here."""

    num_accepted: jax.Array   # int32 [S]
    num_drafts: jax.Array     # int32 [S]: drafts the row verified
    token_ids: jax.Array      # int32 [S, K+1]: emitted tokens (accepted drafts, then the last)
    draft_ids: jax.Array      # int32 [S, K]: the next block's drafts

    @staticmethod
    def empty(num_rows: int, K: int) -> "SpecCarry":
        z = jnp.zeros((num_rows,), jnp.int32)
        return SpecCarry(z, z, jnp.zeros((num_rows, K + 1), jnp.int32), jnp.zeros((num_rows, K), jnp.int32))


def spec_step_impl(graphdef, state_treedef, state_leaves, cache, inp, carry, engram_tables, *,
                   num_logprobs: int, prompt_lp: bool, kernels: str, spec_slots: int, rule: str,
                   force_accept: float = 0.0, batch_invariant: bool = False):
    with ops.use_backend(kernels), bi.use(batch_invariant):
        inp = resolve_device_rows(inp, carry, engram_tables, spec_slots)
        return _spec_body(graphdef, state_treedef, state_leaves, cache, inp, carry, num_logprobs, prompt_lp,
                          spec_slots, rule, force_accept)


def resolve_device_rows(inp, carry: SpecCarry, engram_tables, K: int):
    """Async speculation: rows planned before the previous step's accept counts were known
    (``spec_prev_row_R >= 0``) were planned as if every draft passed. Here, from that step's
    carry: their tokens (the last emitted token, then the step's drafts), their positions and
    start shifted back by the rejected count, their sampling positions, their drafts to judge and
    their Engram ids (the n-gram window: the accepted prefix of the context, then the row)."""
    from deepinfer_jax.runner.engram_hash_device import device_hash_window

    b, sb = inp.batch, inp.sampling
    T = b.token_ids.shape[0]
    p_R = inp.spec_prev_row_R
    ph_R = p_R >= 0
    pc_R = jnp.clip(p_R, 0, carry.num_accepted.shape[0] - 1)
    a_R = carry.num_accepted[pc_R]
    shift_R = jnp.where(ph_R, carry.num_drafts[pc_R] - a_R, 0)
    row_T = b.token_row
    j_T = jnp.arange(T) - b.row_token_offset[row_T]
    ph_T = ph_R[row_T] & b.token_valid
    last_R = jnp.take_along_axis(carry.token_ids[pc_R], a_R[:, None], axis=1)[:, 0]
    drafts_RK = carry.draft_ids[pc_R]
    dev_T = jnp.where(j_T == 0, last_R[row_T], drafts_RK[row_T, jnp.clip(j_T - 1, 0, K - 1)])
    tok_T = jnp.where(ph_T, dev_T, b.token_ids).astype(b.token_ids.dtype)
    eids = b.engram_ids
    if engram_tables is not None:
        H = inp.spec_ctx_RC.shape[1] - K
        cols = []
        for k in range(H + 1):  # the token at position p - k
            m_T = j_T - k
            from_row = tok_T[jnp.clip(jnp.arange(T) - k, 0, T - 1)]
            from_ctx = inp.spec_ctx_RC[row_T, jnp.clip(H + a_R[row_T] + m_T, 0, H + K - 1)]
            cols.append(jnp.where(m_T >= 0, from_row, from_ctx))
        dev_eids = device_hash_window(engram_tables, jnp.stack(cols, axis=1))
        eids = jnp.where(ph_T[:, None, None], dev_eids.astype(eids.dtype), eids)
    shift_T = jnp.where(ph_T, shift_R[row_T], 0)
    decoder = b.decoder
    if decoder is not None:
        decoder = dataclasses.replace(decoder, row_start=decoder.row_start - shift_R)
    b = dataclasses.replace(b, token_ids=tok_T, engram_ids=eids, positions=b.positions - shift_T,
                            row_start=b.row_start - shift_R, decoder=decoder)
    sb = dataclasses.replace(sb, position=sb.position - shift_R)
    Kv = inp.draft_RK.shape[1]  # the step's verification slots: K, or 0 in a plain step
    draft_RK = jnp.where(ph_R[:, None], drafts_RK[:, :Kv], inp.draft_RK)
    return dataclasses.replace(inp, batch=b, sampling=sb, draft_RK=draft_RK)


FORCE_SALT = 0x464F5243  # "FORC": fold_in data of the forced-acceptance uniforms


def forced_verification(ver, logits_RKV, draft_RK, num_drafts_R, sb, rate: float):
    """Benchmark mode (``EngineConfig.spec_force_accept``): each draft is accepted with
    probability ``rate`` until the first rejection, whatever the target says (seeded per request
    and position), and the token after the accepted ones is the target's argmax there. The output
    is not the model's: it measures the engine at a chosen acceptance (DeepSeek's decode plots use
    tau = 1 + n * 0.75)."""
    from deepinfer_jax.sampling.sampler import row_keys

    R, K1, _ = logits_RKV.shape
    keys = row_keys(jnp.asarray(sb.seed, jnp.uint32), jnp.asarray(sb.position, jnp.int32))
    u_RK = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, FORCE_SALT), (K1 - 1,)))(keys)
    slot = jnp.arange(K1 - 1)[None]
    rejected = (u_RK >= rate) | (slot >= num_drafts_R[:, None])
    a_R = jnp.where(rejected.any(-1), jnp.argmax(rejected, -1), K1 - 1).astype(jnp.int32)
    a_R = jnp.minimum(a_R, num_drafts_R)
    top_RK = jnp.argmax(logits_RKV, -1).astype(jnp.int32)
    slot1 = jnp.arange(K1)[None]
    judged = jnp.concatenate([draft_RK, jnp.zeros((R, 1), jnp.int32)], 1)
    last = jnp.take_along_axis(top_RK, a_R[:, None], 1)
    tok = jnp.where(slot1 < a_R[:, None], judged, jnp.where(slot1 == a_R[:, None], last, -1))
    return dataclasses.replace(ver, num_accepted=a_R, token_ids=tok, num_emitted=a_R + 1)


def rejected_tokens(batch, num_drafts_R: jax.Array, num_accepted_R: jax.Array) -> jax.Array:
    """bool ``[T]``: the tokens that are drafts past their row's accepted prefix."""
    row = batch.token_row
    j = jnp.arange(batch.token_ids.shape[0]) - batch.row_token_offset[row]
    first = batch.row_len[row] - 1 - num_drafts_R[row]  # offset of the row's newest known token
    return batch.token_valid & (j > first + num_accepted_R[row])


def slot_bans(sb, ban_slots_R, K1: int):
    """``sb`` with its row bans ``[R, B]`` turned into per-slot bans ``[R, K+1, B]`` that hold on
    each row's first ``ban_slots_R`` slots (min_tokens ending inside the verification row)."""
    on_RK = jnp.arange(K1, dtype=jnp.int32)[None, :] < ban_slots_R[:, None]
    return dataclasses.replace(sb, banned_RB=jnp.where(on_RK[:, :, None], sb.banned_RB[:, None, :], -1))


def _spec_body(graphdef, state_treedef, state_leaves, cache, inp, carry, num_logprobs: int, prompt_lp: bool,
               K: int, rule: str, force_accept: float):
    b = inp.batch
    model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, state_leaves))
    Kv = inp.draft_RK.shape[1]  # static: K in a verification step, 0 in a plain step
    if Kv:
        undo = record_undo(cache, b, cache_block_tokens(cache, model.cfg), model.cfg)
        cache, undo = fence(cache, undo)  # the log's reads before the forward's in-place writes
    cache, logits, _ = model(cache, b)
    R = inp.sampling.temperature.shape[0]
    K1 = Kv + 1
    V = logits.shape[-1]
    sb = slot_bans(inp.sampling, inp.ban_slots_R, K1)
    ver = verify_drafts(logits[:R * K1].reshape(R, K1, V), inp.draft_RK, inp.num_drafts_R, sb,
                        allowed_RKW=inp.allowed_RW, num_logprobs=num_logprobs, rule=rule,
                        batch_invariant=bi.enabled())
    if force_accept > 0 and Kv:
        ver = forced_verification(ver, logits[:R * K1].reshape(R, K1, V), inp.draft_RK, inp.num_drafts_R,
                                  sb, force_accept)
    if Kv:
        cache = apply_undo(cache, undo, rejected_tokens(b, inp.num_drafts_R, ver.num_accepted))
        # the next block: the last emitted token is the input, the last accepted position the context
        last_tok = jnp.take_along_axis(ver.token_ids, ver.num_accepted[:, None], axis=1)[:, 0]
        first_pos = b.row_start[:R] + b.row_len[:R] - 1 - inp.num_drafts_R
        last_pos = first_pos + ver.num_accepted
        nxt = model.draft(cache, jnp.maximum(last_tok, 0), last_pos, b.row_slot[:R])
        draft_ids, draft_conf = nxt.token_ids[:, 1:1 + K], nxt.confidence[:, :K].astype(jnp.float32)
    else:  # a plain step: nothing to roll back, nothing drafted
        draft_ids, draft_conf = jnp.zeros((R, 0), jnp.int32), jnp.zeros((R, 0), jnp.float32)
    out = SpecStepOutput(ver.num_accepted, ver.token_ids, ver.logprob, ver.top_ids, ver.top_logprobs,
                         draft_ids, draft_conf)
    # the carry keeps K + 1 token slots and K drafts whatever this step verified
    pad = ((0, 0), (0, K - Kv))
    new_carry = SpecCarry(set_rows(carry.num_accepted, ver.num_accepted),
                          set_rows(carry.num_drafts, jnp.clip(inp.num_drafts_R, 0, Kv)),
                          set_rows(carry.token_ids, jnp.pad(jnp.maximum(ver.token_ids, 0), pad)),
                          set_rows(carry.draft_ids, draft_ids if Kv else jnp.zeros((R, K), jnp.int32)))
    plp = prompt_logprobs(logits[R * K1:], inp.prompt_targets, num_logprobs) if prompt_lp else None
    return cache, out, plp, new_carry


@dataclasses.dataclass
class SpecStepResult:
    """Host copies of a spec step's outputs (rows as in its ``SchedulerOutput``)."""

    num_accepted: np.ndarray   # int32 [R]
    token_ids: np.ndarray      # int32 [R, K+1]
    logprob: np.ndarray        # f32 [R, K+1]
    top_ids: np.ndarray        # int32 [R, K+1, N]
    top_logprobs: np.ndarray   # f32 [R, K+1, N]
    draft_ids: np.ndarray      # int32 [R, K]
    draft_conf: np.ndarray     # f32 [R, K]
    prompt_target_lp: np.ndarray | None
    prompt_top_ids: np.ndarray | None
    prompt_top_lp: np.ndarray | None
    token_offsets: list[int]
