"""Training the DSpark draft stages (``model.mtp``, checkpoint ``mtp.K.*``) on a frozen backbone.

``DSparkTrainer`` is a ``Trainer`` whose trained weights are the stages' (``params.
is_stage_trainable``; fp32 masters, AdamW of ``optimizer.py``, bf16 compute); everything else,
the embedding and head the draft shares included, is frozen. A step: the backbone's training
forward (stop-gradient: target logits and ``main_hidden``), ``num_anchors`` anchors per row drawn
from ``(anchor_seed, step)`` in ``[anchor_low, L - 2]`` (so a resumed run draws what a straight
run draws), the
teacher-forced draft blocks (``dspark_forward.stage_forward``), the DSpark loss
(``dspark_loss``), gradient with respect to the stage masters, clipped AdamW update.

``model(master)`` is the whole model with the trained stages, so ``export.export_checkpoint(
dspark_trainer, master, dir)`` writes a checkpoint whose ``mtp.*`` tensors are the trained ones
(``backbone_master``: the backbone's fp32 masters, for an fp8 export to quantize from).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from deepinfer_jax.kernels_pallas import ops
from deepinfer_jax.training import params as P
from deepinfer_jax.training.dspark_forward import backbone_forward, sample_anchors, stage_forward
from deepinfer_jax.training.dspark_loss import DSparkLossConfig, dspark_loss
from deepinfer_jax.training.forward import as_engram_ids, as_tokens
from deepinfer_jax.training.optimizer import OptimConfig, lr_at
from deepinfer_jax.training.step import Trainer, TrainState


def _host(v):
    a = np.asarray(v)
    return float(a) if a.ndim == 0 else [float(x) for x in a.reshape(-1)]


class DSparkTrainer(Trainer):
    def __init__(self, model, oc: OptimConfig, num_anchors: int, lc: DSparkLossConfig = DSparkLossConfig(),
                 anchor_seed: int = 0, anchor_low: int = 1):
        if not len(getattr(model, "mtp", ())):
            raise ValueError("DSparkTrainer: the model has no DSpark stages (config: dspark_block_size="
                             f"{model.cfg.dspark_block_size}, num_nextn_predict_layers="
                             f"{model.cfg.num_nextn_predict_layers}, dspark_target_layer_ids="
                             f"{tuple(model.cfg.dspark_target_layer_ids)})")
        if num_anchors < 1:
            raise ValueError(f"num_anchors={num_anchors}: must be >= 1")
        self.num_anchors, self.lc, self.anchor_seed, self.anchor_low = num_anchors, lc.validate(), anchor_seed, anchor_low
        super().__init__(model, oc, P.is_stage_trainable)

    def anchors(self, step: int, batch: int, seq_len: int) -> np.ndarray:
        """The anchors ``[B, A]`` of step ``step`` (a function of ``(anchor_seed, step)`` only)."""
        return sample_anchors([self.anchor_seed, step], batch, seq_len, self.num_anchors, self.anchor_low)

    def _compute_model(self, master, frozen):
        return nnx.merge(self.graphdef, P.compute_state(master, self.like), frozen)

    def _backbone(self, master, frozen, tokens_BL, engram_ids_BLNC):
        return backbone_forward(self._compute_model(master, frozen), tokens_BL, engram_ids_BLNC)

    def _loss(self, master, frozen, tokens_BL, anchors_BA, logits_BLV, main_BLX):
        with ops.use_backend("reference"):  # differentiable (the Pallas kernels define no VJP)
            out = stage_forward(self._compute_model(master, frozen), tokens_BL, anchors_BA, logits_BLV, main_BLX)
        return dspark_loss(out.draft_logits, out.confidence, out.target_ids, out.target_logits, out.mask, self.lc)

    def _step_impl(self, master, opt_state, frozen, tokens_BL, engram_ids_BLNC, anchors_BA, step, total_steps):
        logits, main = self._backbone(master, frozen, tokens_BL, engram_ids_BLNC)
        (_, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
            master, frozen, tokens_BL, anchors_BA, logits, main)
        gnorm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, opt_state, master)
        lr = lr_at(self.oc, step, total_steps)
        master = optax.apply_updates(master, jax.tree.map(lambda u: u * lr, updates))
        return master, opt_state, metrics | {"grad_norm": gnorm, "lr": lr}

    def _eval_impl(self, master, frozen, tokens_BL, engram_ids_BLNC, anchors_BA):
        logits, main = self._backbone(master, frozen, tokens_BL, engram_ids_BLNC)
        return self._loss(master, frozen, tokens_BL, anchors_BA, logits, main)[1]

    def step(self, state: TrainState, tokens_BL, engram_ids_BLNC=None,
             total_steps: int | None = None) -> tuple[TrainState, dict]:
        """One update on ``tokens_BL`` at the anchors of ``state.step``. Metrics: floats, and per
        draft position lists (``accept_rate``, ``greedy_match``)."""
        total = self.oc.total_steps if total_steps is None else total_steps
        toks = as_tokens(tokens_BL)
        eids = as_engram_ids(self.cfg, engram_ids_BLNC, toks.shape)
        anchors = self.anchors(state.step, *toks.shape)
        master, opt, metrics = self._step(state.master, state.opt_state, self.frozen, toks, eids, anchors,
                                          jnp.asarray(state.step, jnp.int32), jnp.asarray(total, jnp.int32))
        return TrainState(master, opt, state.step + 1), {k: _host(v) for k, v in metrics.items()}

    def evaluate(self, master, tokens_BL, engram_ids_BLNC=None, anchors_BA=None, seed=0) -> dict:
        """The loss metrics of ``master`` on ``tokens_BL`` (anchors: given, else drawn from ``seed``)."""
        toks = as_tokens(tokens_BL)
        eids = as_engram_ids(self.cfg, engram_ids_BLNC, toks.shape)
        if anchors_BA is None:
            anchors_BA = sample_anchors(seed, *toks.shape, self.num_anchors, self.anchor_low)
        if not hasattr(self, "_deval"):
            self._deval = jax.jit(self._eval_impl)
        m = self._deval(master, self.frozen, toks, eids, jnp.asarray(anchors_BA, jnp.int32))
        return {k: _host(v) for k, v in m.items()}

    def loss(self, master, tokens_BL, engram_ids_BLNC=None) -> float:
        return self.evaluate(master, tokens_BL, engram_ids_BLNC)["loss"]

    def stage_weights(self, master) -> dict[str, np.ndarray]:
        """The trained ``mtp.*`` tensors in the model's storage dtypes, by parameter name."""
        st = P.storage_state(master, self.like)
        return {P.path_name(p): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
                for p, v in nnx.to_flat_state(st)}


def with_stages(model, trainer: DSparkTrainer, master):
    """``model`` (same structure, e.g. the backbone run's ``Trainer.model(...)``) with its ``mtp.*``
    weights replaced by the trained stages of ``master``."""
    out = nnx.merge(*nnx.split(model))  # a copy: ``model`` keeps its weights
    nnx.update(out, P.storage_state(master, trainer.like))
    return out
