"""The verification-or-plain choice of varlen speculation (host_scheduler/spec_switch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.host_scheduler.spec_switch import AcceptanceRates, DraftSwitch


def test_acceptance_rates_count_the_judged_positions_only():
    r = AcceptanceRates(4, decay=1.0)
    np.testing.assert_allclose(r.rates(), 0.5)  # the prior before any observation
    r.observe(3, 1)  # draft 1 accepted, draft 2 rejected, draft 3 never judged
    r.observe(2, 2)  # both accepted
    r.observe(0, 0)  # a row without drafts tells nothing
    np.testing.assert_allclose(r.judged, [2, 2, 0, 0])
    np.testing.assert_allclose(r.accepted, [2, 1, 0, 0])
    np.testing.assert_allclose(r.rates(), [2.5 / 3, 1.5 / 3, 0.5, 0.5])


def test_acceptance_rates_follow_the_observed_acceptance():
    rng = np.random.default_rng(0)
    true = np.array([0.8, 0.6, 0.4])
    r = AcceptanceRates(3)
    for _ in range(4000):
        ok = rng.random(3) < true
        a = int(np.argmin(ok)) if not ok.all() else 3
        r.observe(3, a)
    # decay 0.995: about 200 effective rows per position, so a few points of noise
    np.testing.assert_allclose(r.rates(), true, atol=0.1)


def test_with_drafts_at_hand_the_faster_option_wins():
    sw = DraftSwitch()
    assert sw.choose(8, True, theta_spec=12.0, theta_plain=10.0) is False
    assert sw.choose(8, True, theta_spec=9.0, theta_plain=10.0) is True
    assert sw.choose(8, True, theta_spec=10.0, theta_plain=10.0) is True  # a tie: the cheaper step
    assert sw.plain_run == 2  # the two plain steps in a row


def test_prefill_only_steps_keep_the_mode():
    sw = DraftSwitch()
    assert sw.choose(0, False, 0.0, 0.0) is False
    sw.choose(8, True, 1.0, 2.0)
    assert sw.choose(0, False, 0.0, 0.0) is True


def test_back_to_speculation_only_with_a_margin():
    sw = DraftSwitch(margin=0.05)
    assert sw.choose(8, True, 9.0, 10.0) is True
    assert sw.choose(8, False, 10.4, 10.0) is True    # within the margin: stay plain
    assert sw.choose(8, False, 10.6, 10.0) is False   # beyond it: a drafting step
    assert sw.choose(8, True, 11.0, 10.0) is False    # and its drafts pay


def test_backoff_doubles_when_a_drafting_step_is_dropped_at_once_and_resets_after_steady_use():
    sw = DraftSwitch(margin=0.0, max_backoff=8, steady=3, probe_every=1000)
    sw.choose(8, True, 9.0, 10.0)  # plain
    expected = [1, 2, 4, 8, 8]
    for want in expected:
        assert sw.backoff == want
        # plain steps until the backoff lets a drafting step through
        n = 0
        while sw.choose(8, False, 11.0, 10.0):
            n += 1
        assert n == max(0, want - 1)
        assert sw.choose(8, True, 9.0, 10.0) is True  # its drafts did not pay after all
    while sw.choose(8, False, 11.0, 10.0):
        pass
    for _ in range(3):
        assert sw.choose(8, True, 11.0, 10.0) is False
    assert sw.backoff == 1


@pytest.mark.parametrize("probe_every", [4, 16])
def test_plain_mode_probes_now_and_then(probe_every):
    """Even where speculation looks hopeless, a drafting step every ``probe_every`` plain steps
    refreshes the acceptance rates and the verification steps' timing."""
    sw = DraftSwitch(probe_every=probe_every)
    sw.choose(8, True, 1.0, 10.0)
    runs = []
    for _ in range(3):
        n = 0
        while sw.choose(8, False, 1.0, 10.0):
            n += 1
        runs.append(n)
        assert sw.choose(8, True, 1.0, 10.0) is True
    assert runs == [probe_every - 1] + [probe_every - 1] * 2
