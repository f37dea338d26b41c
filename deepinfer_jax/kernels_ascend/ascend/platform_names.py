"""Platform names an Ascend PJRT plugin may report as ``jax.default_backend()``.

No Ascend plugin is installed here, so the name is not observed: ``ascend`` and ``npu`` are the
candidates, and ``$DEEPINFER_ASCEND_PLATFORM`` adds the one a plugin actually reports."""

from __future__ import annotations

import os

ASCEND_PLATFORMS = tuple(dict.fromkeys(("ascend", "npu", *filter(None, [os.environ.get("DEEPINFER_ASCEND_PLATFORM")]))))
