"""LLMEngine: requests in, ``RequestOutput``s out, one ``step()`` at a time.

One round of ``step()`` (FEATURES §3), asynchronous by default:

1. ``Scheduler.schedule()`` plans step N from what the host knows; decode tokens sampled by the
   in-flight step N-1 enter as placeholders.
2. ``ModelRunner.execute()`` dispatches step N (forward + sampling) and returns at once.
3. The results of step N-1 are fetched and processed (detokenize, stop checks, logprobs, free
   finished requests) while step N runs.

With ``async_scheduling=False`` step N's results are processed in the same round, before step
N+1 is planned. Both orders produce identical tokens: sampling is seeded per (request seed,
position), and each dispatched step computes the same rows either way. A sample of a request
that finished (or was preempted) in the meantime is dropped; the pairing of a result with its
request is the row's request id and ``epoch`` (unique per admission: see the scheduler); rows
are plain data, so the engine looks the request up by id.

Every request is checked on the way in (``input_checks.py``); a batch is queued whole or not at
all. Planning, result processing and request bookkeeping run with SIGINT held
(``interrupts.py``), so an interrupt lands between them and ``abort_all()`` can always bring the
engine back to empty. A step's sampled logprob that is not finite (NaN weights, overflow)
raises ``RuntimeError`` before any of that step's results is applied.

Structured output (FEATURES §8): requests with a grammar are compiled in ``check_requests``
(xgrammar, in a thread pool, cached; a grammar that does not compile raises ``ValueError``
naming the request before anything is queued). Each sample gets a ``GrammarState``; its next
bitmask rows are filled when a step's results are applied (with async scheduling, while the next
step runs on the device) and handed to the runner with the plan. A grammar request is planned
only when none of its rows is in flight (the scheduler's sync point), so its mask always follows
its newest token; other requests keep the asynchronous overlap.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Sequence

import numpy as np

from deepinfer_jax.engine import input_checks
from deepinfer_jax.engine.output_processor import OutputProcessor, RequestState
from deepinfer_jax.engine.outputs import RequestOutput
from deepinfer_jax.engine.stats import StatsLogger, StepStats
from deepinfer_jax.host_scheduler.request import Request, RequestStatus
from deepinfer_jax.host_scheduler.scheduler import Scheduler
from deepinfer_jax.interrupts import deferred_interrupts

_MASK63 = (1 << 63) - 1


def child_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request with ``n > 1`` (sample 0 keeps the request seed)."""
    if index == 0:
        return seed
    x = (seed + 0x9E3779B97F4A7C15 * index) & ((1 << 64) - 1)  # splitmix64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


