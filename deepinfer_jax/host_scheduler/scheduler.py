"""Continuous-batching scheduler: picks each step's ragged batch (FEATURES §2, §3, §5).

One call to ``schedule()`` plans one step under ``max_num_batched_tokens`` and
``max_num_seqs``:

1. Running requests first, oldest first: a prefill in progress gets its next chunk (as much as
   the budget allows), a decoding request one token. A decode token whose id is still on the
   device (sampled by the previous, in-flight step) is a *placeholder*: the row names the
   previous step's logits row and the runner resolves it on device.
2. Then waiting requests, FCFS, while budget, a sliding-window slot and blocks are available.
   A newly admitted request looks up the prefix cache (full blocks of its known tokens, never
   the last token); on a hit it starts at the *replay start* — the cached length minus
   ``prefix_replay_tokens``, rounded down to a block — with its window floor there (the slot has
   no state below it) and compressed-cache writes from the cached length on (the hit blocks are
   shared). The replay rebuilds the sliding-window state, which the prefix cache does not hold.
   It is exact when ``prefix_replay_tokens >= (n_layers-1)*(W-1)+W`` (``prefix_replay="exact"``):
   layer 0's keys come from the embeddings, exact from the replay start on, and layer l's
   outputs are exact ``(l+1)*(W-1)`` positions after it, so the last layer's outputs (and every
   window entry they read) are exact from ``n_layers*(W-1)`` replayed positions on; the bound
   has one to spare (the compressed KV the layers also read is the cached, exact one). A
   shorter tail (``prefix_replay="bounded"``, default ``yoco_keep_tokens``) is DeepSeek's
   approximation: the oldest window entries of the upper layers see truncated context.
   The request's ``num_cached_tokens`` is the replay start: the tokens not recomputed.
3. When a running request needs a block and none is free, the newest running request is
   preempted (blocks and slot freed, progress reset, put at the front of the queue; its
   outputs so far are kept and recomputed with the prompt).

YOCO truncation: a request's ``dec_floor`` is ``len(prompt) - yoco_keep_tokens`` (0 when
truncation is off or the request wants prompt logprobs); the decoder layers compute only
positions at or above ``max(floor, dec_floor)``. By the same argument as for replay, truncation
changes nothing when ``yoco_keep_tokens >= (n_decoder_layers-1)*(W-1)+W`` (2414 for
V4.1-Flash: 19 decoder layers, W=128); below that it is an approximation.

Output: a ``SchedulerOutput`` of ``ScheduledRow``s, plain data (ids, positions, tokens, slot,
block table, floors, sampling fields, prompt-logprob targets, the Engram look-back window): the
runner needs no scheduler object and the plan can cross a process boundary. A row names its
request by id and ``epoch``; epochs are unique across requests (a fresh one on admission and on
every preemption), so the engine drops results of rows planned for a request that has since
finished, been preempted, or been aborted and replaced under the same id.

Blocks are handed to the prefix cache once every position in them is scheduled and their
tokens are known. Device steps run in dispatch order, so a later step never reads a block before
the step writing it; a request admitted later in the *same* step may also hit it, which is
correct because every layer writes the step's compressed entries before it reads any (the
kernels must keep that order).
"""

from __future__ import annotations

import collections
import itertools
import time

import numpy as np

from deepinfer_jax.host_scheduler.block_pool import BlockPool, hash_block_tokens
from deepinfer_jax.host_scheduler.request import Request, RequestStatus
from deepinfer_jax.host_scheduler.slot_pool import SlotPool
from deepinfer_jax.host_scheduler.spec_switch import AcceptanceRates
from deepinfer_jax.host_scheduler.decode_cohort import DecodeCohort
from deepinfer_jax.host_scheduler.spec_varlen import plan_varlen
from deepinfer_jax.base.scheduler_output import ScheduledRow, SchedulerOutput  # noqa: F401  (re-exported)


