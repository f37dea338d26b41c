"""DSpark stage training (training/dspark_*.py): the teacher-forced training block is the
inference ``draft``, the loss terms on hand-made inputs, a short run on a frozen backbone learns,
a resumed run continues exactly, and the export with trained stages drafts as the trainer's model.

One CPU-sized config (``v41-train-tiny-dspark``: ``v41-train-tiny`` + 2 DSpark stages, block 3,
sliding window 8; bf16 storage) and one ``DSparkTrainer`` for the module, so the step compiles once.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepinfer_jax.models.weights import load_model
from deepinfer_jax.runner.sequence_driver import SequenceDriver
from deepinfer_jax.training import data as D
from deepinfer_jax.training import state_io
from deepinfer_jax.training.dspark_forward import dspark_forward, sample_anchors
from deepinfer_jax.training.dspark_loss import decay_weights, dspark_loss, tau_prob
from deepinfer_jax.training.dspark_step import DSparkTrainer, with_stages
from deepinfer_jax.training.export import export_checkpoint
from deepinfer_jax.training.forward import train_cache_config
from deepinfer_jax.training.init import init_model
from deepinfer_jax.training.loop import run
from deepinfer_jax.training.optimizer import OptimConfig
from deepinfer_jax.training.params import path_name
from deepinfer_jax.training.presets import train_config

B, L, A = 4, 24, 8
PERIOD = 7
STEPS = 24


@pytest.fixture(scope="module")
def cfg():
    return train_config("v41-train-tiny-dspark")


@pytest.fixture(scope="module")
def batches(cfg):
    return D.TokenBatches(D.repeating_pattern(4096, PERIOD, cfg.vocab_size, seed=1), B, L, seed=0)


@pytest.fixture(scope="module")
def trainer(cfg):
    return DSparkTrainer(init_model(cfg, seed=0), OptimConfig(lr=1e-2, warmup_steps=2, total_steps=STEPS),
                         num_anchors=A)


@pytest.fixture(scope="module")
def straight(trainer, batches):
    """STEPS steps in one go: (final state, per-step metrics)."""
    state, ms = trainer.init_state(), []
    for _ in range(STEPS):
        state, m = trainer.step(state, batches(state.step))
        ms.append(m)
    return state, ms


def _flat(model) -> dict[str, np.ndarray]:
    return {path_name(p): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
            for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("p", [4, 13])  # p < W = 8 (ring partly empty), p >= W (ring wrapped)
def test_training_block_is_the_inference_draft(cfg, p):
    """The driver prefills positions 0..p, drafts after the target's token y for p+1: ids [y, d1,
    d2, d3]. The training sequence is the prefix, then y, d1, d2, d3, so teacher forcing (Markov
    bias / confidence embedding of the true previous token) feeds what the greedy chain fed; at
    anchor a = p + 1 the training forward's draft logits and confidence equal the draft's. The
    training ring's kv(main_x) comes from one prefill of all L positions (the driver's of p + 1),
    so bit-identity is not guaranteed (bf16 accumulation order may differ by shape / platform):
    the bound is 2 % of the values' scale, a few bf16 steps; measured on CPU: 0 (bit for bit)."""
    model = init_model(cfg, seed=0)
    rng = np.random.default_rng(p)
    prefix = rng.integers(3, cfg.vocab_size - 1, size=p + 1).tolist()
    y = int(rng.integers(3, cfg.vocab_size - 1))
    drv = SequenceDriver(model, train_cache_config(cfg, 1, 32))
    drv.step([(0, prefix)])
    ids, lg, conf, _ = drv.draft([0], [y])
    blk = cfg.dspark_block_size
    assert ids.shape == (1, blk + 1) and ids[0, 0] == y
    toks = np.asarray([prefix + ids[0].tolist()], np.int32)  # L = p + 1 + blk + 1
    graphdef, st = nnx.split(model)
    f = jax.jit(lambda s, t, a: dspark_forward(nnx.merge(graphdef, s), t, a))
    out = f(st, toks, np.asarray([[p + 1]], np.int32))
    np.testing.assert_array_equal(np.asarray(out.mask[0, 0]), np.ones(blk))
    np.testing.assert_array_equal(np.asarray(out.target_ids[0, 0]), ids[0, 1:])
    ours_lg, ours_conf = np.asarray(out.draft_logits[0, 0]), np.asarray(out.confidence[0, 0])
    d_lg, d_conf = np.abs(ours_lg - lg[0]), np.abs(ours_conf - conf[0])
    print(f"p={p}: max |dlogit| {d_lg.max():.2e} (|logit| max {np.abs(lg).max():.2f}), "
          f"max |dconf| {d_conf.max():.2e}")
    assert d_lg.max() <= 0.02 * max(1.0, np.abs(lg).max()), d_lg.max()
    assert d_conf.max() <= 0.02 * max(1.0, np.abs(conf).max()), d_conf.max()
    np.testing.assert_array_equal(ours_lg.argmax(-1), ids[0, 1:])


