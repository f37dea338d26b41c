"""The DSpark stages' training forward: the inference draft of one block per anchor, teacher forced.

The frozen backbone runs the training forward (``forward.train_forward``: the inference prefill on
a fresh cache) over full sequences ``[B, L]``, giving every position's target logits and the
DSpark context ``main_hidden``. An anchor ``a`` (``1 <= a <= L - 2``) is the first position of a
draft block: the target has seen positions ``0 .. p = a - 1`` and chose ``tok[a]``. The block's
ids are ``[tok[a], noise, ..., noise]`` at positions ``a .. a + blk - 1``; stage ``k`` attends to its
ring of ``kv(main_x)`` of positions ``<= p`` (laid out as the inference cache's ring: ring index
``i`` holds position ``p - ((p - i) mod W)``, valid for ``i <= p``) and the whole block, through
``DeepseekV41ForCausalLM.draft_block``, the code the inference ``draft`` runs. Block position ``i``
predicts ``tok[a + 1 + i]``; its Markov bias and confidence embedding come from the TRUE previous
token ``tok[a + i]`` (at inference: the draft's own greedy token; the two coincide whenever the
draft is right, the case the confidence head rates). Each anchor is its own ring "slot", so the
rings are ``[B * A, W, A_dim]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.training.forward import train_forward


@dataclasses.dataclass
class DSparkBatch:
    draft_logits: jax.Array    # f32 [B, A, K, V]: Markov bias included
    confidence: jax.Array      # f32 [B, A, K] logits
    target_ids: jax.Array      # int32 [B, A, K]: tok[a + 1 + i] (clipped where invalid)
    target_logits: jax.Array   # f32 [B, A, K, V]: the backbone's logits at a + i (stop-gradient)
    mask: jax.Array            # f32 [B, A, K]: 1 where a + 1 + i <= L - 1 (cumulative)


jax.tree_util.register_dataclass(
    DSparkBatch, data_fields=[f.name for f in dataclasses.fields(DSparkBatch)], meta_fields=[])


def sample_anchors(seed, batch: int, seq_len: int, num_anchors: int, low: int = 1) -> np.ndarray:
    """int32 ``[B, A]`` anchors in ``[low, L - 2]`` (drawn with replacement), deterministic from
    ``seed`` (an int or a sequence of ints, e.g. ``(run_seed, step)``). ``low`` > 1 keeps the
    blocks out of a prefix (the prompts of regenerated sequences)."""
    if seq_len < 3:
        raise ValueError(f"seq_len={seq_len}: DSpark anchors need seq_len >= 3 (a in [1, L-2])")
    if num_anchors < 1:
        raise ValueError(f"num_anchors={num_anchors}: must be >= 1")
    if not 1 <= low <= seq_len - 2:
        raise ValueError(f"anchor low={low}: must be in [1, seq_len - 2 = {seq_len - 2}]")
    rng = np.random.default_rng(seed)
    return rng.integers(low, seq_len - 1, size=(batch, num_anchors)).astype(np.int32)


def stage_rings(model, main_hidden_BLX: jax.Array, anchors_BA: jax.Array) -> list[jax.Array]:
    """Per stage, the ring ``[B * A, W, A_dim]`` (bf16, as the cache holds it) each anchor's draft
    sees: ``project_kv(main_x)`` of positions ``p - ((p - i) mod W)``, ``p = a - 1``; ring indices
    ``i > p`` (no such position) hold position 0's entry, masked by ``dspark_attention``."""
    cfg = model.cfg
    B, L, X = main_hidden_BLX.shape
    W = cfg.sliding_window
    s0 = model.mtp[0]
    main_x_TD = s0.main_norm(s0.main_proj(main_hidden_BLX.reshape(B * L, X)))
    pos_T = jnp.tile(jnp.arange(L, dtype=jnp.int32), B)
    p_BA1 = (anchors_BA - 1)[..., None]
    src_BAW = jnp.clip(p_BA1 - jnp.mod(p_BA1 - jnp.arange(W)[None, None, :], W), 0, L - 1)
    flat = (jnp.arange(B)[:, None, None] * L + src_BAW).reshape(-1)
    rings = []
    for stage in model.mtp:
        kv_TA = stage.attn.project_kv(main_x_TD, pos_T).astype(jnp.bfloat16)
        rings.append(kv_TA[flat].reshape(B * anchors_BA.shape[1], W, -1))
    return rings


def stage_forward(model, tokens_BL: jax.Array, anchors_BA: jax.Array, target_logits_BLV: jax.Array,
                  main_hidden_BLX: jax.Array) -> DSparkBatch:
    """The teacher-forced draft blocks of ``anchors_BA`` given the backbone's outputs."""
    cfg = model.cfg
    K = cfg.dspark_block_size
    tokens_BL = jnp.asarray(tokens_BL, jnp.int32)
    anchors_BA = jnp.asarray(anchors_BA, jnp.int32)
    B, L = tokens_BL.shape
    A = anchors_BA.shape[1]
    R = B * A
    pos_BAK = anchors_BA[..., None] + jnp.arange(K, dtype=jnp.int32)[None, None, :]
    mask_BAK = (pos_BAK + 1 <= L - 1).astype(jnp.float32)
    rows = jnp.arange(B)[:, None, None]
    prev_BAK = tokens_BL[rows, jnp.clip(pos_BAK, 0, L - 1)]
    target_BAK = tokens_BL[rows, jnp.clip(pos_BAK + 1, 0, L - 1)]
    tlogits = jax.lax.stop_gradient(target_logits_BLV)[rows, jnp.clip(pos_BAK, 0, L - 1)]
    ids_RK = jnp.full((R, K), cfg.dspark_noise_token_id, jnp.int32).at[:, 0].set(prev_BAK[:, :, 0].reshape(R))
    rings = stage_rings(model, jax.lax.stop_gradient(main_hidden_BLX), anchors_BA)
    h_RKD, base_RKV = model.draft_block(rings, ids_RK, (anchors_BA - 1).reshape(R), jnp.arange(R, dtype=jnp.int32))
    last = model.mtp[-1]
    bias, emb = last.markov_head(prev_BAK.reshape(R * K))
    logits_RKV = base_RKV + bias.reshape(R, K, -1)
    conf_RK = last.confidence_head(h_RKD, emb.reshape(R, K, -1))
    return DSparkBatch(logits_RKV.reshape(B, A, K, -1), conf_RK.reshape(B, A, K), target_BAK, tlogits, mask_BAK)


def backbone_forward(model, tokens_BL, engram_ids_BLNC=None) -> tuple[jax.Array, jax.Array]:
    """The frozen backbone's ``(target logits [B, L, V], main_hidden [B, L, X])``, stop-gradient."""
    if not len(model.mtp):
        raise ValueError("DSpark training: the model has no DSpark stages (dspark_block_size / "
                         "num_nextn_predict_layers / dspark_target_layer_ids)")
    logits, _, main = train_forward(model, jnp.asarray(tokens_BL, jnp.int32), engram_ids_BLNC)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(main)


def dspark_forward(model, tokens_BL, anchors_BA, engram_ids_BLNC=None) -> DSparkBatch:
    """Backbone forward (stop-gradient) then the teacher-forced draft blocks at ``anchors_BA``."""
    logits, main = backbone_forward(model, tokens_BL, engram_ids_BLNC)
    return stage_forward(model, tokens_BL, anchors_BA, logits, main)
