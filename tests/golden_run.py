"""Run our model along the golden call sequence (prefill, then teacher-forced decode steps, each
followed by a DSpark draft) and collect outputs and intermediates, for the golden tests."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.cache import CacheConfig, comp_entries, index_keys, window_entries
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.runner.sequence_driver import SequenceDriver
from deepinfer_jax.models.weights import load_model

GOLDEN_CONFIGS = ("tiny_fp8", "tiny_bf16", "tiny_fp8_long", "tiny_fp8_long_allsel")


def model_dir_of(golden: Path, name: str) -> str:
    """``tiny_fp8_long_allsel`` ships no weights: pair its config with ``tiny_fp8_long``'s file."""
    d = golden / name
    if (d / "model.safetensors").exists():
        return str(d)
    tmp = tempfile.mkdtemp(prefix=f"{name}_")
    shutil.copy(d / "config.json", tmp)
    os.symlink((golden / "tiny_fp8_long" / "model.safetensors").resolve(), os.path.join(tmp, "model.safetensors"))
    return tmp


@functools.lru_cache(maxsize=None)
def run_golden(golden: str, name: str, index_key_dtype: str = "bf16", kv_cache_dtype: str = "bf16") -> dict:
    g_dir = Path(golden)
    d = g_dir / name
    g = dict(np.load(d / "golden.npz"))
    cfg = ModelConfig.from_json(d)
    model = load_model(model_dir_of(g_dir, name), cfg)
    hasher = EngramHasher.from_model_config(cfg, str(d / "tokenizer.json"))
    prompt = [int(t) for t in g["prompt_ids"][0]]
    S = g["decode_logits"].shape[1]
    bt = 32
    cc = CacheConfig(num_slots=2, num_blocks=32, block_tokens=bt, max_blocks_per_seq=-(-(len(prompt) + S + 1) // bt),
                     index_key_dtype=index_key_dtype, kv_cache_dtype=kv_cache_dtype)
    drv = SequenceDriver(model, cc, hasher)
    out: dict = {"cfg": cfg, "golden": g, "prompt": prompt}
    lg, main_hidden, taps = drv.step([(0, prompt)], logits="all", with_taps=True)
    out["prefill_logits_all"], out["prefill_main_hidden"], out["prefill_taps"] = lg, main_hidden, taps
    out["after_prefill_cache"] = _cache_np(drv)
    gen = g["generated_ids"][0]
    dec, taps_s, d_ids, d_lg, d_conf = [], [], [], [], []
    for s in range(S):
        lg, _, taps = drv.step([(0, [int(gen[s])])], with_taps=True)
        ids, dl, conf, _ = drv.draft([0], [int(gen[s + 1])])
        dec.append(lg[0])
        taps_s.append(taps)
        d_ids.append(ids[0])
        d_lg.append(dl[0])
        d_conf.append(conf[0])
    out.update(decode_logits=np.stack(dec), decode_taps=taps_s, dspark_ids=np.stack(d_ids),
               dspark_logits=np.stack(d_lg), dspark_confidence=np.stack(d_conf))
    out["after_decode_cache"] = _cache_np(drv)
    return out


def _cache_np(drv: SequenceDriver) -> dict:
    c = drv.cache
    return {"window": [np.asarray(window_entries(c, i), np.float32) for i in range(len(c.window))],
            "comp_kv": [np.asarray(comp_entries(c, i), np.float32) for i in range(len(c.comp_kv))],
            "index_k": [np.asarray(index_keys(c, i), np.float32) for i in range(len(c.index_k))],
            "dspark_window": [np.asarray(x, np.float32) for x in c.dspark_window],
            "blocks": list(drv.blocks[0])}


def cache_entries(cache_BPX: np.ndarray, blocks: list[int], n: int) -> np.ndarray:
    """The first ``n`` compressed entries of a sequence from a paged cache."""
    return np.concatenate([cache_BPX[b] for b in blocks])[:n] if n else np.zeros((0, cache_BPX.shape[2]))
