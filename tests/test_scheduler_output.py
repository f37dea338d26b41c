"""The scheduler's output is plain data (ARCHITECTURE: it can cross a process boundary): it holds
no ``Request``, survives ``pickle``, and the runner builds the same step inputs from a pickled
copy as from the original, with Engram ids equal to hashing each request's full history."""

from __future__ import annotations

import dataclasses
import pickle
import time

import numpy as np

from deepinfer_jax.config import preset
from deepinfer_jax.engine.llm_engine import LLMEngine
from deepinfer_jax.engine_config import EngineConfig
from deepinfer_jax.base.scheduler_output import DecodeColumns
from deepinfer_jax.host_scheduler.scheduler import ScheduledRow, SchedulerOutput
from deepinfer_jax.sampling.params import SamplingParams

CFG = preset("v41-tiny")
PLAIN = (int, float, str, bool, type(None))


def walk(obj, path="sched"):
    """Every value reachable through dataclass fields, lists, tuples and dicts is plain."""
    if isinstance(obj, PLAIN):
        return
    if isinstance(obj, np.ndarray):  # the decode columns' arrays: numbers only
        assert obj.dtype.kind in "iub", f"{path} is an array of {obj.dtype}"
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            walk(v, f"{path}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            walk(k, f"{path}.key")
            walk(v, f"{path}[{k!r}]")
        return
    assert isinstance(obj, (SchedulerOutput, ScheduledRow, DecodeColumns, SamplingParams)), \
        f"{path} is a {type(obj).__name__}, not plain data"
    for f in dataclasses.fields(obj):
        walk(getattr(obj, f.name), f"{path}.{f.name}")


class _Result:
    def __init__(self, sched, R, N, T):
        toks = np.zeros(R, np.int32)
        for i, r in enumerate(sched.rows):
            toks[i] = 3 + (31 * r.sample_position + 7 * i) % 200  # any id (there is no EOS)
        self.token_ids, self.logprob = toks, np.full(R, -1.0, np.float32)
        self.top_ids, self.top_logprobs = np.zeros((R, N), np.int32), np.zeros((R, N), np.float32)
        self.prompt_target_lp = np.full(T, -2.0, np.float32)
        self.prompt_top_ids, self.prompt_top_lp = np.zeros((T, N), np.int32), np.zeros((T, N), np.float32)
        self.token_offsets = [int(o) for o in np.cumsum([0] + [r.num_tokens for r in sched.rows])[:-1]]


class _Handle:
    def __init__(self, sched, res):
        self.sched, self._res = sched, res
        self.t_dispatch, self.t_done, self.bucket_tokens = time.perf_counter(), None, 64
        self.inputs_time = self.call_time = 0.0  # the runner's host-time split (StepHandle)

    def fetch(self):
        self.t_done = time.perf_counter()
        return self._res


class RecordingRunner:
    """Fake device: records each plan (and a pickled copy) and samples arbitrary ids."""

    history_tokens = CFG.engram_max_ngram_size - 1

    def __init__(self, ec):
        self.ec, self.plans = ec, []

    def execute(self, sched):
        self.plans.append((sched, pickle.dumps(sched)))
        return _Handle(sched, _Result(sched, self.ec.max_num_seqs, self.ec.max_logprobs, sched.num_tokens))


def test_scheduler_output_is_plain_data_and_builds_identical_step_inputs():
    import jax

    from deepinfer_jax.models.cache import CacheConfig
    from deepinfer_jax.runner.engram_hash import EngramHasher
    from deepinfer_jax.runner.step_inputs import build_step_input

    ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_tokens=16, max_logprobs=2,
                      prefix_replay_tokens=16, precompile=False).resolve(CFG)
    runner = RecordingRunner(ec)
    eng = LLMEngine(runner, ec, eos_token_id=None)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 250, size=70).tolist()
    prompts = {f"r{i}": shared + rng.integers(3, 250, size=int(rng.integers(5, 60))).tolist() for i in range(5)}
    prompts["plp"] = rng.integers(3, 250, size=90).tolist()
    kinds = {"r1": dict(min_tokens=4, stop_token_ids=[7]), "plp": dict(prompt_logprobs=2), "r3": dict(n=2)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=1,
                                               **kinds.get(rid, {})).validate())
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step()})
    assert set(outs) == set(prompts)
    rows = [r for s, _ in runner.plans for r in s.rows]
    # the workload covers every row kind the runner reads
    assert any(r.prev_row >= 0 for r in rows) and any(r.banned for r in rows)
    assert any(r.prompt_targets for r in rows) and any(r.floor > 0 for r in rows)
    assert any(r.is_prefill and r.start > 0 for r in rows)

    hasher = EngramHasher.from_model_config(CFG, token_map=np.arange(CFG.vocab_size) % CFG.engram_compressed_vocab_size)
    cc = CacheConfig(num_slots=ec.max_num_seqs, num_blocks=ec.num_blocks, block_tokens=ec.block_tokens,
                     max_blocks_per_seq=ec.blocks_per_seq)
    full = {}
    for o in outs.values():
        for c in o.outputs:
            rid = o.request_id if len(o.outputs) == 1 else f"{o.request_id}#{c.index}"
            full[rid] = np.asarray(o.prompt_token_ids + c.token_ids, np.int64)

    def build(sched):
        return build_step_input(sched, num_tokens=64, num_rows=ec.max_num_seqs, num_decoder_tokens=None,
                                cache_config=cc, hasher=hasher, vocab=CFG.vocab_size,
                                prompt_lp=sched.wants_prompt_logprobs)

    for sched, blob in runner.plans:
        walk(sched)
        copy = pickle.loads(blob)
        assert copy == sched
        a, b = build(sched), build(copy)
        la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
        assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
        for x, y in zip(la, lb):
            assert np.array_equal(np.asarray(x), np.asarray(y))
        # the history window in each row hashes like the request's whole history
        eids, o = np.asarray(a.batch.engram_ids), 0
        for r in sched.rows:
            known = r.num_tokens - (1 if r.prev_row >= 0 else 0)
            pos = np.arange(r.start, r.start + known)
            if known:
                assert np.array_equal(eids[o:o + known], hasher.hash_positions(full[r.request_id], pos))
            o += r.num_tokens


