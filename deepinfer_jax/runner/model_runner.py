"""Model runner: weights and cache on the device, bucketed jitted steps, async dispatch.

``execute(sched)`` pads a ``SchedulerOutput`` to its bucket, dispatches the jitted step (model
forward + on-device sampling) and returns at once with a ``StepHandle``; ``handle.fetch()``
waits for the results. The cache is donated to each step and the sampled ids of the last step
stay on the device, where the next step reads its placeholders from them.

Compiled variants: one per (token bucket, row bucket, decoder-token bucket in compact
truncation, with or without prompt logprobs). ``warmup()`` compiles every variant without prompt logprobs by
running padding-only steps (their cache writes are dropped).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from deepinfer_jax.base import batch_invariant as bi
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.interrupts import deferred_interrupts
from deepinfer_jax.kernels_pallas import ops
from deepinfer_jax.models.cache import CacheConfig, allocate_cache
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.runner.engram_hash_device import DeviceEngramTables, device_hash
from deepinfer_jax.runner.packed_input import PackedLayout, pack, unpack
from deepinfer_jax.runner.row_update import pad_rows
from deepinfer_jax.runner.spec_step import SpecCarry, SpecStepResult, spec_step_impl
from deepinfer_jax.runner.step_launcher import StepLauncher
from deepinfer_jax.runner.step_inputs import StepInput, build_step_input, pick_bucket
from deepinfer_jax.sampling.sampler import SamplingReuse, prompt_logprobs, sample

_token_ids = operator.attrgetter("token_ids")


def _step_impl(graphdef, state_treedef, state_leaves, cache, inp: StepInput, prev_sampled_R, engram_tables, *,
               num_logprobs: int, prompt_lp: bool, kernels: str, batch_invariant: bool = False):
    # ops pick kernels and numerics at trace time; ``kernels`` and ``batch_invariant`` key the compile cache
    with ops.use_backend(kernels), bi.use(batch_invariant):
        return _step_body(graphdef, state_treedef, state_leaves, cache, inp, prev_sampled_R, engram_tables,
                          num_logprobs, prompt_lp)


def _step_body(graphdef, state_treedef, state_leaves, cache, inp: StepInput, prev_sampled_R, engram_tables,
               num_logprobs: int, prompt_lp: bool):
    b = inp.batch
    is_ph = inp.prev_row >= 0
    tok = jnp.where(is_ph, prev_sampled_R[jnp.maximum(inp.prev_row, 0)], b.token_ids)
    eids = b.engram_ids
    if engram_tables is not None:
        dev = device_hash(engram_tables, tok, inp.engram_partials)
        eids = jnp.where(is_ph[:, None, None], dev, eids)
    b = dataclasses.replace(b, token_ids=tok, engram_ids=eids)
    model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, state_leaves))
    cache, logits, _ = model(cache, b)
    R = inp.sampling.temperature.shape[0]
    out = sample(logits[:R], inp.sampling, num_logprobs, inp.allowed_RW, batch_invariant=bi.enabled())
    # the next step's placeholders index this step's rows: keep a fixed-size copy
    sampled_full = pad_rows(out.token_ids, prev_sampled_R.shape[0])
    plp = prompt_logprobs(logits[R:], inp.prompt_targets, num_logprobs) if prompt_lp else None
    return cache, out, plp, sampled_full


def _with_packed_input(impl, graphdef, state_treedef, state_leaves, cache, inp_bufs, *args,
                       layout: PackedLayout, **kw):
    """``impl`` with its ``StepInput`` rebuilt from the packed buffers (runner/packed_input.py)."""
    return impl(graphdef, state_treedef, state_leaves, cache, unpack(inp_bufs, layout), *args, **kw)


_STEP_FNS: dict = {}


def step_function(graphdef, state_treedef, spec: bool = False, batch_invariant: bool = False):
    """The jitted step of one model structure. The graphdef and the state's tree structure are
    closed over (hashed once here, not at every call) and the weights travel as a flat list of
    arrays: per-call dispatch cost stays independent of the model's module tree. Runners of
    equal models share the function and so its compiled buckets; the kernel choice is a static
    argument, so runners that differ in it compile (and run) their own. Batch-invariant steps
    are their own function: they compile with ``batch_invariant.compiler_options`` (on the GPU,
    no GEMM autotuning)."""
    key = (graphdef, state_treedef, spec, batch_invariant)
    fn = _STEP_FNS.get(key)
    if fn is None:
        opts = bi.compiler_options(jax.default_backend()) if batch_invariant else None
        if spec:  # runner/spec_step.py: verify, roll back, draft
            fn = jax.jit(functools.partial(_with_packed_input, spec_step_impl, graphdef, state_treedef),
                         static_argnames=("layout", "num_logprobs", "prompt_lp", "kernels", "spec_slots", "rule", "force_accept",
                                          "batch_invariant"),
                         donate_argnames=("cache",), compiler_options=opts)
        else:
            fn = jax.jit(functools.partial(_with_packed_input, _step_impl, graphdef, state_treedef),
                         static_argnames=("layout", "num_logprobs", "prompt_lp", "kernels", "batch_invariant"),
                         donate_argnames=("cache",), compiler_options=opts)
        _STEP_FNS[key] = fn
    return fn


@dataclasses.dataclass
class StepResult:
    """Host copies of one step's outputs (rows as in the step's ``SchedulerOutput``)."""

    token_ids: np.ndarray      # int32 [R]
    logprob: np.ndarray        # f32 [R]
    top_ids: np.ndarray        # int32 [R, N]
    top_logprobs: np.ndarray   # f32 [R, N]
    prompt_target_lp: np.ndarray | None   # f32 [T]
    prompt_top_ids: np.ndarray | None     # int32 [T, N]
    prompt_top_lp: np.ndarray | None      # f32 [T, N]
    token_offsets: list[int]   # flat token offset of each row


class StepHandle:
    """A dispatched step: its plan, padded size, dispatch time and (after ``fetch``) done time."""

    def __init__(self, sched, out, plp, offsets, t_dispatch: float, bucket_tokens: int, spec: bool = False,
                 row_index=None):
        """``row_index``: the output row of each of the plan's rows (attention DP: rank ``k``'s
        ``j``-th row is row ``k*R + j``); ``None``: row ``i`` is row ``i``. ``out`` is None
        while the call runs on the launcher thread (``launched`` then sets it)."""
        self.sched, self._offsets = sched, offsets
        self._row_index = row_index
        self.spec = spec
        self.t_dispatch, self.bucket_tokens = t_dispatch, bucket_tokens
        self.t_done: float | None = None
        self.host_time = 0.0  # the engine's planning + input building + dispatch time
        self.schedule_time = 0.0  # the engine's planning (set by the engine)
        self.inputs_time = 0.0    # build_step_input
        self.call_time = 0.0      # the jitted call on the engine's thread (it starts at t_dispatch)
        self.launch_time = 0.0    # the jitted call on the launcher thread (dispatch_thread)
        self.future = None        # the launcher thread's call (dispatch_thread)
        self._out = self._plp = None
        if out is not None:
            self.launched(out, plp)

    def launched(self, out, plp) -> None:
        """The step's device outputs, their copies to the host started."""
        self._out, self._plp = out, plp
        for a in jax.tree.leaves((out, plp)):
            a.copy_to_host_async()

    def fetch(self) -> StepResult | SpecStepResult:
        if self.future is not None:
            self.future.result()  # the call itself (its error, if it failed, is raised here)
        o = jax.device_get(self._out)
        p = jax.device_get(self._plp) if self._plp is not None else (None, None, None)
        self.t_done = time.perf_counter()
        if self._row_index is not None:
            o = jax.tree.map(lambda a: np.asarray(a)[self._row_index], o)
        if self.spec:
            return SpecStepResult(*(np.asarray(x) for x in (o.num_accepted, o.token_ids, o.logprob, o.top_ids,
                                                            o.top_logprobs, o.draft_ids, o.draft_conf)),
                                  *p, self._offsets)
        return StepResult(np.asarray(o.token_ids), np.asarray(o.logprob), np.asarray(o.top_ids),
                          np.asarray(o.top_logprobs), *p, self._offsets)