def test_anchors_are_in_range_and_deterministic():
    a = sample_anchors([0, 3], 64, 10, 16)
    assert a.shape == (64, 16) and a.min() >= 1 and a.max() <= 8 and a.dtype == np.int32
    np.testing.assert_array_equal(a, sample_anchors([0, 3], 64, 10, 16))
    assert set(np.unique(a)) == set(range(1, 9))


def test_loss_terms_on_hand_made_inputs():
    """Identical draft and target distributions: L1 0, r = 1 everywhere, tau = 1 + K; the CE is
    the weighted mean of -log p(target); the confidence BCE is against r = 1. Decay weights
    exp(-i/gamma); tau_prob = 1 + sum_k prod_{i<=k} r_i; masked positions count as rejected."""
    np.testing.assert_allclose(np.asarray(decay_weights(4, 2.0)), np.exp(-np.arange(4) / 2.0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(tau_prob(jnp.asarray([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]]))),
                               [1 + 0.5 + 0.25 + 0.25, 2.0], rtol=1e-6)
    K, V = 3, 5
    lg = jax.random.normal(jax.random.PRNGKey(0), (2, 2, K, V))
    tgt = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(2, 2, K)), jnp.int32)
    conf = jnp.zeros((2, 2, K))
    mask = jnp.ones((2, 2, K))
    total, m = dspark_loss(lg, conf, tgt, lg, mask)
    assert abs(float(m["l1"])) < 1e-6
    np.testing.assert_allclose(np.asarray(m["accept_rate"]), np.ones(K), atol=1e-6)
    np.testing.assert_allclose(float(m["tau_prob"]), 1 + K, atol=1e-5)
    np.testing.assert_allclose(np.asarray(m["greedy_match"]), np.ones(K))
    w = np.exp(-np.arange(K) / 4.0)
    ce_i = -np.take_along_axis(np.asarray(jax.nn.log_softmax(lg)), np.asarray(tgt)[..., None], -1)[..., 0]
    want_ce = (ce_i * w).sum() / (4 * w.sum())
    np.testing.assert_allclose(float(m["ce"]), want_ce, rtol=1e-5)
    np.testing.assert_allclose(float(m["conf_bce"]), np.log(2.0), rtol=1e-5)  # sigmoid(0) vs 1
    np.testing.assert_allclose(float(total), 0.1 * want_ce + 1.0 * np.log(2.0), rtol=1e-5)
    # disjoint one-hot-like distributions: L1 = 2, r = 0; a mask drops a position from every mean
    far = jnp.zeros((1, 1, K, V)).at[..., 0].set(50.0)
    near = jnp.zeros((1, 1, K, V)).at[..., 1].set(50.0)
    mask2 = jnp.asarray([[[1.0, 1.0, 0.0]]])
    _, m2 = dspark_loss(far, jnp.zeros((1, 1, K)), jnp.zeros((1, 1, K), jnp.int32), near, mask2)
    np.testing.assert_allclose(float(m2["l1"]), 2.0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(m2["accept_rate"]), [0.0, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(float(m2["tau_prob"]), 1.0, atol=1e-6)
    _, m3 = dspark_loss(near, jnp.zeros((1, 1, K)), jnp.ones((1, 1, K), jnp.int32), near, mask2)
    np.testing.assert_allclose(float(m3["tau_prob"]), 3.0, atol=1e-5)  # r = 1, 1, (masked)


def test_steps_lower_the_loss_and_freeze_the_backbone(cfg, trainer, batches, straight):
    """STEPS steps on the repeating phrase: the DSpark loss on a held batch (fixed anchors) drops
    clearly, the greedy match rate and the acceptance rate rise; every non-``mtp`` weight of the
    trained model is the initial model's, bit for bit, and every stage weight trained moved."""
    state, ms = straight
    held = batches(10_000)
    anchors = sample_anchors(123, B, L, 16)
    before = trainer.evaluate(trainer.init_state().master, held, anchors_BA=anchors)
    after = trainer.evaluate(state.master, held, anchors_BA=anchors)
    print("before", {k: before[k] for k in ("loss", "ce", "l1", "conf_bce", "tau_prob", "greedy_match")})
    print("after ", {k: after[k] for k in ("loss", "ce", "l1", "conf_bce", "tau_prob", "greedy_match")})
    assert after["loss"] < 0.8 * before["loss"], (before["loss"], after["loss"])
    assert np.mean(after["greedy_match"]) > np.mean(before["greedy_match"]) + 0.2
    assert after["tau_prob"] > before["tau_prob"]
    assert all(np.isfinite(m["loss"]) for m in ms)
    init, trained = _flat(init_model(cfg, seed=0)), _flat(trainer.model(state.master))
    assert init.keys() == trained.keys()
    moved = 0
    for k in init:
        if k.startswith("mtp."):
            moved += not np.array_equal(init[k], trained[k])
        else:
            np.testing.assert_array_equal(init[k], trained[k], err_msg=k)
    assert moved == len(jax.tree.leaves(state.master)), moved


def test_resume_is_bit_identical(trainer, batches, tmp_path):
    """The loop (dspark_ files): 6 steps straight == 3 steps, then a resumed call to 6; same
    masters and optimizer state bit for bit; the metrics lines carry the DSpark metrics."""
    meta = {"run": "test", "anchors": A}
    a = run(trainer, batches, 6, tmp_path / "a", meta, progress=False, prefix=state_io.DSPARK_PREFIX)
    run(trainer, batches, 3, tmp_path / "b", meta, progress=False, prefix=state_io.DSPARK_PREFIX)
    assert state_io.has_state(tmp_path / "b", state_io.DSPARK_PREFIX) and not state_io.has_state(tmp_path / "b")
    b = run(trainer, batches, 6, tmp_path / "b", meta, progress=True, prefix=state_io.DSPARK_PREFIX)
    assert a.step == b.step == 6
    for x, y in zip(jax.tree.leaves((a.master, a.opt_state)), jax.tree.leaves((b.master, b.opt_state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    lines = [json.loads(s) for s in (tmp_path / "b" / "dspark_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 7))
    assert len(lines[0]["accept_rate"]) == 3 and "tau_prob" in lines[0]
    with pytest.raises(ValueError, match="anchors"):
        run(trainer, batches, 7, tmp_path / "b", meta | {"anchors": A + 1}, progress=False,
            prefix=state_io.DSPARK_PREFIX)
    with pytest.raises(ValueError, match="repeat_tail"):   # other data: repeated tails added on resume
        run(trainer, batches, 7, tmp_path / "b", meta | {"repeat_tail": {"frac": 0.5, "periods": [2, 64]}},
            progress=False, prefix=state_io.DSPARK_PREFIX)


def test_export_with_trained_stages(cfg, trainer, straight, tmp_path):
    """bf16 export of the DSpark trainer's model: its mtp tensors are the trained ones, and the
    loaded model's draft (prefill + draft through SequenceDriver) equals the trainer's model's, bit
    for bit; ``with_stages`` puts the same stages into a backbone model."""
    state, _ = straight
    model = trainer.model(state.master)
    loaded = load_model(export_checkpoint(trainer, state.master, tmp_path / "bf16", "bf16"))
    want, got = _flat(model), _flat(loaded)
    for k in want:
        if k.startswith("mtp."):
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    merged = _flat(with_stages(init_model(cfg, seed=0), trainer, state.master))
    for k in want:
        np.testing.assert_array_equal(merged[k], want[k], err_msg=k)
    prompt = D.repeating_pattern(13, PERIOD, cfg.vocab_size, seed=1).tolist()
    outs = []
    for m in (model, loaded):
        drv = SequenceDriver(m, train_cache_config(cfg, 1, 32))
        lg, _, _ = drv.step([(0, prompt)])
        outs.append(drv.draft([0], [int(lg[0].argmax())]))
    for x, y in zip(outs[0][:3], outs[1][:3]):
        np.testing.assert_array_equal(x, y)


def test_training_ignores_registered_kernels(cfg, batches, monkeypatch):
    """Both trainers run their forwards on the jnp references whatever kernels the platform has
    (the Pallas kernels define no VJP): with a kernel registered for every op on this platform
    that fails when traced, a backbone step and a stage step still run. (On the GPU the stage
    step picked the Pallas sparse attention before it was pinned to the references.)"""
    from deepinfer_jax.kernels_pallas import ops
    from deepinfer_jax.training.step import Trainer

    def boom(*a, **k):
        raise AssertionError("a registered kernel was traced inside a training step")

    names = [n for n in dir(ops) if not n.startswith("_") and callable(getattr(ops, n))]
    platform = jax.default_backend()
    monkeypatch.setattr(ops, "_load_kernels", lambda p: None)
    for n in names:
        monkeypatch.setitem(ops._KERNELS, (n, platform), boom)
    oc = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=2)
    with ops.use_backend("auto"):
        Trainer(init_model(cfg, seed=0), oc).step(Trainer(init_model(cfg, seed=0), oc).init_state(), batches(0))
        t = DSparkTrainer(init_model(cfg, seed=0), oc, num_anchors=2)
        t.step(t.init_state(), batches(0))


def test_auto_run_keeps_its_length_across_calls(cfg, batches, tmp_path):
    """An ``auto`` run records ``total_steps`` once sized, and a later call that takes no step
    (it is done) keeps it in meta.json: before, that call dropped it and the next call sized the
    run afresh and trained on (it happened on the GPU: a second DSpark schedule)."""
    oc = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=1)
    t = DSparkTrainer(init_model(cfg, seed=0), oc, num_anchors=2)
    meta = {"optim": {"lr": 1e-3}}
    s = run(t, batches, None, tmp_path, meta, progress=False, train_seconds=1e-9, prefix=state_io.DSPARK_PREFIX)
    total = state_io.load_meta(tmp_path, state_io.DSPARK_PREFIX)["total_steps"]
    assert s.step == total >= 1
    s2 = run(t, batches, None, tmp_path, meta, progress=False, train_seconds=1e-9, prefix=state_io.DSPARK_PREFIX)
    assert s2.step == total
    assert state_io.load_meta(tmp_path, state_io.DSPARK_PREFIX)["total_steps"] == total
