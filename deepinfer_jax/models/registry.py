"""Model names -> model directories: a directory is used as is; a shipped model's name
(``SHIPPED``: the trained ``v41-small-code``, package data under ``deepinfer_jax/assets/``) is its
directory there; a preset name (``v41-tiny``, ``v41-flash``) has no released weights here, so on
first use a random-weight checkpoint of that preset (official format, with a small tokenizer) is
written to ``$DEEPINFER_CACHE`` (default ``~/.cache/deepinfer_jax``) and reused afterwards; for
weights drawn on the device (``EngineConfig.load_format="dummy"``) only its ``config.json`` and
tokenizer are written there (``weights=False``).

``DEFAULT_MODEL`` (what ``LLM()`` and the CLI load) is the shipped trained model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# name -> directory of the models that ship with the package (see its provenance.json)
SHIPPED = {"v41-small-code": ASSETS / "v41-small-code"}
DEFAULT_MODEL = "v41-small-code"


def cache_root() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer_jax"))


def resolve_model(model: str, seed: int = 0, progress: bool = True, weights: bool = True) -> str:
    """A model directory for ``model``: an existing directory, or a preset's random checkpoint
    (``weights=False``: a directory with the preset's config and tokenizer alone)."""
    from deepinfer_jax.config import PRESETS, preset

    model = os.fspath(model)
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ValueError(f"model={model!r}: directory has no config.json")
        return model
    if model in SHIPPED:
        path = SHIPPED[model]
        if not (path / "config.json").exists():
            raise ValueError(f"model={model!r}: the shipped model's files are missing from {path} "
                             "(a partial install? reinstall the package)")
        return str(path)
    if model not in PRESETS:
        raise ValueError(f"model={model!r}: not a directory, a shipped model ({sorted(SHIPPED)}) "
                         f"or a preset (presets: {sorted(PRESETS)})")
    out = cache_root() / (f"{model}-random-seed{seed}" if weights else f"{model}-config")
    if not (out / "config.json").exists():
        from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint, write_random_model_config

        tmp = out.with_name(out.name + f".partial{os.getpid()}")
        if weights:
            print(f"writing a random-weight {model} checkpoint to {out} (first use)", file=sys.stderr)
            write_random_checkpoint(preset(model), tmp, seed=seed, progress=progress)
        else:  # the same config.json and tokenizer as the checkpoint's
            write_random_model_config(preset(model), tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
