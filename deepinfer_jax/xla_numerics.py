"""XLA flags the reference numerics need, set when ``deepinfer_jax`` is imported.

XLA's ``xla_allow_excess_precision`` (on by default) lets a fusion keep fp32 where the program
rounds to bf16. The V4.1 reference rounds on purpose (bf16 activations between the ops of a
block, bf16-rounded attention probabilities, bf16 indexer scores), and on the GPU those skipped
roundings add up: on an H200 the golden ``tiny_bf16`` prefill (DeepSeek's reference code, see
``tests/test_golden.py``) had layer 0's attention output off by 2.8% (relative L2) and the
logits by 13%, while with the flag off layer 0 is bit-exact and the logits are off by 2.3%, as
on the CPU (1.9%; ``.device_carry``-style diagnostic of 2026-11-29, in the issue-4 note).

So the package turns excess precision off, by appending ``--xla_allow_excess_precision=false``
to ``XLA_FLAGS``, unless the user already set that flag there or set
``DEEPINFER_EXCESS_PRECISION=1``. XLA reads ``XLA_FLAGS`` when a backend starts: importing
``deepinfer_jax`` after JAX has started a backend is too late, and a warning says so.
"""

from __future__ import annotations

import os
import sys
import warnings

FLAG = "--xla_allow_excess_precision=false"
OPT_OUT_ENV = "DEEPINFER_EXCESS_PRECISION"


def apply() -> bool:
    """Append ``FLAG`` to ``XLA_FLAGS`` (see the module docstring); True if it was added now."""
    if os.environ.get(OPT_OUT_ENV) == "1":
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" in flags:  # the user's own choice wins
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
    if "jax" in sys.modules and _backend_started():
        warnings.warn(
            "deepinfer_jax was imported after JAX started a backend, so XLA will not see "
            f"{FLAG} and GPU results drift from the reference numerics; import deepinfer_jax "
            f"first, or put {FLAG} in XLA_FLAGS yourself ({OPT_OUT_ENV}=1 silences this).",
            RuntimeWarning, stacklevel=3)
    return True


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # private API moved: assume not started
        return False
