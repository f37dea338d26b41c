"""The jitted train step: loss on bf16 compute weights cast from the fp32 masters, gradient with
respect to the masters, clipped AdamW update, then the gate biases' load-balancing move. The
loss is the next-token cross-entropy plus ``indexer_loss_weight`` times the indexers' KL (their
own objective; their inputs carry no gradient, so the two terms train disjoint weights). With Engram layers the step and the loss take the
batch's hash ids (``engram_ids_BLNC``, from the caller's host hasher) as one more array."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from deepinfer_jax.training import params as P
from deepinfer_jax.training import routing_balance
from deepinfer_jax.training.forward import as_engram_ids, as_tokens, check_trainable_config, train_forward
from deepinfer_jax.training.indexer_loss import indexer_kl
from deepinfer_jax.training.loss import next_token_loss
from deepinfer_jax.training.optimizer import OptimConfig, lr_at, make_optimizer


@dataclasses.dataclass
class TrainState:
    master: object      # fp32 trainable weights (nnx.State)
    opt_state: object   # optax state
    step: int           # optimizer steps taken (= batches consumed)


class Trainer:
    """Holds the model's structure, its frozen weights and the optimizer; ``step`` runs one
    jitted update. ``model(master)`` rebuilds the model in its storage dtypes."""

    def __init__(self, model, oc: OptimConfig, trainable=P.is_trainable, full_rows: bool = True):
        self.full_rows = full_rows  # train_forward's dense per-row references (False: the general ones)
        check_trainable_config(model.cfg)
        self.cfg, self.oc = model.cfg, oc.validate()
        self.graphdef, trainable, self.frozen = P.split_model(model, trainable)
        self.like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trainable)
        self._init_master = P.to_master(trainable)
        self.tx = make_optimizer(oc, P.decay_mask(self._init_master))
        self._step = jax.jit(self._step_impl, donate_argnums=(0, 1))
        self._eval = jax.jit(self._loss)

    def init_state(self) -> TrainState:
        master = jax.tree.map(jnp.copy, self._init_master)
        return TrainState(master, self.tx.init(master), 0)

    def model(self, master):
        return nnx.merge(self.graphdef, P.storage_state(master, self.like), self.frozen)

    def _objective(self, master, frozen, tokens_BL, engram_ids_BLNC=None):
        model = nnx.merge(self.graphdef, P.compute_state(master, self.like), frozen)
        taps = {}
        logits, cache, _ = train_forward(model, tokens_BL, engram_ids_BLNC, taps, full_rows=self.full_rows)
        loss, n = next_token_loss(logits, tokens_BL, self.cfg.pad_token_id)
        kl = indexer_kl(self.cfg, taps, cache, *tokens_BL.shape)
        total = loss + self.oc.indexer_loss_weight * kl
        return total, (loss, n, kl, routing_balance.expert_loads(self.cfg, taps))

    def _loss(self, master, frozen, tokens_BL, engram_ids_BLNC=None):
        _, (loss, n, _, _) = self._objective(master, frozen, tokens_BL, engram_ids_BLNC)
        return loss, n

    def _step_impl(self, master, opt_state, frozen, tokens_BL, engram_ids_BLNC, step, total_steps):
        (_, (loss, n, kl, loads)), grads = jax.value_and_grad(self._objective, has_aux=True)(
            master, frozen, tokens_BL, engram_ids_BLNC)
        gnorm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, opt_state, master)
        lr = lr_at(self.oc, step, total_steps)
        master = optax.apply_updates(master, jax.tree.map(lambda u: u * lr, updates))
        master = routing_balance.balance_biases(master, loads, self.oc.balance_rate)
        return master, opt_state, {"loss": loss, "indexer_kl": kl, "expert_imbalance": routing_balance.imbalance(loads),
                                   "grad_norm": gnorm, "tokens": n, "lr": lr}

    def step(self, state: TrainState, tokens_BL, engram_ids_BLNC=None,
             total_steps: int | None = None) -> tuple[TrainState, dict]:
        """One update on ``tokens_BL``; ``engram_ids_BLNC``: its Engram hash ids (required with
        Engram layers); ``total_steps``: the run's length for the learning-rate schedule (default
        ``OptimConfig.total_steps``)."""
        total = self.oc.total_steps if total_steps is None else total_steps
        toks = as_tokens(tokens_BL)
        eids = as_engram_ids(self.cfg, engram_ids_BLNC, toks.shape)
        master, opt, metrics = self._step(state.master, state.opt_state, self.frozen, toks, eids,
                                          jnp.asarray(state.step, jnp.int32), jnp.asarray(total, jnp.int32))
        return TrainState(master, opt, state.step + 1), {k: float(v) for k, v in metrics.items()}

    def loss(self, master, tokens_BL, engram_ids_BLNC=None) -> float:
        toks = as_tokens(tokens_BL)
        return float(self._eval(master, self.frozen, toks, as_engram_ids(self.cfg, engram_ids_BLNC, toks.shape))[0])