class Scheduler:
    # steady decode rows planned by _decode_rows (the general path plans the same rows, slower;
    # tests/test_scheduler.py compares the two), and as columns by a DecodeCohort (async decode,
    # with speculation in plain steps; needs the fast path; the same comparison)
    decode_fast_path = True
    decode_cohort = True

    def __init__(self, ec, max_model_len: int | None = None, history_tokens: int = 0, epochs=None):
        """``ec``: a resolved ``EngineConfig``; ``history_tokens``: tokens before each row's start
        that its ``history`` carries (the runner's Engram look-back, ``max_ngram_size - 1``);
        ``epochs``: an iterator of fresh epochs shared by schedulers whose requests must never
        share one (the DP ranks, ``dp_scheduler.py``); default this scheduler's own count."""
        self.ec = ec
        self.max_model_len = max_model_len or ec.max_model_len
        self.history_tokens = history_tokens
        self.pool = BlockPool(ec.num_blocks, ec.block_tokens, ec.enable_prefix_caching)
        self.slots = SlotPool(ec.max_num_seqs)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.next_step_id = 0
        self.num_preemptions = 0
        self._epochs = itertools.count() if epochs is None else epochs
        # speculative decoding: drafts per verification row (0 = off); varlen planning needs
        # ``spec_sps`` (step tokens -> steps per second), set by the engine from the runner
        self.num_draft_tokens = ec.num_draft_tokens if getattr(ec, "spec_decode", "off") == "dspark" else 0
        self.spec_varlen = bool(getattr(ec, "spec_varlen", False))
        # the fixed length's drafts per row, below num_draft_tokens (None: all of them): a fixed
        # length 1..K on the engine compiled for K (scripts/bench_spec.py's fixed1..fixedK)
        self.draft_limit: int | None = None
        self.spec_sps = None
        # the token counts a step is padded to: Algorithm 1's stopping rule is tested at these
        # (plan_varlen's ``buckets``); None tests it at every count (a cost that rises per token)
        self.spec_buckets = tuple(getattr(ec, "token_buckets", None) or ()) or None
        # confidence logits [R, K] -> conditional acceptance probabilities (default the sigmoid;
        # the engine sets a calibrated map with EngineConfig.spec_calibration)
        self.spec_confidence = None
        # plain steps (EngineConfig.spec_plain_steps): ``spec_switch`` (spec_switch.DraftSwitch)
        # and ``spec_plain_sps`` (the plain steps' rate), set by the engine; the observed
        # per-position acceptance stands in for confidences the host does not have
        self.spec_switch = None
        self.spec_plain_sps = None
        self.spec_rates = AcceptanceRates(self.num_draft_tokens) if self.num_draft_tokens else None
        self._drafting = True     # the newest planned step drafts (its rows' next drafts are coming)
        self._draft_plan: dict[str, int] = {}
        self.num_device_rows = 0  # verification rows planned before the previous step's results (async)
        self._block_tokens, self._caching = ec.block_tokens, ec.enable_prefix_caching  # (_decode_rows)
        self.cohort = DecodeCohort([], [], [], self)

    # ------------------------------------------------------------------ requests
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        ec = self.ec
        if ec.yoco_truncation != "off" and req.params.prompt_logprobs is None:
            req.dec_floor = max(0, len(req.prompt_token_ids) - ec.yoco_keep_tokens)
        req.epoch = self._new_epoch()
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and free its blocks and slot (their in-flight writes run first on device)."""
        if req.status.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self._register_blocks(req)
            self.running.remove(req)
            self._release(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.finished_time = time.monotonic()
        del self.requests[req.request_id]

    def _new_epoch(self) -> int:
        """Epochs are unique across requests: a stale row of an aborted request never matches a
        new request that reuses its id."""
        return next(self._epochs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def prefix_hit_tokens(self, req: Request) -> int:
        """Tokens of ``req``'s known tokens this scheduler's prefix cache holds now (no state
        changes: the lookup is counted when the request is admitted)."""
        self._update_hashes(req)
        return len(self._prefix_blocks(req)) * self.ec.block_tokens

    def _prefix_blocks(self, req: Request) -> list[int]:
        """The cached blocks of ``req``'s longest prefix hit (its hashes up to date); none when
        caching is off or the request wants prompt logprobs (every position is computed)."""
        if not self.ec.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        return self.pool.find_prefix(req.block_hashes, req.num_tokens)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        step = self.next_step_id
        budget = self.ec.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[str] = []
        self._draft_plan, plain = self._plan_drafts(budget) if self.num_draft_tokens else ({}, False)
        i = 0
        fast = self.decode_fast_path and not self.num_draft_tokens  # steady decode rows: _decode_rows
        # the decode cohort: steady async decode rows as columns; with speculation only in plain
        # steps (a verification step plans every row on the row path, and the cohort starts over)
        cohort = (self.cohort if self.decode_fast_path and self.decode_cohort and (fast or plain) else None)
        if cohort is None and len(self.cohort):
            self.cohort = DecodeCohort([], [], [], self)
        cols = None
        if cohort is not None:  # the steady decode rows of the running prefix, as columns
            cols, i = cohort.plan(self, step, budget)
            if cols is not None:
                budget -= len(cols)
        covered = i
        first = len(cols) if cols is not None else 0  # the step's row index of rows[0]
        while i < len(self.running) and budget > 0:
            if fast:
                j = self._decode_rows(rows, i, step, budget, first)
                budget -= j - i
                i = j
                if i == len(self.running) or budget <= 0:
                    break
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                i += 1
                continue
            while not self._ensure_blocks(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                rows.append(self._row(req, n, step, first + len(rows)))
                budget -= n
                i += 1
        hit_tokens, waits = 0, []
        while self.waiting and budget > 0 and len(self.running) < self.ec.max_num_seqs:
            req = self.waiting[0]
            admitted = self._admit(req, budget)
            if admitted is None:
                break
            n, saved = admitted
            self.waiting.popleft()
            self.running.append(req)
            now = time.monotonic()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = saved
                waits.append(now - req.arrival_time)
            hit_tokens += saved
            rows.append(self._row(req, n, step, first + len(rows)))
            budget -= n
        if cohort is not None and rows:
            cohort.grow(self, rows, covered, first)
        if rows or first:
            self.next_step_id += 1
            self._drafting = not plain
        return SchedulerOutput(step, rows, preempted, hit_tokens, waits, spec_plain=plain, decode=cols)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n_out = len(req.output_token_ids) + req.num_pending  # req.num_outputs_planned
        planned = len(req.prompt_token_ids) + n_out          # req.num_tokens_planned
        computed = req.num_computed
        if computed < planned - 1:  # prefill (or recompute) in progress
            return min(planned - computed, budget)
        if computed != planned - 1:
            return 0  # every known token computed; a finishing sample is in flight
        p = req.params
        if n_out >= p.max_tokens or planned >= self.max_model_len:
            return 0  # the in-flight samples will finish it
        if self.num_draft_tokens and req.num_pending and len(req.output_token_ids) < p.min_tokens:
            return 0  # min_tokens bans need the exact output count: wait for the in-flight row
        if req.num_pending and p.grammar is not None:
            return 0  # structured output: the next bitmask needs the in-flight token (a sync point)
        return 1 + min(self._draft_plan.get(req.request_id, 0), budget - 1)

    # ------------------------------------------------------------------ speculative decoding
    def _draft_caps(self) -> tuple[list[Request], list[int], list[int]]:
        """The decode rows' requests (every token but the newest computed), in running order, with
        each one's room and cap. Room: the drafts a verification row of it may carry, at most
        ``num_draft_tokens`` (and ``draft_limit``), and no more than ``max_tokens`` and
        ``max_model_len`` leave room for, counting in-flight rows as fully accepted. Cap: the
        drafts at hand within the room; a row after an in-flight one takes that step's drafts on
        the device (async: all of them, or none after a plain step), otherwise the host's drafts
        from the last processed step. Before ``min_tokens`` outputs a row is planned only with
        nothing in flight (``_num_new_tokens``), so the count its per-slot bans start from is exact
        (``ScheduledRow.ban_slots``). The room alone is varlen's estimate after a plain step.
        (One pass, the counts read once per request: it runs every step over every request.)"""
        K = self.num_draft_tokens if self.draft_limit is None else min(self.draft_limit, self.num_draft_tokens)
        mml, drafting = self.max_model_len, self._drafting
        decoding, rooms, caps = [], [], []
        for r in self.running:
            n_out = len(r.output_token_ids) + r.num_pending
            planned = len(r.prompt_token_ids) + n_out
            if r.num_computed != planned - 1:
                continue
            room = max(0, min(K, r.params.max_tokens - n_out - 1, mml - planned - 1))
            decoding.append(r)
            rooms.append(room)
            caps.append((room if drafting else 0) if r.num_pending else min(room, len(r.draft_token_ids)))
        return decoding, rooms, caps

    def _plan_drafts(self, budget: int) -> tuple[dict[str, int], bool]:
        """(request id -> drafts of its verification row this step, whether the step is plain):
        the cap (fixed length) or Algorithm 1 over the decode rows' confidences
        (``spec_varlen``); with plain steps (``spec_switch``) the step may be plain (no drafts)."""
        decoding, rooms, cap_list = self._draft_caps()
        caps = {r.request_id: c for r, c in zip(decoding, cap_list) if c > 0}
        switch = self.spec_switch
        if not self.spec_varlen or self.spec_sps is None or (not caps and switch is None):
            return caps, False
        R = len(decoding)
        # the step runs at its padded token bucket: the stopping rule looks at bucket ends. Prompt
        # tokens go first: a draft is worth its acceptance probability (< 1), a prompt token is
        # work the request needs anyway, and a starved prefill keeps the batch small
        P = self._prefill_demand(budget)
        cap = max(R, budget - P)
        sps = self.spec_sps if not P else (lambda B, f=self.spec_sps: f(B + P))
        buckets = self.spec_buckets and tuple(b - P for b in self.spec_buckets if b > P)
        if caps:
            cap_R = np.array(cap_list, np.int64).reshape(R)
            conf = self._confidences(decoding, cap_R)
        else:  # no drafts at hand (the newest step was plain): as if every row had them
            cap_R = np.array(rooms, np.int64).reshape(R)
            conf = np.where(np.arange(self.num_draft_tokens)[None, :] < cap_R[:, None], self.spec_rates.rates(), 0.0)
        lengths = plan_varlen(conf, sps, max_tokens=cap, buckets=buckets or None)
        if switch is not None:
            verified = np.arange(conf.shape[1])[None, :] < lengths[:, None]
            tau = R + float((np.cumprod(conf, axis=1) * verified).sum())
            theta_spec = tau * sps(R + int(lengths.sum())) if R else 0.0
            theta_plain = R * self.spec_plain_sps(R + P) if R else 0.0
            if switch.choose(R, bool(caps), theta_spec, theta_plain):
                return {}, True
        if not caps:  # a drafting step with nothing to verify yet
            return {}, False
        return {r.request_id: int(n) for r, n in zip(decoding, lengths) if n > 0}, False

    def _confidences(self, decoding: list[Request], cap_R: np.ndarray) -> np.ndarray:
        """[R, K] conditional acceptance probabilities of the decode rows' drafts (0 past each
        row's cap). Async: the newest processed step's confidence logits (the drafts in flight
        are on the device); where the host has none (right after a prefill or a plain step),
        the observed acceptance rates."""
        K = self.num_draft_tokens
        R = len(decoding)
        # filled as Python lists (one per-row numpy assignment cost more than the row's planning)
        z = [0.0] * (R * K)
        known = [0] * R
        for i, c in enumerate(cap_R.tolist()):
            if c:
                conf = decoding[i].draft_confidence[:c]
                z[i * K:i * K + len(conf)] = conf
                known[i] = len(conf)
        z_RK = np.array(z, np.float64).reshape(R, K)
        known_R = np.array(known, np.int64)
        p_RK = 1.0 / (1.0 + np.exp(-z_RK)) if self.spec_confidence is None else self.spec_confidence(z_RK)
        j_K = np.arange(K)[None, :]
        p_RK = np.where(j_K < known_R[:, None], p_RK, self.spec_rates.rates()[None, :])
        return np.where(j_K < cap_R[:, None], p_RK, 0.0)

    def _prefill_demand(self, budget: int) -> int:
        """Prompt tokens this step could schedule (running prefills, then waiting requests while
        rows are free), at most ``budget``: varlen plans drafts only into the budget they leave."""
        need = 0
        for r in self.running:
            if r.num_computed < r.num_tokens_planned - 1:
                need += r.num_tokens_planned - r.num_computed
        free_rows = self.ec.max_num_seqs - len(self.running)
        for r in itertools.islice(self.waiting, max(0, free_rows)):
            if need >= budget:
                break
            need += r.num_tokens
        return min(need, budget)

    def commit_verification(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """After a verification row's results: its 1 + num_drafts optimistic tokens leave
        ``num_pending`` and the rejected drafts' positions are no longer computed (the device
        rolled their cache writes back, and shifted any later in-flight row by as much)."""
        req.num_pending -= 1 + num_drafts
        req.num_computed -= num_drafts - num_accepted
        if num_drafts:
            self.spec_rates.observe(num_drafts, num_accepted)

    def _blocks_needed(self, end: int) -> int:
        return -(-end // self.ec.block_tokens)

    def _ensure_blocks(self, req: Request, end: int) -> bool:
        need = self._blocks_needed(end) - len(req.blocks)
        if need <= 0:
            return True
        got = self.pool.append(req.request_id, need)
        if got is None:
            return False
        req.blocks = req.blocks + got  # a new list: planned rows share the old one (never copied)
        return True

    def _admit(self, req: Request, budget: int) -> tuple[int, int] | None:
        """Slot, prefix lookup and blocks for a waiting request. Returns (tokens this step, tokens
        the prefix cache saves: the replay start) or None (nothing changed) when resources are short."""
        bt = self.ec.block_tokens
        self._update_hashes(req)
        n_known = req.num_tokens
        hit_blocks = self._prefix_blocks(req)
        cached = len(hit_blocks) * bt
        start = 0
        if cached:
            start = max(0, cached - self.ec.prefix_replay_tokens) // bt * bt
        n = min(n_known - start, budget)
        if self.slots.num_free == 0:
            return None
        need = self._blocks_needed(start + n) - len(hit_blocks)
        blocks = self.pool.allocate(req.request_id, hit_blocks, max(need, 0))
        if blocks is None:
            return None
        self.pool.record_lookup(n_known, len(hit_blocks))  # admitted: count it once
        req.slot = self.slots.allocate(req.request_id)
        req.blocks = list(blocks)
        req.num_registered_blocks = len(hit_blocks)
        req.num_computed = start
        req.floor, req.cache_start = start, cached
        req.status = RequestStatus.RUNNING
        return n, start

    def _decode_rows(self, rows: list, i: int, step: int, budget: int, first: int = 0) -> int:
        """Plan ``self.running[i:]`` while they are steady decode rows (one token, no drafts,
        their blocks in hand, no ``min_tokens`` bans), appending to ``rows`` (the step's rows
        from ``first`` on) at most ``budget`` of them; returns the index of the first request left for ``_num_new_tokens`` + ``_row``,
        which plan every other case (nothing of that request changed). The same rows and state
        updates as those two would make, without their general branches, in one loop with the
        scheduler's settings in locals: the per-row hot path of ``bench_host_path.py``."""
        running = self.running
        n_run = min(len(running), i + budget)
        max_len, bt, H, caching = self.max_model_len, self._block_tokens, self.history_tokens, self._caching
        prev_step = step - 1
        append = rows.append
        while i < n_run:
            req = running[i]
            pending = req.num_pending
            if pending > 1:
                break
            prompt, outs = req.prompt_token_ids, req.output_token_ids
            n_prompt = len(prompt)
            start = req.num_computed
            if start != n_prompt + len(outs) + pending - 1:
                break  # a prefill, or every known token computed (a finishing sample in flight)
            p = req.params
            n_out = start + 1 - n_prompt  # outputs before the row's sample
            blocks = req.blocks
            if n_out >= p.max_tokens or start + 1 >= max_len or n_out < p.min_tokens or start >= len(blocks) * bt:
                break
            if pending:  # the newest token is the in-flight sample: a placeholder
                if p.structured_output is not None and p.grammar is not None:
                    break  # structured output waits for it (a sync point)
                last = req.last_sample
                if last is None or last[0] != prev_step:
                    break  # (_row raises)
                prev_row, end_known = last[1], start
            else:
                prev_row, end_known = -1, start + 1
            lo = start - H if start > H else 0
            # known tokens [lo, end_known): the Engram look-back and, without a placeholder, the token
            if lo >= n_prompt:
                win = outs[lo - n_prompt:end_known - n_prompt]
            elif end_known <= n_prompt:
                win = prompt[lo:end_known]
            else:
                win = prompt[lo:] + outs[:end_known - n_prompt]
            req.num_computed = start + 1
            req.num_pending = pending + 1
            req.spec_inflight_drafts = 0
            req.last_sample = (step, first + len(rows))
            if caching and end_known // bt > req.num_registered_blocks:
                self._register_blocks(req, end_known)
            floor = req.floor
            dec_floor = req.dec_floor
            append(ScheduledRow(
                req.request_id, req.epoch, start, [-1] if pending else win[start - lo:], prev_row, True, req.slot,
                blocks, floor, dec_floor if dec_floor > floor else floor, req.cache_start, False, p, req.seed, [],
                False, None, win if H else None, 0, None, 1))
            i += 1
        return i

    def _row(self, req: Request, n: int, step: int, row_index: int) -> ScheduledRow:
        # (one call per row and step: the request's counts are read once into locals, and the
        # row's tokens and its Engram look-back come from one slice of the known tokens)
        start = req.num_computed
        prompt, outs = req.prompt_token_ids, req.output_token_ids
        n_prompt = len(prompt)
        n_known = n_prompt + len(outs)
        planned = n_known + req.num_pending
        n_draft = 0
        if n > 1 and start == planned - 1 and req.request_id in self._draft_plan:
            n_draft = n - 1  # a verification row: the newest token, then the drafts
        end = start + n - n_draft  # the row's tokens before its drafts: known, or the last one in flight
        prev_row = -1
        end_known = end
        if end > n_known:
            last = req.last_sample
            if max(start, n_known) != end - 1 or last is None or last[0] != step - 1:
                raise AssertionError(f"request {req.request_id}: token at {max(start, n_known)} unknown and not "
                                     f"the previous step's sample ({last})")
            end_known = end - 1
            prev_row = last[1]
        spec_ctx = None
        history = None
        H = self.history_tokens
        if self.num_draft_tokens and prev_row >= 0:
            # every token of the row comes from the previous step's outputs on the device; for the
            # n-gram hash of its first tokens, the device takes the last history_tokens known
            # tokens and the in-flight row's drafts, of which it keeps the accepted prefix
            toks = req.known_tokens(start, end_known)
            toks.append(-1)
            ctx = [-1] * max(H - n_known, 0) + req.known_tokens(max(n_known - H, 0), n_known)
            spec_ctx = ctx + req.draft_token_ids[:req.spec_inflight_drafts]
            toks += [-1] * n_draft
            self.num_device_rows += 1
        else:
            lo = max(start - H, 0) if H else start
            # req.known_tokens(lo, end_known), inlined: the hot path of every row, where the
            # method call is a measurable share of planning (bench_host_path.py)
            if end_known <= n_prompt:
                win = prompt[lo:end_known]
            elif lo >= n_prompt:
                win = outs[lo - n_prompt:end_known - n_prompt]
            else:
                win = prompt[lo:] + outs[:end_known - n_prompt]
            toks = win[start - lo:] if H else win  # (a copy where win is also the history)
            if prev_row >= 0:
                toks.append(-1)
            if n_draft:
                drafts = req.draft_token_ids[:n_draft]
                toks += drafts
                win = win + drafts
            if H:
                history = win
        was_prefill = start < planned - 1
        computed = start + n
        req.num_computed = computed
        sample = end == planned
        banned: list[int] = []
        ban_slots = 1
        if sample:
            req.num_pending += 1 + n_draft  # optimistic: every draft accepted
            req.spec_inflight_drafts = n_draft
            req.last_sample = (step, row_index)
            n_out = planned - n_prompt  # outputs before the row's first slot
            min_tokens = req.params.min_tokens
            if n_out < min_tokens:
                eos = req.eos_token_id is not None and not req.params.ignore_eos  # as min_tokens_banned_ids
                banned = ([req.eos_token_id] if eos else []) + list(req.params.stop_token_ids)
                ban_slots = min(min_tokens - n_out, 1 + n_draft)
        # also after a preemption: the results of rows of the older epoch are dropped, so the
        # recomputed prompt chunks must deliver their prompt logprobs again
        want_plp = req.params.prompt_logprobs is not None and start < n_prompt - 1
        targets = prompt[start + 1:min(start + 1 + n, n_prompt)] if want_plp else None
        self._register_blocks(req, min(computed, n_known))
        floor = req.floor
        # positional, in ScheduledRow's field order (one per row and step: keywords cost more)
        return ScheduledRow(
            req.request_id, req.epoch, start, toks, prev_row, sample, req.slot, req.blocks, floor,
            max(floor, req.dec_floor), req.cache_start, was_prefill, req.params, req.seed, banned, want_plp,
            targets, history, n_draft, spec_ctx, ban_slots)

    # ------------------------------------------------------------------ cache bookkeeping
    def _update_hashes(self, req: Request) -> None:
        """Extend the request's hash chain over its newly filled blocks (earlier ones are kept)."""
        bt = self.ec.block_tokens
        h = req.block_hashes
        for b in range(len(h), req.num_tokens // bt):
            h.append(hash_block_tokens(h[-1] if h else None, req.known_tokens(b * bt, (b + 1) * bt)))

    def _register_blocks(self, req: Request, filled: int | None = None) -> None:
        """Hand ``req``'s full blocks to the prefix cache: those whose positions are all computed
        (scheduled) and known; ``filled`` = ``min(num_computed, num_tokens)`` when the caller
        has it at hand."""
        if not self.ec.enable_prefix_caching:
            return
        if filled is None:
            filled = min(req.num_computed, req.num_tokens)
        n_full = filled // self.ec.block_tokens
        if n_full > req.num_registered_blocks:
            self._update_hashes(req)
            self.pool.cache_full_blocks(req.request_id, req.block_hashes[:n_full])
            req.num_registered_blocks = n_full

    def _release(self, req: Request) -> None:
        self.pool.free(req.request_id)
        self.slots.free(req.request_id)
        req.blocks, req.slot = [], None

    def _preempt(self, req: Request) -> None:
        self._register_blocks(req)
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_computed = req.num_pending = 0
        req.last_sample = None
        req.draft_token_ids, req.draft_confidence = [], []
        req.num_registered_blocks = 0
        req.epoch = self._new_epoch()
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
