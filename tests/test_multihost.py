"""Multi-process: 2 processes x 4 CPU devices on loopback, one global 4 x 2 mesh
(``sharding.mesh.initialize_distributed``, gloo collectives), give the single-process tokens.

Both processes run the same engine on the same requests — a mixed batch of chunked prompts and
a second wave that hits the first wave's prefixes — and each must return every request's
tokens, equal to one device's.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cpu_devices import cpu_devices_env

REPO = Path(__file__).resolve().parent.parent

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    pid, port = int(sys.argv[1]), sys.argv[2]
    from deepinfer_jax.sharding.mesh import initialize_distributed
    initialize_distributed(f"127.0.0.1:{{port}}", 2, pid)
    import jax
    from deepinfer_jax import LLM, SamplingParams
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    prompts = json.loads(sys.argv[3])
    llm = LLM({ckpt!r}, dp=4, cp=2, **json.loads(sys.argv[4]))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    half = len(prompts) // 2
    outs = [o for w in (prompts[:half], prompts[half:]) for o in llm.generate(w, sp, use_tqdm=False)]
    print("RESULT", json.dumps(dict(tokens=[o.outputs[0].token_ids for o in outs],
                                    cached=[o.num_cached_tokens for o in outs])), flush=True)
""")

KW = dict(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64], row_buckets=[4], max_model_len=256,
          block_tokens=32, num_blocks=24, prefix_replay="exact", progress=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
    from deepinfer_jax.config import preset

    d = tmp_path_factory.mktemp("v41_tiny_multihost")
    write_random_checkpoint(preset("v41-tiny"), d, seed=5, progress=False)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_device(ckpt):
    rng = np.random.default_rng(3)
    wave1 = [rng.integers(3, 250, size=int(n)).tolist() for n in (9, 190, 40, 180, 70, 120)]
    wave2 = [wave1[i][:170] + rng.integers(3, 250, size=6).tolist() for i in (1, 3, 1)]
    prompts = wave1 + wave2
    env = cpu_devices_env(4)
    code, port = _SCRIPT.format(ckpt=str(ckpt)), str(_free_port())
    args = [json.dumps(prompts), json.dumps(KW)]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i), port, *args], env=env, cwd=str(REPO),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        from deepinfer_jax import LLM, SamplingParams

        llm = LLM(str(ckpt), **{**KW, "token_buckets": (64,), "row_buckets": (4,)})
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        ref = [o.outputs[0].token_ids for w in (wave1, wave2) for o in llm.generate(w, sp, use_tqdm=False)]
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (so, se) in zip(procs, results):
        assert p.returncode == 0, f"process failed:\n{so[-2000:]}\n{se[-5000:]}"
    got = [json.loads(next(ln for ln in so.splitlines() if ln.startswith("RESULT"))[7:]) for so, _ in results]
    for g in got:
        assert g["tokens"] == ref
        assert all(c > 0 for c in g["cached"][len(wave1):]), g["cached"]   # wave 2 hit on its rank
    assert got[0] == got[1]
