"""The environment of a test subprocess that runs on several forced CPU devices.

XLA:CPU runs a collective's devices as threads of one process and aborts the process when one
of them reaches a collective more than 40 s after the others. On a 2-core machine that also runs
other tests, a thread can be starved that long, so the limit is raised here.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_STRIP = ("--xla_force_host_platform_device_count", "--xla_cpu_collective_call_terminate_timeout_seconds")


def cpu_devices_env(n: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_STRIP)]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}",
                                         "--xla_cpu_collective_call_terminate_timeout_seconds=900"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env
