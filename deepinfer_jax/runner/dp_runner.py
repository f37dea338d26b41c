"""Attention data parallel on the device: one jitted step, ``shard_map`` over the whole mesh.

``DPModelRunner`` is the ``ModelRunner`` of a mesh with ``dp > 1`` (FEATURES §6). Each dp rank
owns its requests (``host_scheduler/dp_scheduler.py``) and their cache: every cache array is
``[dp * S, ...]`` (slots) or ``[dp * B, ...]`` (blocks), split over ``dp``, so a rank's devices
hold only its own slots and blocks (replicated over the rank's cp devices) and a rank's rows
name local slot and block ids. One step:

* the host builds every rank's ``StepInput`` at one per-rank bucket (the largest any rank
  needs; every rank pads to it), packs each, and sends them stacked ``[dp, n]``, split over
  ``dp``;
* under ``shard_map`` every mesh axis is manual and each device runs the unchanged step body on
  its rank's rows: embedding, attention over its own cache, everything before the MoE. No
  device reads another rank's KV;
* the routed experts are split over the expert-parallel group (``dp x cp``); ``ops.moe_experts``
  sees the manual axes and exchanges tokens explicitly (``kernels_pallas/moe_ep.py``,
  ``moe_experts_dp``: ``EngineConfig.ep_scheme`` "a2a" or "psum", bit-identical), and the
  row-split Engram tables answer lookups with an exact sum-scatter (``sharding/manual.py``);
* outputs come back ``[dp * R, ...]``; rank ``k``'s ``j``-th row is row ``k*R + j``
  (``row_map``, ``StepHandle(row_index=...)``).

Balanced context parallelism (``EngineConfig.cp_min_tokens``): a step whose per-rank bucket is
that large carries the mirror layout of its tokens over the rank's cp devices
(``base/cp_layout.py``) and each cp device computes its own share, exchanging keys, not
recomputing them (``sharding/context_parallel.py``). Smaller steps (decode) run the rank's
attention on every cp device; each of them sends a distinct share of the tokens to the experts.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.base.scheduler_output import SchedulerOutput
from deepinfer_jax.kernels_pallas import moe_ep
from deepinfer_jax.models.cache import CacheConfig, allocate_cache
from deepinfer_jax.runner.model_runner import ModelRunner, _step_impl
from deepinfer_jax.runner.packed_input import pack, unpack
from deepinfer_jax.runner.spec_step import SpecCarry, spec_step_impl
from deepinfer_jax.runner.step_inputs import banned_width, build_step_input, pick_bucket
from deepinfer_jax.sharding import expert_replicas, manual
from deepinfer_jax.sharding.eplb import rebalance_experts
from deepinfer_jax.sharding.partition import split_axes

DP = P("dp")


def _dp_step(graphdef, state_treedef, leaf_specs, mesh, impl, state_leaves, cache, bufs, carry, engram_tables,
             placement=None, *, layout, scheme: str, gather: bool, decoder_from: int | None = None, **kw):
    """One step of every rank: ``impl`` (the plain or the spec step body) per device under
    ``shard_map``; ``bufs`` are the ranks' packed inputs ``[dp, n]``, ``cache`` and ``carry``
    the ranks' state split over ``dp``. ``gather``: the outputs come back replicated (all-gathered
    over ``dp``), so that every process of a multi-process mesh can read all of them.
    ``placement``: redundant experts (EPLB); the step then also returns every placed layer's
    per-slot load of this step, summed over the ranks (``[L, R]``, replicated)."""
    def body(leaves, cache_, bufs_, carry_, tables, placement_):
        inp = unpack(tuple(b[0] for b in bufs_), layout)
        dec = inp.batch.decoder
        placed = contextlib.nullcontext() if placement_ is None else expert_replicas.use_placement(
            placement_, inp.batch.token_valid, None if dec is None else dec.token_valid, decoder_from)
        with moe_ep.use_scheme(scheme), placed as st:
            cache_, out, plp, carry_ = impl(graphdef, state_treedef, leaves, cache_, inp, carry_, tables, **kw)
        loads = None if placement_ is None else jax.lax.psum(expert_replicas.recorded_loads(st), "dp")
        if gather:
            out, plp = jax.tree.map(lambda a: jax.lax.all_gather(a, "dp", tiled=True), (out, plp))
        return (cache_, out, plp, carry_) if loads is None else (cache_, out, plp, carry_, loads)

    res = P() if gather else DP
    outs = (DP, res, res, DP) if placement is None else (DP, res, res, DP, P())
    return jax.shard_map(body, mesh=mesh, in_specs=(list(leaf_specs), DP, DP, DP, P(), P()), out_specs=outs,
                         check_vma=False)(state_leaves, cache, bufs, carry, engram_tables, placement)


_DP_FNS: dict = {}


def dp_step_function(graphdef, state_treedef, leaf_specs, mesh, spec: bool = False, batch_invariant: bool = False):
    """The jitted DP step of one model structure on ``mesh`` (cached like ``step_function``)."""
    key = (graphdef, state_treedef, tuple(leaf_specs), mesh, spec, batch_invariant)
    fn = _DP_FNS.get(key)
    if fn is None:
        opts = bi.compiler_options(jax.default_backend()) if batch_invariant else None
        impl = spec_step_impl if spec else _step_impl
        statics = ("layout", "scheme", "gather", "decoder_from", "num_logprobs", "prompt_lp", "kernels", "batch_invariant")
        if spec:
            statics += ("spec_slots", "rule", "force_accept")
        fn = jax.jit(functools.partial(_dp_step, graphdef, state_treedef, tuple(leaf_specs), mesh, impl),
                     static_argnames=statics, donate_argnames=("cache",), compiler_options=opts)
        _DP_FNS[key] = fn
    return fn


@functools.partial(jax.jit, static_argnums=(2,))
def _gather_slots(w, idx, sharding):
    return jax.lax.with_sharding_constraint(w[idx], sharding)


def _spec_of(x) -> P:
    sh = getattr(x, "sharding", None)
    return sh.spec if isinstance(sh, NamedSharding) else P()


class DPModelRunner(ModelRunner):
    """``ModelRunner`` over a mesh with ``dp > 1`` (module docstring). ``EngineConfig`` sizes
    (``max_num_seqs``, ``num_blocks``, ``max_num_batched_tokens``) are per rank."""

    places_experts = True

    def __init__(self, model_dir: str, ec, *, cfg=None, mesh, progress: bool = True, model_seed: int = 0):
        if mesh is None or "dp" not in mesh.shape:  # dp = 1 runs the DP program on one rank (its benchmark)
            raise ValueError(f"DPModelRunner: needs a mesh with a 'dp' axis, got {None if mesh is None else dict(mesh.shape)}")
        self.dp = int(mesh.shape["dp"])
        self.cp = int(mesh.shape.get("cp", 1))
        self.cp_split_steps = 0   # steps dispatched with their tokens split over cp
        if jax.process_count() > 1 and getattr(ec, "spec_decode", "off") == "dspark" and ec.spec_varlen:
            raise ValueError("EngineConfig.spec_varlen=True: on a multi-process mesh every process plans its "
                             "verification lengths from its own step-time measurements, so the plans would "
                             "differ between processes; use spec_varlen=False")
        super().__init__(model_dir, ec, cfg=cfg, mesh=mesh, progress=progress, model_seed=model_seed)
        self.ep_scheme = ec.ep_scheme
        self._plans_memo = None   # (plan, its per-rank plans) of the step being dispatched
        self.placement = None
        if ec.eplb_redundant_experts:
            self._init_eplb(ec.eplb_redundant_experts)
        leaf_specs = [_spec_of(x) for x in self.state_leaves]
        state_treedef = self.state_treedef
        self._dp_step = dp_step_function(self.graphdef, state_treedef, leaf_specs, mesh,
                                         batch_invariant=self.batch_invariant)
        rows = NamedSharding(mesh, DP)
        host = lambda tree: jax.tree.map(np.asarray, tree)  # host arrays: every process passes the same
        self.prev_sampled = jax.device_put(np.zeros((self.dp * self.num_rows,), np.int32), rows)
        if self.spec_slots:
            self._dp_spec_step = dp_step_function(self.graphdef, state_treedef, leaf_specs, mesh, spec=True,
                                                  batch_invariant=self.batch_invariant)
            self.spec_carry = jax.device_put(host(SpecCarry.empty(self.dp * ec.max_num_seqs, self.spec_slots)), rows)
        if self.engram_tables is not None:
            self.engram_tables = jax.device_put(host(self.engram_tables), NamedSharding(mesh, P()))
        self.gather_outputs = jax.process_count() > 1

    # ------------------------------------------------------------------ EPLB
    def _init_eplb(self, redundant: int) -> None:
        """Redundant experts: each backbone MoE layer's expert stacks become ``R = E + redundant``
        physical slots split over the mesh, slot ``r`` a copy of logical expert ``r mod E``; a
        window of per-step slot loads (``eplb_window`` steps) feeds ``rebalance()``."""
        cfg, ec = self.cfg, self.ec
        counts = {cfg.moe_experts(i)[0] for i in range(cfg.num_hidden_layers)}
        if len(counts) != 1:
            raise ValueError(f"EngineConfig.eplb_redundant_experts={redundant}: the MoE layers have different "
                             f"expert counts {sorted(counts)}")
        E = counts.pop()
        R, n = E + redundant, self.mesh.size
        if R % n:
            raise ValueError(f"EngineConfig.eplb_redundant_experts={redundant}: {E} experts + {redundant} = {R} "
                             f"physical slots must divide evenly over the {n} devices")
        self.eplb_sizes = (E, R)
        layers = tuple(range(cfg.num_hidden_layers))
        tree = jax.tree.unflatten(self.state_treedef, self.state_leaves)
        keys = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        # per placed layer (its row of the placement): the state leaves of its expert stacks
        self._expert_leaves = [[i for i, k in enumerate(keys) if k.startswith(f"['layers'][{l}]['ffn']['experts']")]
                               for l in layers]
        axes = split_axes("expert", self.mesh, R)
        self._slot_sharding = NamedSharding(self.mesh, P(manual.axis_name(axes)) if axes else P())
        initial = expert_replicas.initial_placement(len(layers), E, R, layers)
        self._move_experts(initial.phy2log_LR)   # the [E, ...] stacks: slot r takes expert r mod E
        self.placement = jax.device_put(initial, NamedSharding(self.mesh, P()))
        self._loads = collections.deque(maxlen=ec.eplb_window)   # per-step [L, R] device arrays
        self.rebalances = 0
        self._steps = 0           # steps dispatched (rebalance every eplb_interval)

    def _move_experts(self, src_LR) -> None:
        """Physical slot ``r`` of layer ``l`` takes the weights now in slot ``src_LR[l, r]`` (a
        gather over the mesh: weights move between devices, between steps, queued like a step)."""
        for row, leaves in enumerate(self._expert_leaves):
            idx = np.asarray(src_LR[row], np.int32)
            for i in leaves:
                self.state_leaves[i] = _gather_slots(self.state_leaves[i], idx, self._slot_sharding)

    def expert_load(self) -> np.ndarray:
        """int64 ``[L, R]``: entries per physical slot over the window (live tokens only)."""
        E, R = self.eplb_sizes
        self.drain()  # the launcher thread appends each step's loads
        if not self._loads:
            return np.zeros((len(self._expert_leaves), R), np.int64)
        return sum(np.asarray(x, np.int64) for x in jax.device_get(self._loads))

    def rank_load(self) -> np.ndarray:
        """int64 ``[L, devices]``: the window's entries per device (its ``R / n`` slots), per layer."""
        load = self.expert_load()
        return load.reshape(load.shape[0], self.mesh.size, -1).sum(-1)

    def rebalance(self) -> None:
        """EPLB over the window's loads (``sharding/eplb.py``): new placement, expert weights moved
        to their new slots. Outputs are unchanged (every replica holds its expert's weights)."""
        E, R = self.eplb_sizes
        load = self.expert_load()  # drains the launcher: no queued step reads the weights moved here
        old = jax.device_get(self.placement)
        logical = np.zeros((load.shape[0], E), np.int64)
        for l in range(load.shape[0]):
            np.add.at(logical[l], old.phy2log_LR[l], load[l])
        phy2log, log2phy, logcnt = rebalance_experts(logical, R, 1, 1, self.mesh.size, policy="global")
        # each new slot copies the old first replica of its expert (every expert has one)
        self._move_experts(np.take_along_axis(np.asarray(old.log2phy_LEK)[:, :, 0], np.asarray(phy2log), axis=1))
        layers = self.placement.layers
        self.placement = jax.device_put(expert_replicas.placement_arrays(phy2log, log2phy, logcnt, layers),
                                        NamedSharding(self.mesh, P()))
        self._loads.clear()
        self.rebalances += 1

    def _allocate_cache(self):
        cc = self.cache_config
        whole = CacheConfig(num_slots=self.dp * cc.num_slots, num_blocks=self.dp * cc.num_blocks,
                            block_tokens=cc.block_tokens, max_blocks_per_seq=cc.max_blocks_per_seq,
                            index_key_dtype=cc.index_key_dtype, kv_cache_dtype=cc.kv_cache_dtype,
                            spec_tokens=cc.spec_tokens)
        shape = jax.eval_shape(lambda: allocate_cache(self.cfg, whole))
        out = jax.tree.map(lambda _: NamedSharding(self.mesh, DP), shape)
        # made in place on every rank's devices (no whole copy on one device first)
        return jax.jit(lambda: allocate_cache(self.cfg, whole), out_shardings=out)()

    # ------------------------------------------------------------------ buckets
    def _rank_plans(self, sched) -> list[SchedulerOutput]:
        """``sched`` split into one plan per rank (local row indices, grammar masks renumbered);
        kept for the step being dispatched (buckets, inputs and row map all ask)."""
        memo = self._plans_memo
        if memo is not None and memo[0] is sched:
            return memo[1]
        plans = self._split(sched)
        self._plans_memo = (sched, plans)
        return plans

    def _split(self, sched) -> list[SchedulerOutput]:
        counts = sched.ranks if sched.ranks is not None else (len(sched.rows),) + (0,) * (self.dp - 1)
        if len(counts) != self.dp or sum(counts) != len(sched.rows):
            raise ValueError(f"DPModelRunner: plan of {len(sched.rows)} rows with ranks={sched.ranks}, "
                             f"expected {self.dp} ranks")
        plans, first = [], 0
        for n in counts:
            masks = None
            if sched.grammar_masks:
                masks = {i - first: m for i, m in sched.grammar_masks.items() if first <= i < first + n} or None
            plans.append(SchedulerOutput(sched.step_id, sched.rows[first:first + n], [], 0, [], grammar_masks=masks))
            first += n
        return plans

    def buckets_of(self, sched) -> tuple[int, int, int | None]:
        """The per-rank bucket: the largest any rank's rows need (every rank pads to it)."""
        plans = self._rank_plans(sched)
        T = max(pick_bucket(p.num_tokens, self.ec.token_buckets) for p in plans)
        R = max(pick_bucket(max(len(p.rows), 1), self.ec.row_buckets) for p in plans)
        Td = None
        if self.compact:
            need = max(max(p.num_decoder_tokens for p in plans), 1)
            Td = next((b for b in self.ec.decoder_buckets if need <= b < T), T)
        return T, R, Td

    # ------------------------------------------------------------------ steps
    def step_inputs(self, sched, T: int, R: int, Td: int | None):
        """Every rank's packed inputs at the per-rank bucket, stacked ``[dp, n]`` and split over ``dp``."""
        plans = self._rank_plans(sched)
        split = self.cp_splits(T)
        self.cp_split_steps += split
        common = dict(num_tokens=T, num_rows=R, num_decoder_tokens=Td, cache_config=self.cache_config,
                      hasher=self.hasher, vocab=self.cfg.vocab_size, prompt_lp=sched.wants_prompt_logprobs,
                      spec_slots=self.spec_slots, num_banned=banned_width(sched),
                      with_masks=bool(sched.grammar_masks), cp_devices=self.cp if split else None,
                      verify_slots=0 if sched.spec_plain else None)
        packed = [pack(build_step_input(p, **common)) for p in plans]
        layout = packed[0][1]
        bufs = tuple(np.stack([b[i] for b, _ in packed]) for i in range(len(packed[0][0])))
        if self.mesh.size == 1:  # one device: the jitted call transfers them as it does the plain step's
            return bufs, layout
        return jax.device_put(bufs, NamedSharding(self.mesh, DP)), layout

    def cp_splits(self, T: int) -> bool:
        """Whether a step of per-rank bucket ``T`` splits its tokens over the cp devices."""
        m = self.ec.cp_min_tokens
        return self.cp > 1 and m is not None and T >= m and T % self.cp == 0

    def step_call(self, bufs, layout, prompt_lp: bool):
        ec = self.ec
        kw = dict(layout=layout, scheme=self.ep_scheme, gather=self.gather_outputs, num_logprobs=ec.max_logprobs, prompt_lp=prompt_lp,
                  kernels=self.kernels, batch_invariant=self.batch_invariant)
        if self.spec_slots:
            fn, args = self._dp_spec_step, (self.state_leaves, self.cache, bufs, self.spec_carry, self.engram_tables)
            kw = dict(kw, spec_slots=self.spec_slots, rule=ec.spec_rule, force_accept=float(ec.spec_force_accept or 0.0))
        else:
            fn, args = self._dp_step, (self.state_leaves, self.cache, bufs, self.prev_sampled, self.engram_tables)
        if self.placement is None:
            return fn, args, kw

        def placed(*a, **k):  # the step with the expert placement; its loads go to the window
            cache, out, plp, carry, loads = fn(*a, self.placement, **k)
            self._loads.append(loads)
            return cache, out, plp, carry

        return placed, args, dict(kw, decoder_from=self.cfg.yoco_start_layer)

    def execute(self, sched):
        if self.placement is not None and self.ec.eplb_interval:
            self._steps += 1
            if self._steps % self.ec.eplb_interval == 0:
                self.rebalance()   # between steps: the weights move before this step runs
        return super().execute(sched)

    def row_map(self, sched, T: int, R: int):
        """Rank ``k``'s ``j``-th row is output row ``k*R + j``; its tokens start at ``k*T`` (the
        outputs are ``[dp * R, ...]``, gathered or split over ``dp``)."""
        if self.dp == 1:
            return super().row_map(sched, T, R)
        offsets, index = [], []
        for k, p in enumerate(self._rank_plans(sched)):
            off = 0
            for j, r in enumerate(p.rows):
                offsets.append(k * T + off)
                index.append(k * R + j)
                off += r.num_tokens
        return offsets, np.asarray(index, np.int64)
