"""StatsLogger: one record per engine step and a summary (FEATURES §9).

Per step: scheduled tokens and the padded bucket, prefill/decode split, rows, step time (dispatch
to results on the host), host time (scheduling + input building + dispatch), queue wait of the
requests admitted, prefix-cache hit tokens (those not recomputed: the cached length minus the
replayed tail), preemptions, tokens generated and when the outputs reached the host. ``summary()``
aggregates them with the number of generated tokens and the wall time (and the generated tokens/s
of the full-batch window: from the first to the last step that ran the most rows), and lists the
kernels that fell back to the jnp reference in the steps' traces (``kernel_fallbacks``:
"op: reason" -> traced calls, from ``kernels_pallas/ops.py``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics


@dataclasses.dataclass
class StepStats:
    step_id: int
    num_tokens: int
    bucket_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_rows: int
    step_time_s: float         # dispatch -> outputs on the host
    host_time_s: float         # schedule + build inputs + dispatch
    cache_hit_tokens: int
    preemptions: int
    queue_wait_s: list[float]
    # speculative decoding: verification rows (rows with drafts), drafts they carried and
    # accepted, accepted drafts per draft position
    spec_rows: int = 0
    drafts_proposed: int = 0
    drafts_verified: int = 0
    drafts_accepted: int = 0
    drafts_accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    spec_plain: bool = False   # a plain step of a speculative engine (no drafts verified or proposed)
    # where the host time goes: planning (scheduler + grammar masks), building the step's input
    # arrays, the jitted call itself (argument handling and transfers, not device work; with
    # EngineConfig.dispatch_thread only the hand-over to the launcher thread), and applying the
    # results (outputs, stop checks, detokenising; after the device step)
    schedule_s: float = 0.0
    inputs_s: float = 0.0
    call_s: float = 0.0
    process_s: float = 0.0
    launch_s: float = 0.0      # dispatch_thread: the jitted call on the launcher thread
    generated_tokens: int = 0  # tokens this step added to the requests' outputs
    t_done_s: float = 0.0      # when its outputs reached the host (time.perf_counter)


class StatsLogger:
    def __init__(self):
        self.steps: list[StepStats] = []
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.finished_requests = 0
        self.wall_time_s = 0.0
        self.kernel_fallbacks: dict[str, int] = {}  # set by the engine from its runner

    def record(self, s: StepStats) -> None:
        self.steps.append(s)

    def reset(self) -> None:
        self.__init__()

    def summary(self) -> dict:
        st = self.steps
        times = [s.step_time_s for s in st]
        waits = [w for s in st for w in s.queue_wait_s]
        tok = sum(s.num_tokens for s in st)
        pad = sum(s.bucket_tokens for s in st)
        pct = (lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0)
        wall = self.wall_time_s or 1e-9
        spec_rows = sum(s.spec_rows for s in st)
        verified = sum(s.drafts_verified for s in st)
        accepted = sum(s.drafts_accepted for s in st)
        n_pos = max((len(s.drafts_accepted_per_position) for s in st), default=0)
        per_pos = [sum(s.drafts_accepted_per_position[j] for s in st if j < len(s.drafts_accepted_per_position))
                   for j in range(n_pos)]
        # the full-batch window: from the first to the last step that ran the most rows (with
        # requests waiting in the queue, the engine's steady state; a wave's ramp-up and its tail
        # of the last few requests fall outside)
        most = max((s.num_rows for s in st), default=0)
        full = [i for i, s in enumerate(st) if s.num_rows == most] if st else []
        full_s = st[full[-1]].t_done_s - st[full[0]].t_done_s if full else 0.0
        full_tok = sum(s.generated_tokens for s in st[full[0] + 1:full[-1] + 1]) if full else 0
        return {
            "steps": len(st),
            "requests": self.finished_requests,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "scheduled_tokens": tok,
            "prefill_tokens": sum(s.num_prefill_tokens for s in st),
            "decode_tokens": sum(s.num_decode_tokens for s in st),
            "padding_fraction": (1 - tok / pad) if pad else 0.0,
            "cache_hit_tokens": sum(s.cache_hit_tokens for s in st),
            "preemptions": sum(s.preemptions for s in st),
            "wall_time_s": self.wall_time_s,
            "generated_tokens_per_s": self.generated_tokens / wall,
            "full_batch_rows": st[full[0]].num_rows if full else 0,
            "full_batch_steps": len(st[full[0] + 1:full[-1] + 1]) if full else 0,
            "full_batch_generated_tokens_per_s": full_tok / full_s if full_s > 0 else 0.0,
            "total_tokens_per_s": tok / wall,
            "step_time_mean_s": statistics.fmean(times) if times else 0.0,
            "step_time_p50_s": pct(times, 0.5),
            "step_time_p90_s": pct(times, 0.9),
            "host_time_mean_s": statistics.fmean([s.host_time_s for s in st]) if st else 0.0,
            "host_breakdown_mean_s": {k: statistics.fmean([getattr(s, k + "_s") for s in st]) if st else 0.0
                                      for k in ("schedule", "inputs", "call", "process")},
            "launch_mean_s": statistics.fmean([s.launch_s for s in st]) if st else 0.0,
            "queue_wait_mean_s": statistics.fmean(waits) if waits else 0.0,
            "kernel_fallbacks": dict(self.kernel_fallbacks),
            # speculative decoding: tokens per verification row (accepted drafts + the
            # correction / bonus), drafts verified and accepted, accepted drafts per position
            "spec_rows": spec_rows,
            "drafts_proposed": sum(s.drafts_proposed for s in st),
            "drafts_verified": verified,
            "drafts_accepted": accepted,
            "draft_acceptance_rate": accepted / verified if verified else 0.0,
            "mean_accepted_length": 1 + accepted / spec_rows if spec_rows else 0.0,
            "drafts_accepted_per_position": per_pos,
            "spec_plain_steps": sum(s.spec_plain for s in st),
        }

    def summary_line(self) -> str:
        s = self.summary()
        return (f"{s['requests']} requests, {s['prompt_tokens']} prompt + {s['generated_tokens']} generated tokens "
                f"in {s['wall_time_s']:.2f}s: {s['generated_tokens_per_s']:.1f} gen tok/s, "
                f"{s['total_tokens_per_s']:.1f} tok/s total; {s['steps']} steps "
                f"(p50 {1e3 * s['step_time_p50_s']:.1f} ms), cache hits {s['cache_hit_tokens']} tok, "
                f"{s['preemptions']} preemptions"
                + (f"; DSpark: mean accepted length {s['mean_accepted_length']:.2f} "
                   f"({s['drafts_accepted']}/{s['drafts_verified']} drafts accepted)" if s["spec_rows"] else "")
                + (f", {s['spec_plain_steps']} plain steps" if s["spec_plain_steps"] else "")
                + (f"; kernels on the reference: {'; '.join(s['kernel_fallbacks'])}" if s["kernel_fallbacks"] else ""))

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"summary": self.summary(), "steps": [dataclasses.asdict(s) for s in self.steps]}, f, indent=1)
