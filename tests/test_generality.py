"""Any configuration ``ModelConfig`` accepts runs: random valid V4.1 configs (``random_configs``)
load from a random checkpoint, and the engine and the model driven directly agree.

Per config (one test per seed, so that each config's few executables compile once):

* the random checkpoint loads (``LLM`` and ``load_model``);
* ``LLM.generate`` greedy on a batch equals each request alone, and equals ``SequenceDriver``
  greedy (prompts longer than a step, so both chunk their prefill);
* ``SequenceDriver``: a prompt prefilled in odd chunks gives the logits and greedy tokens of the
  same prompt in one step;
* DSpark drafts run: in vocabulary, finite, and equal for the two slots with the same history (one
  prefilled in chunks, one in one step), whichever order the slots come in.

Shapes: every step, engine and driver, runs at one padded shape (``T`` tokens, ``R`` rows), as in
test_engine.py: on CPU XLA's fp32 results may depend on a step's padded shape (README,
"Numerics"), so token-exact comparisons need a fixed shape. With it, the logits are expected
bitwise equal; ``ATOL`` only absorbs nothing-but-rounding noise far below one bf16 ulp.

Default run: ``DEFAULT_SEEDS``; ``-m slow``: ``SLOW_SEEDS`` (37 more configs).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.models.cache import CacheConfig, default_block_tokens
from deepinfer_jax.runner.engram_hash import EngramHasher
from deepinfer_jax.runner.sequence_driver import SequenceDriver
from deepinfer_jax.checkpoint.random_checkpoint import write_random_checkpoint
from deepinfer_jax.models.weights import load_model

from random_configs import describe, random_config

# default: fp8/fp8 with candidate blocks of 6 at ratio 2 (blocks of 60 positions), fp8/fp4 with
# ratio 4 only and a one-expert DSpark MoE, bf16 with candidate blocks of 5 at ratio 4 (60)
DEFAULT_SEEDS = (3, 20, 27)
SLOW_SEEDS = tuple(s for s in range(40) if s not in DEFAULT_SEEDS)
T, R = 32, 4            # tokens and rows of every step
MAX_LEN = 160
NEW = 5                 # generated tokens per request
PROMPT_LENS = (45, 19, 70)
ATOL = RTOL = 1e-5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def prompts_for(cfg, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(1000 + seed)
    hi = cfg.vocab_size - 1  # no special ids 0-2, no DSpark noise id V-1
    return [rng.integers(3, hi, size=n).tolist() for n in PROMPT_LENS]


def driver_for(model, cfg, model_dir) -> SequenceDriver:
    bt = default_block_tokens(cfg)
    per_seq = -(-MAX_LEN // bt)
    hasher = EngramHasher.from_model_config(cfg, os.path.join(model_dir, "tokenizer.json")) \
        if cfg.engram_enabled else None
    return SequenceDriver(model, CacheConfig(num_slots=R, num_blocks=R * per_seq, block_tokens=bt,
                                             max_blocks_per_seq=per_seq), hasher)


def driver_greedy(drv, slot: int, prompt, chunks) -> tuple[list[int], np.ndarray]:
    """Greedy continuation at the fixed step shape; prefill in pieces of the given lengths."""
    i = 0
    for n in chunks:
        lg, _, _ = drv.step([(slot, prompt[i:i + n])], num_tokens=T, num_rows=R)
        i += n
    assert i == len(prompt)
    first = lg[0].copy()
    out = [int(np.argmax(lg[0]))]
    for _ in range(NEW - 1):
        lg, _, _ = drv.step([(slot, [out[-1]])], num_tokens=T, num_rows=R)
        out.append(int(np.argmax(lg[0])))
    return out, first


def pieces(n: int, size: int) -> list[int]:
    return [min(size, n - i) for i in range(0, n, size)]


def check_config(seed: int, tmp_path) -> None:
    cfg = random_config(seed)
    what = f"seed {seed}: {describe(cfg)}"
    model_dir = str(tmp_path / f"cfg{seed}")
    write_random_checkpoint(cfg, model_dir, seed=seed, progress=False)

    # --- engine: batch vs alone
    llm = LLM(model_dir, max_num_seqs=R, max_num_batched_tokens=T, token_buckets=(T,), max_model_len=MAX_LEN,
              yoco_truncation="off", progress=False)
    cfg = llm.model_config  # as written (Engram table rows, compressed vocab from the tokenizer)
    prompts = prompts_for(cfg, seed)
    batch = llm.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in batch]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == alone, f"batch != alone; {what}"
    for o in batch:
        assert np.isfinite(o.outputs[0].cumulative_logprob), f"non-finite logprob; {what}"
        assert all(0 <= t < cfg.vocab_size for t in o.outputs[0].token_ids), what

    # --- the model driven directly, same step shape (slots 0-2)
    drv = driver_for(load_model(model_dir, cfg), cfg, model_dir)
    want, first = zip(*[driver_greedy(drv, slot, p, pieces(len(p), T)) for slot, p in enumerate(prompts)])
    assert got == list(want), f"engine != SequenceDriver; {what}"

    # --- chunked prefill vs one step: prompt 1 (19 tokens) went in one step into slot 1
    one = 1
    assert len(prompts[one]) <= T
    chunked, lg_chunked = driver_greedy(drv, 3, prompts[one], [5, 7, 7])
    np.testing.assert_allclose(lg_chunked, first[one], atol=ATOL, rtol=RTOL, err_msg=f"chunked != one-shot; {what}")
    assert chunked == want[one], f"chunked != one-shot; {what}"

    # --- DSpark drafts: slots 1 and 3 hold the same history
    if cfg.dspark_enabled:
        y = chunked[-1]
        ids, lg, conf, _ = drv.draft([1, 3], [y, y])
        ids_r, _, conf_r, _ = drv.draft([3, 1], [y, y])
        assert ids.shape == (2, cfg.dspark_block_size + 1) and (ids[:, 0] == y).all(), (ids, what)
        assert ((0 <= ids) & (ids < cfg.vocab_size)).all(), what
        assert np.isfinite(lg).all() and np.isfinite(conf).all(), f"non-finite draft; {what}"
        assert (ids[0] == ids[1]).all() and (ids_r == ids).all(), f"draft depends on the slot; {what}"
        np.testing.assert_allclose(lg[0], lg[1], atol=ATOL, rtol=RTOL, err_msg=what)
        np.testing.assert_allclose(conf_r, conf, atol=ATOL, rtol=RTOL, err_msg=what)


@pytest.mark.parametrize("seed", DEFAULT_SEEDS)
def test_random_config_runs(seed, tmp_path):
    check_config(seed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_random_config_runs_slow(seed, tmp_path):
    check_config(seed, tmp_path)


def test_generator_covers_the_choices():
    """The seeds together exercise what the generator promises (so the sweep is not vacuous)."""
    cfgs = [random_config(s) for s in DEFAULT_SEEDS + SLOW_SEEDS]
    ratios = {r for c in cfgs for r in c.compress_ratios}
    assert ratios >= {0, 1, 2, 4}
    assert {c.weight_dtype for c in cfgs} == {"fp8", "bf16"} and {c.expert_dtype for c in cfgs} >= {"fp4", "fp8"}
    assert {c.num_experts_per_tok == 1 for c in cfgs} == {True, False}
    assert {c.engram_enabled for c in cfgs} == {True, False}
    assert {c.engram_max_ngram_size for c in cfgs if c.engram_enabled} == {2, 3, 4}
    assert {c.num_nextn_predict_layers for c in cfgs} == {1, 2, 3}
    assert {c.dspark_block_size for c in cfgs} == {2, 3, 4, 5}
    assert {c.candidate_block_size for c in cfgs if c.candidate_source_layer_id >= 0} == set(range(3, 9))
    assert -1 in {c.candidate_source_layer_id for c in cfgs}
    assert all(c.vocab_size % 32 for c in cfgs) and any(c.num_attention_heads % 2 for c in cfgs)
    assert {c.num_hidden_layers for c in cfgs} >= {3, 10} and {c.hc_mult for c in cfgs} == {2, 3, 4}
    assert any(c.n_routed_experts == 1 for c in cfgs) and any(c.hidden_size % 32 for c in cfgs)
