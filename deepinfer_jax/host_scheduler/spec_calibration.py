"""Online per-position temperature scaling of the DSpark confidences (the paper's STS) for
variable-length verification.

Algorithm 1 (``spec_varlen.plan_varlen``) ranks draft positions by their predicted survival, so a
confidence head that is over- or under-confident at some position buys the wrong verification
lengths. ``OnlineTemperatureCalibrator`` records, for every verified row, the confidence logits of
its drafts and how many were accepted, and refits ``spec_varlen.TemperatureCalibrator`` (one
temperature per draft position, fitted on the pairs that reached that position) over a sliding
window every ``refit_every`` rows. Until the first fit every temperature is 1 (the raw head).
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from deepinfer_jax.host_scheduler.spec_varlen import TemperatureCalibrator

__all__ = ["OnlineTemperatureCalibrator"]


class OnlineTemperatureCalibrator:
    def __init__(self, num_positions: int, window: int = 4096, refit_every: int = 64, min_pairs: int = 10):
        for name, v in (("num_positions", num_positions), ("window", window), ("refit_every", refit_every),
                        ("min_pairs", min_pairs)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"OnlineTemperatureCalibrator: {name}={v!r} must be an int >= 1")
        self.K = num_positions
        self.refit_every, self.min_pairs = refit_every, min_pairs
        self._rows: collections.deque = collections.deque(maxlen=window)
        self._since_fit = 0
        self.observed = 0          # verified rows recorded since start
        self.fits = 0
        self._cal = TemperatureCalibrator(num_positions, min_pairs)

    @property
    def temperature_K(self) -> np.ndarray:
        return self._cal.temperature_K.copy()

    def observe(self, conf_logits: Sequence[float], num_drafts: int, num_accepted: int) -> None:
        """One verified row: the confidence logits of its ``num_drafts`` drafts (conditional:
        position ``k`` predicts acceptance given drafts ``< k`` accepted), ``num_accepted`` of them
        accepted. Positions after the first rejection are not reached and carry no evidence."""
        if not 0 <= num_accepted <= num_drafts <= self.K:
            raise ValueError(f"observe: num_accepted={num_accepted}, num_drafts={num_drafts} "
                             f"(need 0 <= accepted <= drafts <= {self.K})")
        if num_drafts == 0:
            return
        z = np.zeros(self.K)
        z[:num_drafts] = np.asarray(conf_logits, np.float64)[:num_drafts]
        self._rows.append((z, num_drafts, num_accepted))
        self.observed += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self.refit()

    def refit(self) -> None:
        if not self._rows:
            return
        z = np.stack([r[0] for r in self._rows])
        n = np.asarray([r[1] for r in self._rows])[:, None]
        a = np.asarray([r[2] for r in self._rows])[:, None]
        k = np.arange(self.K)[None, :]
        reached = (k <= a) & (k < n)
        accepted = k < a
        self._cal = TemperatureCalibrator(self.K, self.min_pairs).fit(z, accepted, reached)
        self._since_fit = 0
        self.fits += 1

    def probabilities(self, conf_logits_RK) -> np.ndarray:
        """Calibrated conditional acceptance probabilities sigmoid(z / T_k), ``[R, K']`` for
        logits ``[R, K']`` (``K' <= K``)."""
        return self._cal.calibrate(conf_logits_RK)
