"""The device targets' capsules, from the ``_ascend_targets`` extension (built only with CANN)."""

from __future__ import annotations

import importlib

from deepinfer_jax.kernels_ascend.errors import FfiUnavailable

ASCEND_MODULE = "deepinfer_jax.kernels_ascend.ascend._ascend_targets"


def capsules(platform: str) -> dict:
    try:
        mod = importlib.import_module(ASCEND_MODULE)
    except ImportError as e:
        raise FfiUnavailable(
            f"kernels='ffi' on platform {platform!r} needs the Ascend targets ({ASCEND_MODULE}), which were "
            f"not built ({e}). They build at install time only when the CANN toolkit is found: source CANN's "
            "set_env.sh (it sets ASCEND_TOOLKIT_HOME) and reinstall the package. See "
            "deepinfer_jax/kernels_ascend/README.md: the device kernels have not run on Ascend yet.") from None
    return mod.targets()
