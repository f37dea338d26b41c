"""What ``LLM.generate`` returns (vLLM's shapes): ``RequestOutput`` with one ``CompletionOutput``
per sample (``SamplingParams.n``), logprobs as ``{token_id: Logprob}`` per position, and
per-request ``RequestMetrics``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None           # 1 = most likely; None when only the chosen token is known
    decoded_token: str | None = None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    time_in_queue: float | None
    num_cached_tokens: int            # prompt tokens the prefix cache saved (cached length minus replayed)
    num_preemptions: int
    # speculative decoding: drafts the DSpark stages proposed, that verification rows carried,
    # and that were accepted (in all, and per draft position)
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    draft_tokens_verified: int = 0
    draft_accepted_per_position: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None         # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    metrics: RequestMetrics | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None   # of the first sample (outputs[i].metrics per sample)
    num_cached_tokens: int = 0              # prompt tokens not recomputed thanks to the prefix cache