def test_packed_input_round_trips_every_leaf():
    """The runner ships a step's input arrays as one buffer per dtype (runner/packed_input.py):
    unpacked inside jit, every leaf comes back with its shape, dtype and bits; None leaves stay None."""
    import jax

    from deepinfer_jax.runner.packed_input import pack, unpack

    rng = np.random.default_rng()
    tree = {"a": rng.integers(-9, 9, (3, 5)).astype(np.int32), "b": rng.random(7).astype(np.float32),
            "c": rng.random((2, 2)) > 0.5, "d": None, "e": [rng.integers(0, 2**32, (4, 2), dtype=np.uint32),
                                                             rng.integers(-9, 9, 11).astype(np.int32)],
            "f": np.zeros((0, 3), np.int32)}
    bufs, layout = pack(tree)
    assert len(bufs) == 4  # int32, float32, bool, uint32
    got = jax.jit(unpack, static_argnums=1)(bufs, layout)
    want_leaves, want_def = jax.tree.flatten(tree)
    got_leaves, got_def = jax.tree.flatten(got)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), w)
    assert hash(layout) == hash(pack(tree)[1])  # a static argument: equal layouts hit one compile


def test_add_tokens_equals_add_token_one_by_one():
    """A verification row's emitted tokens applied at once (``OutputProcessor.add_tokens``) end
    the request exactly where ``add_token`` per token does: at EOS, a stop token id, max_tokens
    or max_model_len, whichever token comes first, with the same outputs, status and
    stop_reason. Random rows of 1-6 tokens over a small id range, so stops are frequent."""
    from deepinfer_jax.engine.output_processor import OutputProcessor
    from deepinfer_jax.host_scheduler.request import Request

    rng = np.random.default_rng(3)
    proc = OutputProcessor(None, max_model_len=40)
    statuses = set()
    for case in range(600):
        params = SamplingParams(max_tokens=int(rng.integers(1, 30)), ignore_eos=bool(case % 5 == 0),
                                stop_token_ids=[int(t) for t in rng.choice(12, int(rng.integers(0, 3)), replace=False)])
        prompt = list(range(int(rng.integers(1, 20))))
        done = [int(t) for t in rng.integers(0, 12, int(rng.integers(0, 12)))]
        states = []
        for _ in range(2):
            req = Request("r", prompt, params, seed=0, eos_token_id=7)
            req.output_token_ids = list(done)
            states.append(proc.new_state(req, "r", 0))
        tokens = [int(t) for t in rng.integers(0, 12, int(rng.integers(1, 7)))]
        lps = [float(x) for x in -rng.random(len(tokens))]
        n, status = proc.add_tokens(states[0], tokens, lps)
        ref_status, m = None, 0
        while ref_status is None and m < len(tokens):
            ref_status = proc.add_token(states[1], tokens[m], lps[m], None, None)
            m += 1
        a, b = states[0].request, states[1].request
        assert (n, status) == (m, ref_status), (case, tokens, params.stop_token_ids, params.max_tokens)
        assert a.output_token_ids == b.output_token_ids and a.stop_reason == b.stop_reason
        assert states[0].cumulative_logprob == states[1].cumulative_logprob
        statuses.add(status)
    assert len(statuses) == 3  # running on, stopped and length all occurred
