"""Turns sampled tokens into request state: detokenization, stop checks, logprobs, outputs.

Stop rules, checked after each new token in this order: EOS (unless ``ignore_eos``) and
``stop_token_ids`` finish with "stop" (the token stays in ``token_ids``; EOS text is a special
token and is skipped); a stop string finishes with "stop" and cuts the text before it (or after
it with ``include_stop_str_in_output``); ``max_tokens`` or ``max_model_len`` finish with "length".
As in vLLM, stop strings are not looked for while the output has fewer than ``min_tokens``
tokens (EOS and ``stop_token_ids`` cannot occur there: the sampler bans them), so text of those
first tokens never ends a request.
"""

from __future__ import annotations

import dataclasses

from deepinfer_jax.engine.outputs import CompletionOutput, Logprob, RequestMetrics
from deepinfer_jax.host_scheduler.request import Request, RequestStatus
from deepinfer_jax.tokenizer.detokenizer import IncrementalDetokenizer
from deepinfer_jax.tokenizer.stop_checker import StopChecker


@dataclasses.dataclass(eq=False)
class RequestState:
    """Host-side output state of one request (one sample of a prompt)."""

    request: Request
    parent_id: str
    index: int                                   # sample index within the parent (n)
    detok: IncrementalDetokenizer | None
    stop: StopChecker | None
    text: str = ""
    # output tokens whose text is in ``text``: without stop strings the detokenizer runs when
    # the text is read (one batched push), not once per token and step
    num_detokenized: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tok = tokenizer
        self.max_model_len = max_model_len

    def new_state(self, req: Request, parent_id: str, index: int) -> RequestState:
        p = req.params
        detok = IncrementalDetokenizer(self.tok, req.prompt_token_ids, p.skip_special_tokens) if self.tok else None
        stop = StopChecker(p.stop, p.include_stop_str_in_output) if (p.stop and self.tok) else None
        st = RequestState(req, parent_id, index, detok, stop)
        if p.logprobs is not None:
            st.logprobs = []
        if p.prompt_logprobs is not None:
            st.prompt_logprobs = [None] * len(req.prompt_token_ids)
        return st

    def _decoded(self, t: int) -> str | None:
        return self.tok.decode([t], skip_special_tokens=False) if self.tok else None

    def add_prompt_logprobs(self, st: RequestState, position: int, target_lp: float, top_ids, top_lps) -> None:
        """Logprobs of prompt token ``position`` (predicted at ``position - 1``)."""
        n = st.request.params.prompt_logprobs
        tgt = st.request.prompt_token_ids[position]
        d = {int(i): Logprob(float(v), r + 1, self._decoded(int(i))) for r, (i, v) in
             enumerate(zip(top_ids[:n], top_lps[:n]))}
        if tgt not in d:
            d[tgt] = Logprob(float(target_lp), None, self._decoded(tgt))
        st.prompt_logprobs[position] = d

    def add_token(self, st: RequestState, token: int, logprob: float, top_ids, top_lps) -> RequestStatus | None:
        """Append one sampled token; returns the finishing status or None."""
        req = st.request
        p, outs = req.params, req.output_token_ids
        outs.append(token)
        st.cumulative_logprob += logprob
        if st.logprobs is not None:
            n = p.logprobs
            d = {int(i): Logprob(float(v), r + 1, self._decoded(int(i))) for r, (i, v) in
                 enumerate(zip(top_ids[:n], top_lps[:n]))}
            if token not in d:
                d[token] = Logprob(float(logprob), None, self._decoded(token))
            st.logprobs.append(d)
        if st.stop is not None:  # stop strings: the text as it grows (st.detok exists with them)
            delta = st.detok.push([token])
            st.text += delta
            st.num_detokenized = len(req.output_token_ids)
            if delta and len(req.output_token_ids) >= p.min_tokens:
                stopped, cut = st.stop.check(st.text, len(delta))
                if stopped:
                    full = st.text
                    st.text = full[:cut]
                    req.stop_reason = next((s for s in st.stop.stop if full.startswith(s, cut) or
                                            full[:cut].endswith(s)), None)
                    return RequestStatus.FINISHED_STOPPED
        if not p.ignore_eos and req.eos_token_id is not None and token == req.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        n_out = len(outs)
        if n_out >= p.max_tokens or len(req.prompt_token_ids) + n_out >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def add_tokens(self, st: RequestState, tokens: list[int], logprobs: list[float], top_ids=None,
                   top_lps=None) -> tuple[int, RequestStatus | None]:
        """Append a verification row's emitted tokens in order until one finishes the request;
        returns (tokens appended, the finishing status or None). The same as ``add_token`` per
        token (which requests with stop strings or logprobs take, ``top_ids[j]`` /
        ``top_lps[j]`` being token j's top-N lists); otherwise in one pass."""
        if st.stop is not None or st.logprobs is not None:
            for j, t in enumerate(tokens):
                top = (top_ids[j], top_lps[j]) if st.logprobs is not None else (None, None)
                status = self.add_token(st, t, logprobs[j], *top)
                if status is not None:
                    return j + 1, status
            return len(tokens), None
        req, p = st.request, st.request.params
        outs = req.output_token_ids
        # the token that reaches max_tokens or max_model_len finishes with "length" unless it stops
        room = max(1, min(p.max_tokens - len(outs), self.max_model_len - len(req.prompt_token_ids) - len(outs)))
        eos = req.eos_token_id if not p.ignore_eos else None
        stops = p.stop_token_ids
        n, status = min(len(tokens), room), None
        for j in range(n):
            t = tokens[j]
            if t == eos:
                n, status = j + 1, RequestStatus.FINISHED_STOPPED
                break
            if t in stops:
                n, status = j + 1, RequestStatus.FINISHED_STOPPED
                req.stop_reason = t
                break
        else:
            if n == room:
                status = RequestStatus.FINISHED_LENGTH
        outs += tokens[:n]
        for x in logprobs[:n]:  # added one by one, as add_token does (the same rounding)
            st.cumulative_logprob += x
        return n, status

    def sync_text(self, st: RequestState) -> None:
        """Bring ``st.text`` up to the request's output tokens (the batched detokenization)."""
        ids = st.request.output_token_ids
        if st.detok is not None and st.num_detokenized < len(ids):
            st.text += st.detok.push(ids[st.num_detokenized:])
            st.num_detokenized = len(ids)

    def finish_text(self, st: RequestState, status: RequestStatus) -> None:
        self.sync_text(st)
        if st.detok is not None and status != RequestStatus.FINISHED_STOPPED:
            st.text += st.detok.finish()

    def completion(self, st: RequestState) -> CompletionOutput:
        req = st.request
        self.sync_text(st)
        fr = req.status.value if req.status.finished else None
        metrics = RequestMetrics(
            arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time, finished_time=req.finished_time,
            time_in_queue=(req.first_scheduled_time - req.arrival_time) if req.first_scheduled_time else None,
            num_cached_tokens=req.num_cached_tokens, num_preemptions=req.num_preemptions,
            draft_tokens_proposed=req.num_drafts_proposed, draft_tokens_accepted=req.num_drafts_accepted,
            draft_tokens_verified=req.num_drafts_verified,
            draft_accepted_per_position=list(req.drafts_accepted_per_position))
        return CompletionOutput(st.index, st.text, list(req.output_token_ids),
                                st.cumulative_logprob if (st.logprobs is not None) else None,
                                st.logprobs, fr, req.stop_reason, metrics)
