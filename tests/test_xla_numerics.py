"""``import deepinfer_jax`` turns XLA's excess precision off (reference numerics on the GPU; see
``deepinfer_jax/xla_numerics.py``), keeps a user's own setting, and warns when it comes too late.
Each case runs in a fresh interpreter: XLA_FLAGS only matter before a backend starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG = "--xla_allow_excess_precision=false"


def _run(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DEEPINFER_EXCESS_PRECISION")}
    e.update(env, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-W", "always", "-c", code], env=e, capture_output=True, text=True,
                          timeout=120)


SHOW = "import os, jax; jax.devices(); print(os.environ.get('XLA_FLAGS', ''))"


def test_import_adds_the_flag_before_the_backend_starts():
    r = _run("import deepinfer_jax; " + SHOW, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["--xla_force_host_platform_device_count=2", FLAG]
    assert "RuntimeWarning" not in r.stderr


@pytest.mark.parametrize("env", [dict(XLA_FLAGS="--xla_allow_excess_precision=true"),
                                 dict(DEEPINFER_EXCESS_PRECISION="1")], ids=["user-flag", "opt-out"])
def test_user_choice_wins(env):
    r = _run("import deepinfer_jax; " + SHOW, **env)
    assert r.returncode == 0, r.stderr
    assert FLAG not in r.stdout


def test_warns_when_jax_started_first():
    r = _run("import jax; jax.devices(); import deepinfer_jax")
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" in r.stderr and FLAG in r.stderr
