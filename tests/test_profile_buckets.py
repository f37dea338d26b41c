"""``ModelRunner.profile_buckets``: the start-up step-time curve of varlen's planner, the fastest
of at least ``repeats`` runs per bucket, and of more (up to ``max_repeats``) while a bucket's
runs stay within ``budget_s``: fast (GPU) steps are timed more often, slow ones no longer."""

from __future__ import annotations

import types

from deepinfer_jax.runner.model_runner import ModelRunner


def fake_runner(step_seconds: dict, plain_kinds=(False,)):
    runs = []

    def dispatch(sched, T, R, Td):
        runs.append((sched.spec_plain, T))
        k = sum(1 for r in runs if r == (sched.spec_plain, T))
        t = step_seconds[T] * (1.5 if k == 1 else 1.0 + 0.01 * k)  # the first run slower, then drifting up
        return types.SimpleNamespace(t_dispatch=10.0, t_done=10.0 + t, fetch=lambda: None)

    self = types.SimpleNamespace(ec=types.SimpleNamespace(token_buckets=tuple(step_seconds)),
                                 step_kinds=lambda: plain_kinds, _dispatch=dispatch,
                                 variants=lambda: [(T, 8, None) for T in step_seconds] + [(T, 4, None) for T in step_seconds],
                                 bucket_seconds={}, plain_bucket_seconds={})
    return self, runs


def test_fast_steps_get_more_runs_and_the_fastest_is_kept():
    secs = {16: 0.002, 64: 0.004, 256: 0.2}
    self, runs = fake_runner(secs, plain_kinds=(False, True))
    out = ModelRunner.profile_buckets(self, repeats=2, max_repeats=8, budget_s=0.05)
    assert out is self.bucket_seconds and set(out) == set(secs) == set(self.plain_bucket_seconds)
    per = {k: sum(1 for r in runs if r == k) for k in set(runs)}
    assert per[(False, 16)] == per[(True, 16)] == 8   # 8 x ~2 ms stays under 50 ms
    assert per[(False, 256)] == per[(True, 256)] == 2  # two 0.2 s runs: the minimum, no more
    for T, s in secs.items():
        assert abs(out[T] - s * 1.02) < 1e-12  # the second run: the fastest (first slow, then drifting)
