"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def golden_root() -> Path:
    """The v41_tiny golden data: ``$DEEPINFER_GOLDEN`` or ``<repo>/../shared/golden/v41_tiny``."""
    env = os.environ.get("DEEPINFER_GOLDEN")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "golden" / "v41_tiny"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    root = golden_root()
    if not root.is_dir():
        pytest.skip(f"golden data not found at {root} (set DEEPINFER_GOLDEN)")
    return root