class ModelRunner:
    dp = 1  # attention data-parallel ranks (runner/dp_runner.py)
    places_experts = False  # redundant expert slots (EPLB): the DP runner's

    def __init__(self, model_dir: str, ec, *, cfg: ModelConfig | None = None, mesh=None, progress: bool = True,
                 model_seed: int = 0):
        """``ec``: a resolved ``EngineConfig``. ``model_seed``: the random weights of
        ``ec.load_format="dummy"`` (the checkpoint's weights are read otherwise)."""
        if getattr(ec, "eplb_redundant_experts", 0) and not self.places_experts:
            raise ValueError(f"EngineConfig.eplb_redundant_experts={ec.eplb_redundant_experts}: redundant experts "
                             "need the DP runner (runner/dp_runner.py; LLM picks it)")
        self._init_host(model_dir, ec, cfg or ModelConfig.from_json(model_dir), mesh)
        if getattr(ec, "load_format", "auto") == "dummy":
            from deepinfer_jax.models.random_weights import random_model_on_device

            model = random_model_on_device(self.cfg, model_seed, mesh=mesh)
        else:
            from deepinfer_jax.models.weights import load_model

            model = load_model(model_dir, self.cfg, mesh=mesh, progress=progress)
        self.graphdef, state = nnx.split(model)
        self.state_leaves, state_treedef = jax.tree.flatten(state)
        self.state_treedef = state_treedef
        self._step = step_function(self.graphdef, state_treedef, batch_invariant=self.batch_invariant)
        if self.spec_slots:
            self._spec_step = step_function(self.graphdef, state_treedef, spec=True,
                                            batch_invariant=self.batch_invariant)
            self.spec_carry = self._committed(SpecCarry.empty(ec.max_num_seqs, self.spec_slots))
        self.cache = self._allocate_cache()
        self.engram_tables = None
        if self.hasher is not None:
            self.engram_tables = jax.device_put(DeviceEngramTables.from_hasher(self.hasher))
        self.prev_sampled = self._committed(jnp.zeros((self.num_rows,), jnp.int32))

    def _init_host(self, model_dir: str, ec, cfg: ModelConfig, mesh) -> None:
        """The runner's host-side state: what building step inputs, picking buckets and
        dispatching read (no weights, no device arrays; ``scripts/bench_host_path.py`` runs on
        this alone)."""
        self.ec, self.mesh, self.cfg = ec, mesh, cfg
        self.kernels = ec.kernels or ops.default_backend()  # this runner's choice, not the process's
        self.batch_invariant = ec.batch_invariant  # base/batch_invariant.py
        # ops that shard_map a kernel read the context mesh at trace time (moe_ep.py); without a
        # mesh the step runs on one device, said with a one-device mesh so that a multi-GPU host
        # keeps its kernels (several devices and no mesh would make them fall back)
        self.trace_mesh = mesh if mesh is not None else jax.sharding.Mesh(
            np.asarray(jax.devices()[:1]).reshape(1, 1), ("dp", "cp"))
        # speculative decoding: verification rows of 1 + spec_slots tokens (0 = off)
        self.spec_slots = ec.num_draft_tokens if getattr(ec, "spec_decode", "off") == "dspark" else 0
        # and plain steps of the same program (SchedulerOutput.spec_plain): a second variant set
        self.spec_plain = bool(self.spec_slots and getattr(ec, "spec_plain_steps", False))
        self.cache_config = CacheConfig(num_slots=ec.max_num_seqs, num_blocks=ec.num_blocks,
                                        block_tokens=ec.block_tokens, max_blocks_per_seq=ec.blocks_per_seq,
                                        index_key_dtype=ec.index_key_dtype, kv_cache_dtype=ec.kv_cache_dtype,
                                        spec_tokens=self.spec_slots)
        self.hasher = None
        if cfg.engram_enabled:
            tok = os.path.join(model_dir, "tokenizer.json")
            self.hasher = EngramHasher.from_model_config(cfg, tok if os.path.exists(tok) else None)
        # tokens before each row's start that the scheduler puts in the row (the n-gram look-back)
        self.history_tokens = self.hasher.max_ngram_size - 1 if self.hasher is not None else 0
        self.num_rows = ec.max_num_seqs
        self._sampling_reuse = SamplingReuse()  # sampling arrays kept between steps (step_inputs)
        self.compact = ec.yoco_truncation == "compact" and cfg.yoco_start_layer < cfg.num_hidden_layers
        self.bucket_seconds: dict[int, float] = {}  # profile_buckets(): step seconds per token bucket
        self.plain_bucket_seconds: dict[int, float] = {}  # the same for plain steps (spec_plain)
        # dispatch_thread: the jitted calls run on their own thread (runner/step_launcher.py)
        self.launcher = StepLauncher() if getattr(ec, "dispatch_thread", False) else None

    def _allocate_cache(self):
        cache = allocate_cache(self.cfg, self.cache_config)
        if self.mesh is not None:
            from deepinfer_jax.sharding.partition import shard_cache

            return shard_cache(cache, self.mesh)
        return self._committed(cache)

    def _committed(self, tree):
        """``tree`` placed on the step's devices: the arrays the step carries (cache, sampled
        ids, speculation carry) are committed outputs after the first step, and jit keys its
        cache on committed vs not, so uncommitted initial arrays would compile every step
        variant's first call twice. Without a mesh they are placed on the one-device trace
        mesh, as the step's outputs are (the step runs under it): so the first call of a variant
        shares the jit cache key of every later one (and a variant compiled ahead, before any
        step ran, is the one the steps call)."""
        mesh = self.mesh if self.mesh is not None else self.trace_mesh
        return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def kernel_fallbacks(self) -> dict[str, int]:
        """Ops whose kernel ran the jnp reference in a trace ("op: reason" -> traced calls; the
        process's count: compiled steps are shared between runners of equal models)."""
        return {} if self.kernels == "reference" else ops.fallback_counts()

    # ------------------------------------------------------------------ buckets
    def buckets_of(self, sched) -> tuple[int, int, int | None]:
        """(tokens T, rows R, decoder tokens T' or None) of the step's padded shape."""
        T = pick_bucket(sched.num_tokens, self.ec.token_buckets)
        R = pick_bucket(max(sched.num_rows, 1), self.ec.row_buckets)
        Td = None
        if self.compact:  # the smallest decoder bucket that holds them, else the whole step
            need = max(sched.num_decoder_tokens, 1)
            Td = next((b for b in self.ec.decoder_buckets if need <= b < T), T)
        return T, R, Td

    def variants(self) -> list[tuple[int, int, int | None]]:
        out = []
        for T in self.ec.token_buckets:
            for R in self.ec.row_buckets:
                if R > T:
                    continue
                if self.compact:
                    out += [(T, R, Td) for Td in self.ec.decoder_buckets if Td < T] + [(T, R, T)]
                else:
                    out.append((T, R, None))
        return out

    # ------------------------------------------------------------------ steps
    def step_inputs(self, sched, T: int, R: int, Td: int | None):
        """The step's packed input buffers and their static layout at bucket ``(T, R, Td)``."""
        inp = build_step_input(sched, num_tokens=T, num_rows=R, num_decoder_tokens=Td,
                               cache_config=self.cache_config, hasher=self.hasher, vocab=self.cfg.vocab_size,
                               prompt_lp=sched.wants_prompt_logprobs, spec_slots=self.spec_slots,
                               verify_slots=0 if sched.spec_plain else None, reuse=self._sampling_reuse)
        return pack(inp)  # a few transfers instead of one per array

    def step_call(self, bufs, layout, prompt_lp: bool):
        """``(jitted step, args, kwargs)`` of one step on these inputs; the step returns
        ``(cache, outputs, prompt logprobs, carry)``, the carry being the speculation state
        (spec steps) or the sampled ids the next step reads its placeholders from."""
        ec = self.ec
        if self.spec_slots:
            return self._spec_step, (self.state_leaves, self.cache, bufs, self.spec_carry, self.engram_tables), dict(
                layout=layout, num_logprobs=ec.max_logprobs, prompt_lp=prompt_lp, kernels=self.kernels,
                spec_slots=self.spec_slots, rule=ec.spec_rule, force_accept=float(ec.spec_force_accept or 0.0),
                batch_invariant=self.batch_invariant)
        return self._step, (self.state_leaves, self.cache, bufs, self.prev_sampled, self.engram_tables), dict(
            layout=layout, num_logprobs=ec.max_logprobs, prompt_lp=prompt_lp, kernels=self.kernels,
            batch_invariant=self.batch_invariant)

    def row_map(self, sched, T: int, R: int):
        """(flat token offset of each row in the step's outputs, output row of each row or None)."""
        n = len(sched.decode) if sched.decode is not None else 0  # one token each
        offsets = list(itertools.accumulate(map(len, map(_token_ids, sched.tail_rows)), initial=n))
        offsets.pop()
        return list(range(n)) + offsets if n else offsets, None

    def _dispatch(self, sched, T: int, R: int, Td: int | None):
        t_in = time.perf_counter()
        bufs, layout = self.step_inputs(sched, T, R, Td)
        t0 = time.perf_counter()
        offsets, row_index = self.row_map(sched, T, R)
        handle = StepHandle(sched, None, None, offsets, t0, T, spec=bool(self.spec_slots), row_index=row_index)
        handle.inputs_time = t0 - t_in
        if self.launcher is None:
            self._launch(handle, bufs, layout, sched.wants_prompt_logprobs)
        else:
            handle.future = self.launcher.submit(self._launch, handle, bufs, layout, sched.wants_prompt_logprobs)
        handle.call_time = time.perf_counter() - t0
        return handle

    def _launch(self, handle: StepHandle, bufs, layout, prompt_lp: bool) -> None:
        """The jitted call of one step (on the engine's thread, or the launcher's)."""
        t0 = time.perf_counter()
        fn, args, kw = self.step_call(bufs, layout, prompt_lp)
        # traced with the context mesh: ops that shard_map a kernel (moe_ep.py) read it there;
        # plain GSPMD code is unaffected (the mesh axes are Auto). The step consumes the donated
        # cache: a KeyboardInterrupt between the call and the store would leave ``self.cache``
        # deleted, so SIGINT is held until both are done (signals reach the main thread only)
        with jax.set_mesh(self.trace_mesh), deferred_interrupts():
            self.cache, out, plp, carry = fn(*args, **kw)
            if self.spec_slots:
                self.spec_carry = carry
            else:
                self.prev_sampled = carry
        handle.launched(out, plp)
        handle.launch_time = time.perf_counter() - t0

    def drain(self) -> None:
        """Wait for the steps queued on the launcher thread (``dispatch_thread``): afterwards
        the cache and carried arrays on the runner are the newest step's."""
        if self.launcher is not None:
            self.launcher.drain()

    def execute(self, sched) -> StepHandle:
        """Dispatch one step without waiting for it."""
        return self._dispatch(sched, *self.buckets_of(sched))

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket variant (prompt logprobs excluded; verification and plain steps
        with ``spec_plain``); returns seconds spent."""
        t0 = time.perf_counter()
        variants = [(v, plain) for plain in self.step_kinds() for v in self.variants()]
        workers = compile_workers(self.ec, len(variants))
        compiled = workers > 1 and self.compile_parallel(variants, workers, progress)
        for v, plain in tqdm(variants, desc="first runs" if compiled else "compiling steps", disable=not progress):
            h = self._dispatch(_empty_step(plain), *v)
            h.fetch()
        if self.spec_slots:
            self.profile_buckets()
        return time.perf_counter() - t0

    def compile_parallel(self, variants, workers: int, progress: bool = True) -> bool:
        """Trace and lower each ``(bucket, plain)`` variant on this thread (Python), then let XLA
        compile them on ``workers`` threads at once (XLA's compile releases the GIL). The
        executables stay with the jitted function: its first call of each variant compiles
        nothing. False (nothing done) where the step is not a plain jitted function."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        lowered = []
        for v, plain in tqdm(variants, desc="lowering steps", disable=not progress):
            sched = _empty_step(plain)
            bufs, layout = self.step_inputs(sched, *v)
            fn, args, kw = self.step_call(bufs, layout, sched.wants_prompt_logprobs)
            if not hasattr(fn, "lower"):
                return False
            with jax.set_mesh(self.trace_mesh):
                lowered.append(fn.lower(*args, **kw))
        with ThreadPoolExecutor(workers, thread_name_prefix="xla-compile") as pool:
            futures = [pool.submit(low.compile) for low in lowered]
            for f in tqdm(as_completed(futures), total=len(futures), desc=f"compiling steps ({workers} threads)",
                          disable=not progress):
                f.result()
        return True

    def step_kinds(self) -> tuple[bool, ...]:
        """The ``spec_plain`` values this runner's steps take: (False,), or (False, True) with
        plain steps beside verification steps."""
        return (False, True) if self.spec_plain else (False,)

    def profile_buckets(self, repeats: int = 2, max_repeats: int = 8, budget_s: float = 0.05) -> dict[int, float]:
        """Seconds of one (padding-only) step at each token bucket, the fastest of ``repeats``
        runs (after warm-up's first run), and of up to ``max_repeats`` while a bucket has taken
        less than ``budget_s`` (millisecond GPU steps get more runs against launch jitter, slow
        CPU steps no more start-up time), of its compiled variant with the most rows: the start-up curve of the varlen
        planner's SPS (speculative decoding). Stored as ``bucket_seconds``, and the plain steps'
        curve (``spec_plain``) as ``plain_bucket_seconds``."""
        for plain in self.step_kinds():
            out = {}
            for T in self.ec.token_buckets:
                vs = [v for v in self.variants() if v[0] == T]
                if not vs:
                    continue
                v = max(vs, key=lambda v: (v[1], v[2] or 0))
                best, spent, n = float("inf"), 0.0, 0
                while n < repeats or (n < max_repeats and spent < budget_s):
                    h = self._dispatch(_empty_step(plain), *v)
                    h.fetch()
                    best = min(best, h.t_done - h.t_dispatch)
                    spent += h.t_done - h.t_dispatch
                    n += 1
                out[T] = best
            if plain:
                self.plain_bucket_seconds = out
            else:
                self.bucket_seconds = out
        return self.bucket_seconds


def compile_workers(ec, num_variants: int) -> int:
    """Threads that compile the step variants at start-up: ``EngineConfig.compile_workers``, or
    by default half this host's cores, at most one per variant."""
    n = getattr(ec, "compile_workers", None)
    if n is None:
        n = max(1, (os.cpu_count() or 1) // 2)
    return max(1, min(n, num_variants))


def _empty_step(plain: bool = False):
    """A padding-only plan (warm-up and profiling: its cache writes are dropped)."""
    from deepinfer_jax.base.scheduler_output import SchedulerOutput

    return SchedulerOutput(step_id=-1, rows=[], preempted=[], cache_hit_tokens=0, queue_wait=[], spec_plain=plain)
