"""Steady async decode rows kept as columns and advanced with numpy from step to step.

In steady async decoding a request's row is the row of the step before, one position on: one
placeholder token (the previous step's sample), the same slot, floors and sampling settings,
its Engram look-back shifted by the token that became known. Planning such rows one
``ScheduledRow`` at a time (``Scheduler._decode_rows``) costs about 2 us a row, and reading
their fields back into arrays as much again.

A ``DecodeCohort`` holds those requests as columns: a prefix ``running[:c]`` of the scheduler's
running list, each member planned every step. ``plan`` checks the members against their
requests (the previous step's sample processed, nothing else changed; members that finished or
were preempted leave), plans every member's next row at once and hands the runner
``DecodeColumns`` (``base/scheduler_output.py``). Per member it keeps only a few attribute
writes in Python (the request's counts), and a request call where a row needs a new block or
fills one for the prefix cache. Members whose last sample is in flight (``max_tokens``,
``max_model_len``) get no row, as on the row path. A member that fails a check ends the
cohort there: it and the requests after it go to the row path, which handles every other case
(preemption included). ``grow`` adds the row path's steady decode rows that continue the prefix.

With speculation the cohort plans only plain steps (``SchedulerOutput.spec_plain``): its rows
are then the row path's device rows (their look-back is the row's ``spec_ctx``, and the device
resolves them from the previous step's carry), and members verify no drafts. A verification step
plans every row on the row path, and the cohort starts over after it: a run of plain steps
plans its steady rows as columns from its third step on, once the verified drafts are out of
flight.

The plan is the row path's, row for row and in the same order
(``tests/test_scheduler.py`` and ``tests/test_decode_cohort.py`` compare them field by field,
``Scheduler.decode_cohort``).
"""

from __future__ import annotations

import operator

import numpy as np

from deepinfer_jax.base.scheduler_output import DecodeColumns, ScheduledRow
from deepinfer_jax.host_scheduler.request import Request, RequestStatus

_pending = operator.attrgetter("num_pending")
_outs = operator.attrgetter("output_token_ids")
_RUNNING = RequestStatus.RUNNING


def _ints(values, n: int) -> np.ndarray:
    return np.fromiter(values, np.int64, n)


