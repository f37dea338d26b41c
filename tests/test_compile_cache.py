"""LLM(compile_cache=...): a second engine start loads its compiled steps from disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from deepinfer_jax.entrypoints import compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

START = textwrap.dedent("""
    import json, sys
    import jax
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
    from deepinfer_jax import LLM, SamplingParams
    llm = LLM("v41-tiny", progress=False, compile_cache=sys.argv[1], max_num_seqs=2, max_num_batched_tokens=32)
    out = llm.generate(["ab"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    print(json.dumps({"hits": len(hits), "tokens": out[0].outputs[0].token_ids}))
""")


def _start(cache_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop(compile_cache.ENV, None)
    p = subprocess.run([sys.executable, "-c", START, cache_dir], capture_output=True, text=True, env=env,
                       timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_second_start_loads_the_compiled_steps(tmp_path):
    d = str(tmp_path / "xla")
    cold = _start(d)
    assert cold["hits"] == 0 and len(os.listdir(d)) > 0  # the step variants were written
    warm = _start(d)
    assert warm["hits"] >= 1 and warm["tokens"] == cold["tokens"]


def test_setting_resolves_and_bad_values_name_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    assert compile_cache.resolve(None) is None and compile_cache.resolve(False) is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.resolve(True) == str(tmp_path / "deepinfer_jax" / "xla")
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve(None) is None
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "c"))
    assert compile_cache.resolve(None) == str(tmp_path / "c")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="compile_cache=.*not a directory"):
        compile_cache.resolve(str(f))
    with pytest.raises(ValueError, match="compile_cache=3"):
        compile_cache.resolve(3)


def test_cli_refuses_a_cache_path_that_is_a_file(tmp_path, capsys):
    from deepinfer_jax.entrypoints import cli

    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main(["generate", "--model", "v41-tiny", "--compile-cache", str(f)]) == 2
    assert "--compile-cache" in capsys.readouterr().err
