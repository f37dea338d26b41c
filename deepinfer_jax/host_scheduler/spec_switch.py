"""Whether a varlen step speculates at all: a verification step or a plain step (plain Python).

Algorithm 1 (``spec_varlen.py``) chooses how many drafts each row verifies, from zero up, and its
stopping rule keeps only what pays. It cannot remove the cost a verification step has with no
drafts at all: K + 1 logits rows per row, the undo log of the cache writes and the drafting of
the next block. Where the target is small next to that (a small model, or a launch-bound GPU
step), a verification step that verifies nothing is slower than a step of the plain engine, and
varlen would fall below no speculation at large batches. So the engine also runs plain steps
(``EngineConfig.spec_plain_steps``; ``SchedulerOutput.spec_plain``): one logits row per row, no
undo, no drafts, and so no drafts to verify in the step after it.

The choice, each step, for the R decoding rows and P prompt tokens the step will carry, with
``SPS_v`` and ``SPS_p`` the steps per second of verification and plain steps at a token count:

* theta_plain = R * SPS_p(R + P): tokens per second of a plain step;
* drafts at hand (the previous step drafted): Algorithm 1's plan, tau = R + sum of the prefix
  survivals it verifies, theta_spec = tau * SPS_v(R + P + drafts). A verification step when
  theta_spec > theta_plain, else a plain step (the drafts are dropped);
* no drafts at hand (the previous step was plain): the same plan on the acceptance rates observed
  so far (``AcceptanceRates``), as if every row had drafts. A verification step with no drafts
  (it drafts for the next step) when that theta_spec beats theta_plain by ``margin``, and not
  before ``backoff`` plain steps; and every ``probe_every`` plain steps regardless, so that the
  rates and the verification steps' timing do not go stale.

``backoff`` doubles (up to ``max_backoff``) each time a drafting step is followed at once by a
plain step, and returns to 1 after ``steady`` verification steps in a row: the choice does not
flap where the two options are close. Steps without decoding rows (prefill only) keep the mode.
"""

from __future__ import annotations

import numpy as np


class AcceptanceRates:
    """Per draft position j (1..K): the observed probability that draft j is accepted given that
    drafts 1..j-1 were (exponentially decayed counts, ``decay`` per row that reached j; ``prior``
    with the weight of one observation before any)."""

    def __init__(self, K: int, decay: float = 0.995, prior: float = 0.5) -> None:
        # Python floats, not numpy arrays: observe runs once per verified row, and numpy's
        # per-call cost on K entries was most of the time it took
        self.judged = [0.0] * K
        self.accepted = [0.0] * K
        self.decay = decay
        self.prior = prior

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One verified row: drafts 1..min(a + 1, l) were judged, 1..a accepted."""
        n = min(num_accepted + 1, num_drafts)
        d, judged, accepted = self.decay, self.judged, self.accepted
        for j in range(n):
            judged[j] = d * judged[j] + 1.0
            accepted[j] = d * accepted[j] + (1.0 if j < num_accepted else 0.0)

    def rates(self) -> np.ndarray:
        """[K] conditional acceptance probabilities."""
        return (np.asarray(self.accepted) + self.prior) / (np.asarray(self.judged) + 1.0)


class DraftSwitch:
    """The verification-or-plain choice with its hysteresis (module docstring)."""

    def __init__(self, margin: float = 0.05, probe_every: int = 64, max_backoff: int = 64, steady: int = 8) -> None:
        self.margin, self.probe_every, self.max_backoff, self.steady = margin, probe_every, max_backoff, steady
        self.plain = False        # the mode of the newest planned step
        self.backoff = 1
        self.plain_run = 0        # plain steps in a row
        self.spec_run = 0         # verification steps in a row
        self.primed = False       # the newest planned step drafted after a plain step

    def choose(self, decoding_rows: int, have_drafts: bool, theta_spec: float, theta_plain: float) -> bool:
        """Whether the step being planned is plain; updates the state as if it runs."""
        if decoding_rows == 0:
            plain = self.plain
        elif have_drafts:
            plain = not theta_spec > theta_plain
            if plain and self.primed:
                self.backoff = min(2 * self.backoff, self.max_backoff)
        else:
            better = theta_spec > theta_plain * (1.0 + self.margin)
            if self.plain:
                plain = not ((better and self.plain_run >= self.backoff) or self.plain_run >= self.probe_every)
            else:  # speculating, but no row has drafts (e.g. none had room for one)
                plain = not better
        self.primed = self.plain and not plain
        if plain:
            self.plain_run += 1
            self.spec_run = 0
        else:
            self.plain_run = 0
            self.spec_run += 1
            if self.spec_run >= self.steady:
                self.backoff = 1
        self.plain = plain
        return plain
