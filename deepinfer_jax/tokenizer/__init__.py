"""Tokenizer loading, incremental detokenization and stop-string checks (no JAX imports)."""

from .detokenizer import IncrementalDetokenizer
from .loader import TokenizerInfo, load_tokenizer
from .stop_checker import StopChecker

__all__ = ["IncrementalDetokenizer", "StopChecker", "TokenizerInfo", "load_tokenizer"]
