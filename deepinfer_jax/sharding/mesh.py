"""The device mesh: axes ``("dp", "cp")``.

* ``dp``: attention data parallel (different requests per shard; attention weights replicated).
* ``cp``: context parallel for long prefills.
* ``ep`` is not a mesh axis of its own: the expert-parallel group is the flattened ``dp x cp``
  group, i.e. logical ``"expert"`` maps to the mesh axes ``("dp", "cp")`` (``partition.py``).

Multi-host: call ``initialize_distributed`` (``jax.distributed.initialize``) in every process
first; ``make_mesh`` then spans ``jax.devices()`` (all processes' devices) - the same program,
more devices. Every process runs the same engine on the same requests (the host schedulers
plan identically) and gets every output.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("dp", "cp")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    cp: int = 1

    def __post_init__(self):
        for f in ("dp", "cp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ParallelConfig.{f}={v!r}: must be a positive int")

    @property
    def num_devices(self) -> int:
        return self.dp * self.cp

    @property
    def ep(self) -> int:
        """Size of the expert-parallel group (flattened dp x cp)."""
        return self.dp * self.cp

    def validate(self, n_devices: int) -> "ParallelConfig":
        """Check that the mesh ``dp x cp`` uses exactly ``n_devices`` devices."""
        if n_devices % self.dp:
            raise ValueError(f"ParallelConfig.dp={self.dp}: does not divide the {n_devices} devices")
        if (n_devices // self.dp) % self.cp:
            raise ValueError(f"ParallelConfig.cp={self.cp}: does not divide the {n_devices // self.dp} "
                             f"devices per dp group ({n_devices} devices, dp={self.dp})")
        if self.dp * self.cp != n_devices:
            raise ValueError(f"ParallelConfig.dp*cp = {self.dp}*{self.cp} = {self.dp * self.cp} must equal "
                             f"the number of devices ({n_devices})")
        return self


def make_mesh(parallel: ParallelConfig, devices: Sequence | None = None) -> Mesh:
    """A ``Mesh`` of shape ``(dp, cp)`` with axis names ``("dp", "cp")`` over ``devices``
    (default: all of ``jax.devices()``; their count must be ``dp * cp``). ``cp`` is the minor
    axis, so a cp group sits on neighbouring devices (same host / NVLink island)."""
    devices = list(jax.devices() if devices is None else devices)
    parallel.validate(len(devices))
    shape = (parallel.dp, parallel.cp)
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    except Exception:  # topology helper does not know this platform / shape: plain order
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, **kw) -> None:
    """``jax.distributed.initialize`` for a multi-process mesh, before any other JAX call. On CPU
    it also selects the gloo collectives (XLA:CPU has no cross-process collectives without
    them). Arguments as ``jax.distributed.initialize``; on a cluster it finds them itself
    (SLURM, Open MPI, ...)."""
    import os

    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] in ("cpu", ""):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, **kw)