class DecodeCohort:
    """Members in running order; every array and list is aligned with ``reqs`` and replaced,
    never changed in place, once handed out in ``DecodeColumns``."""

    def __init__(self, reqs: list[Request], rows: list[ScheduledRow], row_index: list[int], scheduler):
        n = len(reqs)
        s = scheduler
        self.reqs = reqs
        self.ids = [r.request_id for r in rows]
        self.epochs = [r.epoch for r in rows]
        self.params = [r.params for r in rows]
        self.seeds = [r.seed for r in rows]
        self.blocks = [r.blocks for r in rows]
        self.row_R = np.asarray(row_index, np.int64)      # each member's row in the newest step
        self.start_R = _ints((r.start for r in rows), n)  # ... and that row's start
        self.slot_R = _ints((r.slot for r in rows), n)
        self.floor_R = _ints((r.floor for r in rows), n)
        self.dec_floor_R = _ints((r.dec_floor for r in rows), n)
        self.cache_start_R = _ints((r.cache_start for r in rows), n)
        n_prompt = _ints((len(q.prompt_token_ids) for q in reqs), n)
        self.n_prompt_R = n_prompt
        # a row at start p is planned while p < limit (its outputs below max_tokens, the
        # sequence below max_model_len); the row path's _num_new_tokens rule
        max_tokens = _ints((q.params.max_tokens for q in reqs), n)
        self.limit_R = np.minimum(n_prompt + max_tokens - 1, s.max_model_len - 1)
        self.cap_R = _ints(map(len, self.blocks), n) * s._block_tokens
        self.reg_R = _ints((q.num_registered_blocks for q in reqs), n)
        H = s.history_tokens
        self.spec = bool(s.num_draft_tokens)  # device rows (plain steps of a speculative engine)
        look = (r.spec_ctx for r in rows) if self.spec else (r.history for r in rows)
        self.hist_RH = (np.array(list(look), np.int64).reshape(n, H) if H
                        else np.zeros((n, 0), np.int64))

    def __len__(self) -> int:
        return len(self.reqs)

    @staticmethod
    def eligible(row: ScheduledRow, req: Request, history_tokens: int) -> bool:
        """Whether a planned row is a steady async decode row (the placeholder its only token,
        nothing banned, its look-back full) whose request has exactly it and the previous
        step's sample in flight. In a speculative engine (a plain step's device rows) the
        look-back is the row's ``spec_ctx``: full (the row past the first ``history_tokens``
        positions) and no drafts in flight."""
        p = row.params
        if row.spec_ctx is not None:
            look_ok = len(row.spec_ctx) == history_tokens and row.start >= history_tokens
        else:
            look_ok = history_tokens == 0 or (row.history is not None and len(row.history) == history_tokens)
        return (row.prev_row >= 0 and row.sample and not row.num_drafts and not row.is_prefill
                and len(row.token_ids) == 1 and not row.banned and not row.prompt_logprobs and look_ok
                and req.num_pending == 2 and not (p.structured_output is not None and p.grammar is not None))

    @staticmethod
    def finishing(req: Request, max_model_len: int) -> bool:
        """A running request without a row because its in-flight sample is its last."""
        n_out = len(req.output_token_ids) + req.num_pending
        return req.num_pending == 1 and (n_out >= req.params.max_tokens
                                         or len(req.prompt_token_ids) + n_out >= max_model_len)

    # ------------------------------------------------------------------ planning
    def _members_in_place(self, running: list[Request]) -> bool:
        """Whether the members are ``running``'s first requests, in order; members that left
        (finished, aborted, preempted: status or epoch) are dropped first."""
        reqs = self.reqs
        n = len(reqs)
        if len(running) >= n and all(map(operator.is_, reqs, running)):
            return True
        keep = [i for i, r in enumerate(reqs) if r.status is _RUNNING and r.epoch == self.epochs[i]]
        if len(keep) == n or len(running) < len(keep):
            return False
        self._take(np.asarray(keep, np.int64))
        return all(map(operator.is_, self.reqs, running))

    def _take(self, idx: np.ndarray) -> None:
        """Keep the members at ``idx`` (ascending)."""
        il = idx.tolist()
        for name in ("reqs", "ids", "epochs", "params", "seeds", "blocks"):
            lst = getattr(self, name)
            setattr(self, name, [lst[i] for i in il])
        for name in ("row_R", "start_R", "slot_R", "floor_R", "dec_floor_R", "cache_start_R", "n_prompt_R",
                     "limit_R", "cap_R", "reg_R", "hist_RH"):
            setattr(self, name, getattr(self, name)[idx])

    def plan(self, s, step: int, budget: int) -> tuple[DecodeColumns | None, int]:
        """The members' rows of step ``step`` (``budget`` tokens at most; the scheduler's state
        updated as the row path would) and the number of running requests covered: the row
        path plans ``running[covered:]``. None columns: no row (the cohort may be empty)."""
        running = s.running
        if not self._members_in_place(running):
            self._take(np.zeros(0, np.int64))
            return None, 0
        reqs = self.reqs
        n = len(reqs)
        if not n:
            return None, 0
        s_R = self.start_R + 1
        # each member: the previous step's sample processed (its outputs up to s_R), that step's
        # row in flight (one pending sample); its computed count is the cohort's own (only the
        # scheduler's planning, preemption and verification change it)
        ok = (_ints(map(_pending, reqs), n) == 1) & (_ints(map(len, map(_outs, reqs)), n) == s_R - self.n_prompt_R)
        end = n if ok.all() else int(np.argmin(ok))
        live = s_R[:end] < self.limit_R[:end]
        cum = np.cumsum(live)
        if end and cum[-1] > budget:  # the row path stops right after the budget's last row
            end = int(np.searchsorted(cum, budget)) + 1
            live = live[:end]
        # new blocks and full blocks for the prefix cache, in row order as the row path
        bt = s._block_tokens
        need_blk = live & (s_R[:end] >= self.cap_R[:end])
        need_reg = (live & (s_R[:end] // bt > self.reg_R[:end])) if s._caching else np.zeros_like(live)
        todo = np.flatnonzero(need_blk | need_reg)
        if todo.size:
            blocks, cap, reg = list(self.blocks), self.cap_R.copy(), self.reg_R.copy()
            for i in todo.tolist():
                r = reqs[i]
                if need_blk[i]:
                    if not s._ensure_blocks(r, int(s_R[i]) + 1):
                        end = i  # the row path preempts from here on
                        live = live[:end]
                        break
                    blocks[i] = r.blocks
                    cap[i] = len(r.blocks) * bt
                if need_reg[i]:
                    s._register_blocks(r, int(s_R[i]))
                    reg[i] = r.num_registered_blocks
            self.blocks, self.cap_R, self.reg_R = blocks, cap, reg
        sel = np.flatnonzero(live)
        m = sel.size
        if m < n:
            self._take(sel)
            s_R = s_R[sel]
        if not m:
            return None, end
        reqs = self.reqs
        H = self.hist_RH.shape[1]
        if H:  # the look-back moves on by the token at s_R - 1, the newest known one
            hist = np.empty((m, H), np.int64)
            hist[:, :-1] = self.hist_RH[:, 1:]
            hist[:, -1] = _ints((r.output_token_ids[-1] for r in reqs), m)
            self.hist_RH = hist
        for j, (r, p) in enumerate(zip(reqs, s_R.tolist())):
            r.num_computed = p + 1
            r.num_pending = 2
            r.last_sample = (step, j)
        if self.spec:
            s.num_device_rows += m  # (their in-flight drafts stay 0: members verify none)
        cols = DecodeColumns(self.ids, self.epochs, s_R, self.row_R, self.slot_R, self.floor_R, self.dec_floor_R,
                             self.cache_start_R, self.blocks, self.params, self.seeds, self.hist_RH if H else None,
                             spec=self.spec)
        self.start_R = s_R
        self.row_R = np.arange(m, dtype=np.int64)
        return cols, end

    def grow(self, s, rows: list[ScheduledRow], covered: int, first_row: int) -> None:
        """After the row path planned ``rows`` (step rows ``first_row ..``, for ``running[covered:]``
        and then admissions): add the requests whose rows continue the prefix as steady decode
        rows; the first that does not ends it."""
        running = s.running
        H = s.history_tokens
        new_reqs, new_rows, new_index = [], [], []
        k = 0
        for idx in range(covered, len(running)):
            req = running[idx]
            row = rows[k] if k < len(rows) else None
            if row is None or row.request_id != req.request_id or row.epoch != req.epoch:
                if self.finishing(req, s.max_model_len):
                    continue  # no row: its last sample is in flight (it leaves next step)
                break
            if not self.eligible(row, req, H):
                break
            new_reqs.append(req)
            new_rows.append(row)
            new_index.append(first_row + k)
            k += 1
        if not new_reqs:
            return
        add = DecodeCohort(new_reqs, new_rows, new_index, s)
        if not self.reqs:
            self.__dict__.update(add.__dict__)
            return
        for name in ("reqs", "ids", "epochs", "params", "seeds", "blocks"):
            setattr(self, name, getattr(self, name) + getattr(add, name))
        for name in ("row_R", "start_R", "slot_R", "floor_R", "dec_floor_R", "cache_start_R", "n_prompt_R",
                     "limit_R", "cap_R", "reg_R", "hist_RH"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(add, name)]))