@dataclasses.dataclass
class CheckedRequest:
    """A request that passed the input checks, ready to queue."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: Any  # SamplingParams, validated
    compiled_grammar: Any = None  # xgrammar CompiledGrammar of params.grammar, if any


class LLMEngine:
    def __init__(self, runner, ec, tokenizer=None, eos_token_id: int | None = None,
                 vocab_size: int | None = None, tokenizer_json: str | None = None):
        """``runner``: a ``ModelRunner`` (or anything with ``execute(sched) -> handle``);
        ``ec``: the resolved ``EngineConfig``; ``vocab_size`` bounds prompt and stop token ids
        (default: the runner's model config, if it has one); ``tokenizer_json``: the vocabulary
        that structured output compiles grammars against (needed only for such requests)."""
        self.runner, self.ec, self.tokenizer = runner, ec, tokenizer
        self.eos_token_id = eos_token_id
        cfg = getattr(runner, "cfg", None)
        self.vocab_size = vocab_size if vocab_size is not None else getattr(cfg, "vocab_size", None)
        dp = getattr(runner, "dp", 1)
        if dp > 1:  # attention data parallel: a scheduler per rank (host_scheduler/dp_scheduler.py)
            from deepinfer_jax.host_scheduler.dp_scheduler import DPScheduler

            self.scheduler = DPScheduler(ec, dp, history_tokens=getattr(runner, "history_tokens", 0))
        else:
            self.scheduler = Scheduler(ec, history_tokens=getattr(runner, "history_tokens", 0))
        self.outputs = OutputProcessor(tokenizer, ec.max_model_len)
        self.stats = StatsLogger()
        self._states: dict[str, RequestState] = {}
        self._groups: dict[str, list[RequestState]] = {}
        self._prompts: dict[str, str | None] = {}
        self._inflight = None
        # set from planning a step until its dispatch returned: if that is cut short, blocks the
        # scheduler handed to the prefix cache were never written (abort_all resets the cache)
        self._undispatched = False
        self._rng = np.random.default_rng(ec.seed)
        # structured output: the compiler (created on the first grammar request) and the
        # per-sample grammar states, by request id
        self.tokenizer_json = tokenizer_json
        self._grammar_compiler = None
        self._grammars: dict = {}
        self.grammar_fill_s = 0.0   # host seconds spent filling bitmask rows (after results)
        self.grammar_plan_s = 0.0   # host seconds spent handing them to the plan (before dispatch)
        # speculative decoding (FEATURES §4); with async scheduling the next verification row
        # is planned before this step's accept counts are known and corrected on the device
        self.spec = getattr(ec, "spec_decode", "off") == "dspark"
        self.forward_estimator = None
        self.plain_estimator = None  # plain steps' forward time (EngineConfig.spec_plain_steps)
        self._sps_memos: list[dict] = []  # cleared when an estimator learns a step time
        self._prev_done = 0.0  # when the newest processed step's results arrived
        if self.spec and ec.spec_varlen and getattr(runner, "bucket_seconds", None):
            est = self.forward_estimator = self._bucket_estimator(runner.bucket_seconds)
            self.scheduler.spec_sps = self._bucket_sps(est, ec.token_buckets)
            if getattr(runner, "plain_bucket_seconds", None) and getattr(ec, "spec_plain_steps", False):
                from deepinfer_jax.host_scheduler.spec_switch import DraftSwitch

                plain = self.plain_estimator = self._bucket_estimator(runner.plain_bucket_seconds)
                self.scheduler.spec_plain_sps = self._bucket_sps(plain, ec.token_buckets)
                self.scheduler.spec_switch = DraftSwitch()
        self.spec_calibrator = None
        if self.spec and ec.spec_calibration:
            from deepinfer_jax.host_scheduler.spec_calibration import OnlineTemperatureCalibrator

            self.spec_calibrator = OnlineTemperatureCalibrator(ec.num_draft_tokens)
            self.scheduler.spec_confidence = self.spec_calibrator.probabilities

    @staticmethod
    def _bucket_estimator(bucket_seconds: dict):
        from deepinfer_jax.host_scheduler.spec_varlen import ForwardRuntimeEstimator

        return ForwardRuntimeEstimator(sorted(bucket_seconds.items()))

    def _bucket_sps(self, est, buckets):
        """SPS(B) for the planner: a step of B tokens runs at its padded bucket, so the bucket's
        rate (memoised per bucket until ``est`` learns a step time)."""
        from deepinfer_jax.runner.step_inputs import pick_bucket

        memo: dict = {}
        self._sps_memos.append(memo)

        def bucket_sps(B: int) -> float:
            b = pick_bucket(min(int(B), buckets[-1]), buckets)
            v = memo.get(b)
            if v is None:
                v = memo[b] = est.sps(b)
            return v

        return bucket_sps

    # ------------------------------------------------------------------ requests
    def check_requests(self, requests: Sequence[tuple], labels: Sequence | None = None) -> list[CheckedRequest]:
        """Check ``(request_id, prompt, params)`` triples without queueing anything. ``prompt``:
        text, token ids (a sequence or 1-D integer array) or a dict with ``prompt`` and/or
        ``prompt_token_ids``. Errors name ``labels[i]`` (default: the index ``i``)."""
        out, seen = [], set()
        for i, (rid, prompt, params) in enumerate(requests):
            label = i if labels is None else labels[i]
            if not isinstance(rid, str):
                raise ValueError(f"request {label}: request id {rid!r} of type {type(rid).__name__}; expected str")
            if rid in self._groups or rid in seen:
                raise ValueError(f"request {label}: request id {rid!r} is already in use")
            seen.add(rid)
            params = input_checks.check_params(label, params, max_logprobs=self.ec.max_logprobs,
                                               vocab_size=self.vocab_size)
            ids, text = input_checks.parse_prompt(label, prompt, self.tokenizer)
            input_checks.check_prompt_ids(label, ids, vocab_size=self.vocab_size,
                                          max_model_len=self.ec.max_model_len)
            out.append(CheckedRequest(rid, ids, text, params))
        self._compile_grammars(out, [i if labels is None else labels[i] for i in range(len(out))])
        return out

    def grammar_compiler(self):
        """The structured-output compiler of this engine's vocabulary (created on first use)."""
        if self._grammar_compiler is None:
            from deepinfer_jax.sampling.grammar_compile import GrammarCompiler, require_xgrammar

            require_xgrammar()
            if self.tokenizer_json is None or self.vocab_size is None:
                raise ValueError("structured output needs the model's tokenizer.json (this engine has none)")
            stops = [self.eos_token_id] if self.eos_token_id is not None else []
            self._grammar_compiler = GrammarCompiler(self.tokenizer_json, self.vocab_size, stops)
        return self._grammar_compiler

    def _compile_grammars(self, checked: list[CheckedRequest], labels: list) -> None:
        """Compile every grammar of ``checked`` (in the compiler's pool) before anything is queued."""
        todo = [(labels[i], c) for i, c in enumerate(checked) if c.params.grammar is not None]
        if not todo:
            return
        try:
            compiler = self.grammar_compiler()
        except ValueError as e:
            raise ValueError(f"request {todo[0][0]}: {e}") from None
        compiled = compiler.compile_all([(label, c.params.grammar) for label, c in todo])
        for (_, c), cg in zip(todo, compiled):
            c.compiled_grammar = cg

    def add_checked(self, requests: Sequence[CheckedRequest], arrival_time: float | None = None) -> None:
        """Queue requests returned by ``check_requests`` (all of them, or none on an interrupt)."""
        with deferred_interrupts():
            for r in requests:
                self._queue(r, arrival_time)

    def add_requests(self, requests: Sequence[tuple], arrival_time: float | None = None) -> None:
        """Check every ``(request_id, prompt, params)`` triple, then queue them all: nothing of
        the batch is queued when one is bad (the error names its index)."""
        self.add_checked(self.check_requests(requests), arrival_time)

    def add_request(self, request_id: str, prompt_token_ids, params, prompt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Check and queue one request (``params.n`` samples share the prompt). Give token ids,
        or text as ``prompt`` (``prompt_token_ids=None``), or both (they must agree). Errors
        name the request id."""
        if prompt is None:
            spec = prompt_token_ids
        elif prompt_token_ids is None:
            spec = prompt
        else:
            spec = {"prompt": prompt, "prompt_token_ids": prompt_token_ids}
        self.add_checked(self.check_requests([(request_id, spec, params)], labels=[repr(request_id)]),
                         arrival_time)

    def _queue(self, r: CheckedRequest, arrival_time: float | None) -> None:
        params = r.params
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63 - 1))
        states = []
        for i in range(params.n):
            rid = r.request_id if params.n == 1 else f"{r.request_id}#{i}"
            req = Request(rid, list(r.prompt_token_ids), params, child_seed(seed, i), self.eos_token_id)
            if arrival_time is not None:
                req.arrival_time = arrival_time
            st = self.outputs.new_state(req, r.request_id, i)
            self._states[rid] = st
            if r.compiled_grammar is not None:
                from deepinfer_jax.sampling.grammar_matcher import GrammarState

                comp = self.grammar_compiler()
                K = getattr(self.scheduler, "num_draft_tokens", 0)
                g = self._grammars[rid] = GrammarState(comp.matcher(r.compiled_grammar), comp.words, K,
                                                       comp.extra_mask(params.grammar))
                g.prepare(())
                self.grammar_fill_s += g.fill_seconds
            states.append(st)
            self.scheduler.add_request(req)
        self._groups[r.request_id] = states
        self._prompts[r.request_id] = r.prompt
        self.stats.prompt_tokens += len(r.prompt_token_ids) * params.n

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish every sample of ``request_id`` with "abort" (their blocks and slots are freed;
        results still in flight are dropped) and return its output, or None if unknown."""
        if request_id not in self._groups:
            return None
        for st in self._groups[request_id]:
            if not st.request.status.finished:
                self.outputs.finish_text(st, RequestStatus.FINISHED_ABORTED)
                self.scheduler.finish(st.request, RequestStatus.FINISHED_ABORTED)
        out = self._request_output(request_id)
        self._forget([request_id])
        return out

    def _forget(self, parent_ids) -> None:
        for g in parent_ids:
            for s in self._groups.pop(g):
                self._states.pop(s.request.request_id, None)
                self._grammars.pop(s.request.request_id, None)
            self._prompts.pop(g, None)

    def abort_all(self) -> None:
        """Abort every request and drop the in-flight step (after an interrupted or failed
        run): blocks and slots are freed and the engine is empty. If a planned step never
        reached the device, the prefix cache is reset (its newest blocks were never written)."""
        with deferred_interrupts():
            self._inflight = None
            drain = getattr(self.runner, "drain", None)
            if drain is not None:  # dispatch_thread: let a queued step call finish
                drain()
            for g in list(self._groups):
                self.abort_request(g)
            for req in list(self.scheduler.requests.values()):  # not registered with the engine
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self._states.clear()
            self._grammars.clear()
            self._groups.clear()
            self._prompts.clear()
            if self._undispatched:
                self.scheduler.pool.reset_prefix_cache()
                self._undispatched = False

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def flush(self) -> list[RequestOutput]:
        """Wait for the in-flight step (async scheduling) and apply its results now, so no step
        is on the device and every output so far is on the host; the next ``step`` plans from
        there. Returns the requests that finished in it (none without a step in flight)."""
        with deferred_interrupts():
            prev, self._inflight = self._inflight, None
            return self._process(prev) if prev is not None else []

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One round; returns the requests (all ``n`` samples) that finished in it."""
        t0 = time.perf_counter()
        with deferred_interrupts():
            self._undispatched = True
            sched = self.scheduler.schedule()
            if self._grammars and sched.num_rows:
                self._attach_masks(sched)
        t_planned = time.perf_counter()
        handle = self.runner.execute(sched) if sched.num_rows else None
        self._undispatched = False
        if handle is not None:
            handle.host_time = time.perf_counter() - t0
            handle.schedule_time = t_planned - t0
        finished: list[RequestOutput] = []
        progressed = handle is not None
        if self.ec.async_scheduling:
            prev, self._inflight = self._inflight, handle
            if prev is not None:
                progressed = True  # its results may finish requests and free slots / blocks
                finished += self._process(prev)
        elif handle is not None:
            finished += self._process(handle)
        if not progressed and self.scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress with nothing in flight "
                               f"({len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} running)")
        return finished

    def _attach_masks(self, sched) -> None:
        """Hand the grammar rows' prepared bitmask rows to the plan (``sched.grammar_masks``)."""
        t0 = time.perf_counter()
        masks = {}
        # (the leading decode columns' rows have no grammar: DecodeCohort.eligible)
        for i, row in enumerate(sched.tail_rows, len(sched.decode) if sched.decode is not None else 0):
            g = self._grammars.get(row.request_id)
            if g is None or not row.sample:
                continue
            drafts = row.token_ids[len(row.token_ids) - row.num_drafts:] if row.num_drafts else ()
            before = g.fill_seconds
            masks[i] = g.rows(row.num_drafts, drafts)
            self.grammar_fill_s += g.fill_seconds - before  # a refill (drafts other than prepared)
        sched.grammar_masks = masks or None
        self.grammar_plan_s += time.perf_counter() - t0

    def _advance_grammar(self, req, tokens) -> RequestStatus | None:
        """Advance the request's matcher on its emitted tokens and fill its next step's bitmask
        rows; STOPPED when the grammar is complete (it accepted EOS)."""
        g = self._grammars.get(req.request_id)
        if g is None:
            return None
        try:
            g.advance(tokens)
        except RuntimeError as e:
            raise RuntimeError(f"request {req.request_id!r}: {e}") from None
        if g.terminated:
            return RequestStatus.FINISHED_STOPPED
        before = g.fill_seconds
        g.prepare(req.draft_token_ids if self.spec else ())
        self.grammar_fill_s += g.fill_seconds - before
        return None

    def _process(self, handle) -> list[RequestOutput]:
        res = handle.fetch()  # the wait for the device: interruptible
        t_apply = time.perf_counter()
        self._check_finite(handle.sched, res)
        with deferred_interrupts():  # the results are applied whole
            return self._apply(handle, res, t_apply)

    def _check_finite(self, sched, res) -> None:
        n = sched.num_rows
        lp = np.asarray(res.logprob[:n])
        if lp.ndim == 2:  # verification rows: only the emitted slots count
            lp = np.where(np.arange(lp.shape[1])[None, :] <= res.num_accepted[:n, None], lp, 0.0)
        if np.isfinite(lp).all():
            return  # the common case, one array check; the loop below names the request
        for i, row in enumerate(sched.rows):
            st = self._states.get(row.request_id)
            req = st.request if st is not None else None
            if req is None or req.status.finished or row.epoch != req.epoch:
                continue  # a dropped result (finished, aborted or preempted since planned)
            spec = res.logprob.ndim == 2  # a verification row: every emitted token
            lp = res.logprob[i, :int(res.num_accepted[i]) + 1] if spec else res.logprob[i:i + 1]
            if row.sample and not np.isfinite(lp).all():
                what = (f"tokens {res.token_ids[i, :len(lp)].tolist()} with logprobs {lp.tolist()}" if spec
                        else f"token {int(res.token_ids[i])} with logprob {float(res.logprob[i])}")
                raise RuntimeError(f"request {st.parent_id!r} (sample {st.index}): step {sched.step_id} sampled "
                                   f"{what}: the model's "
                                   "outputs are not finite (e.g. NaN weights)")

    def _apply(self, handle, res, t_apply: float) -> list[RequestOutput]:
        sched = handle.sched
        done_groups = []
        now = time.monotonic()
        spec = getattr(handle, "spec", False)
        K = getattr(self.scheduler, "num_draft_tokens", 0)
        verified, accepted, proposed = 0, 0, 0
        spec_rows, acc_pos = 0, [0] * K
        gen0 = self.stats.generated_tokens
        # Python scalars once per step, not a numpy index per row and token
        tok_R, lp_R = res.token_ids.tolist(), res.logprob.tolist()
        if spec:
            acc_R, dids_R, dconf_R = res.num_accepted.tolist(), res.draft_ids.tolist(), res.draft_conf.tolist()
        state_of, add_token = self._states.get, self.outputs.add_token  # (bound once: a lookup per row less)
        # (request id, epoch, row): the leading decode columns' rows (one sampled token each, no
        # prompt logprobs) are not built as ScheduledRow objects here (row None)
        d = sched.decode
        keys = ((r.request_id, r.epoch, r) for r in sched.tail_rows)
        if d is not None:
            keys = itertools.chain(zip(d.request_ids, d.epochs, itertools.repeat(None)), keys)
        for i, (rid, epoch, row) in enumerate(keys):
            st = state_of(rid)
            req = st.request if st is not None else None
            if req is None or req.status.finished or epoch != req.epoch:
                continue  # finished, aborted or preempted since this step was planned
            if row is None:
                pass  # a decode column's row: samples, no prompt logprobs, no drafts
            elif row.prompt_logprobs and res.prompt_target_lp is not None:
                off = res.token_offsets[i]
                for j in range(row.num_tokens):
                    p = row.start + j + 1
                    if p < len(req.prompt_token_ids):
                        self.outputs.add_prompt_logprobs(st, p, res.prompt_target_lp[off + j],
                                                         res.prompt_top_ids[off + j], res.prompt_top_lp[off + j])
            if row is not None and not row.sample:
                continue
            if not spec:
                req.num_pending -= 1
            if req.first_token_time is None:
                req.first_token_time = now
            if spec:
                a = acc_R[i]
                nd = row.num_drafts if row is not None else 0
                self.scheduler.commit_verification(req, nd, a)
                if nd:
                    # the drafts verified here came with the previous step's results, and so did
                    # req.draft_confidence (replaced below by this step's)
                    if self.spec_calibrator is not None and len(req.draft_confidence) >= nd:
                        self.spec_calibrator.observe(req.draft_confidence, nd, a)
                    spec_rows += 1
                    verified += nd
                    accepted += a
                    req.num_drafts_verified += nd
                    req.num_drafts_accepted += a
                    pp = req.drafts_accepted_per_position
                    if len(pp) < K:
                        pp.extend([0] * (K - len(pp)))
                    for j in range(a):
                        acc_pos[j] += 1
                        pp[j] += 1
                # the accepted drafts, then the correction / bonus token
                m, status = self.outputs.add_tokens(st, tok_R[i][:a + 1], lp_R[i], res.top_ids[i],
                                                    res.top_logprobs[i])
                self.stats.generated_tokens += m
                if status is None:  # the next verification row's drafts
                    req.draft_token_ids = dids_R[i]
                    req.draft_confidence = dconf_R[i]
                    req.num_drafts_proposed += len(req.draft_token_ids)
                    proposed += len(req.draft_token_ids)
                    if self._grammars:
                        status = self._advance_grammar(req, tok_R[i][:m])
            else:
                top = (res.top_ids[i], res.top_logprobs[i]) if st.logprobs is not None else (None, None)
                status = add_token(st, tok_R[i], lp_R[i], *top)
                self.stats.generated_tokens += 1
                if status is None and self._grammars:
                    status = self._advance_grammar(req, [tok_R[i]])
            if status is not None:
                self.outputs.finish_text(st, status)
                self.scheduler.finish(req, status)
                group = self._groups[st.parent_id]
                if all(s.request.status.finished for s in group):
                    done_groups.append(st.parent_id)
        self.stats.record(StepStats(
            step_id=sched.step_id, num_tokens=sched.num_tokens, bucket_tokens=handle.bucket_tokens,
            num_prefill_tokens=sched.num_prefill_tokens, num_decode_tokens=sched.num_decode_tokens,
            num_rows=sched.num_rows, step_time_s=handle.t_done - handle.t_dispatch,
            host_time_s=handle.host_time, cache_hit_tokens=sched.cache_hit_tokens,
            preemptions=len(sched.preempted), queue_wait_s=list(sched.queue_wait),
            spec_rows=spec_rows, drafts_proposed=proposed, drafts_verified=verified, drafts_accepted=accepted,
            drafts_accepted_per_position=acc_pos, spec_plain=sched.spec_plain, schedule_s=handle.schedule_time, inputs_s=handle.inputs_time,
            call_s=handle.call_time, process_s=time.perf_counter() - t_apply,
            launch_s=getattr(handle, "launch_time", 0.0) if getattr(handle, "future", None) is not None else 0.0,
            generated_tokens=self.stats.generated_tokens - gen0, t_done_s=handle.t_done))
        est = self.plain_estimator if sched.spec_plain else self.forward_estimator
        if est is not None:
            # the step's own time: from its dispatch, or from the previous step's results where
            # it was dispatched before them (async: it waited for that step on the device)
            est.observe(handle.bucket_tokens, handle.t_done - max(handle.t_dispatch, self._prev_done))
            for memo in self._sps_memos:
                memo.clear()
        self._prev_done = handle.t_done
        out = [self._request_output(g) for g in done_groups]
        self._forget(done_groups)
        self.stats.finished_requests += len(done_groups)
        return out

    def _request_output(self, parent_id: str) -> RequestOutput:
        states = self._groups[parent_id]
        first = states[0]
        comps = [self.outputs.completion(s) for s in states]
        return RequestOutput(parent_id, self._prompts.get(parent_id), list(first.request.prompt_token_ids),
                             first.prompt_logprobs, comps, True, comps[0].metrics,
                             first.request.num_cached_tokens)

    def run_until_done(self, on_finish=None) -> list[RequestOutput]:
        outs = []
        t0 = time.perf_counter()
        while self.has_unfinished_requests():
            for o in self.step():
                outs.append(o)
                if on_finish is not None:
                    on_finish(o)
        self.stats.wall_time_s += time.perf_counter() - t0
        fallbacks = getattr(self.runner, "kernel_fallbacks", None)
        self.stats.kernel_fallbacks = fallbacks() if fallbacks is not None else {}
        return outs
