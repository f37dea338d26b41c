"""mHC Sinkhorn iterations as one Pallas kernel (Triton lowering, NVIDIA GPU).

Why: the reference (``sinkhorn_ref``) is a ``fori_loop`` of 19 steps on a tiny ``[T, 4, 4]``
array; XLA runs it as a GPU while loop, whose iterations each cost far more than their
arithmetic (an H200 measured ~22 us an iteration, two calls per layer). Here the whole loop runs
in registers: one program per ``block_t`` tokens, inside one ``scf.for``.

Layout: the wrapper hands the kernel ``[C*C, T]`` (entry-major), so the program holds each of
the ``C*C`` entries as one vector over its tokens and every step is elementwise arithmetic on
those vectors: the reference's own ``sinkhorn_ref.step`` (sums left to right, true divisions:
Triton's ``/`` is approximate). The kernel therefore computes the bits of the numpy oracle
``sinkhorn_ref.sinkhorn_iterate_np``, in interpret mode and compiled (tests compare with
``assert_array_equal``; XLA's own GPU code for the jnp reference does not).

Division (``division``): PTX ``div.rn.f32`` (``"rn"``) compiles to a reciprocal, four FMAs and a
range check that branches to a slow path; a branch after each of a call's 640 divisions may keep
the compiler from overlapping them, and the kernel is latency-bound. ``"fma"`` is that fast path
alone, without the check: a reciprocal estimate refined by one Newton step, the quotient and one
FMA correction, which rounds as IEEE division does wherever the divisor, the dividend and the
quotient are normal numbers. Here every divisor is a sum of positive entries plus ``eps`` (or, in
the first step, a row sum at least 1), and an entry that is subnormal before the first step's
``+ eps`` is absorbed by it, so the two give the same bits. ``"fma"`` is the default: on an H100
both divisions gave the oracle's bits in the device tests, and ``"fma"`` took about half the time
of ``"rn"`` (``scripts/kernel_bench/sinkhorn.py``; numbers in ``benchmarks/results/``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from deepinfer_jax.kernels_pallas import sinkhorn_ref


def _div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE fp32 division, rounded to nearest (PTX ``div.rn.f32``), as XLA divides; Triton's own
    fp32 ``/`` is the approximate ``div.full.f32`` (up to 2 ulp off)."""
    return plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


# the fast path of div.rn.f32 (no range check, so no branch): y ~ 1/b (MUFU), refined by one
# Newton step; q = a*y, then q + (a - b*q)*y
_DIV_FMA = """{
.reg .f32 y, e, nb, q, r;
rcp.approx.ftz.f32 y, $2;
neg.f32 nb, $2;
fma.rn.f32 e, nb, y, 0f3F800000;
fma.rn.f32 y, y, e, y;
mul.rn.f32 q, $1, y;
fma.rn.f32 r, nb, q, $1;
fma.rn.f32 $0, r, y, q;
}"""


def _div_fma(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE fp32 division for normal operands and quotients (module docstring), branch-free."""
    return plgpu.elementwise_inline_asm(_DIV_FMA, args=[a, b], constraints="=f,f,f", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


_DIVISIONS = {"rn": _div_rn, "fma": _div_fma}


def _kernel(c_ref, o_ref, *, n: int, C: int, eps: float, first_step: bool, interpret: bool, division: str):
    v = tuple(c_ref[k] for k in range(C * C))
    # interpreted, the body is XLA HLO: the reference's barriers and XLA's division; compiled,
    # Triton does not rewrite divisions, and divides with ``division``
    how = {} if interpret else {"barrier": False, "div": _DIVISIONS[division]}
    if first_step:
        v = sinkhorn_ref.first_step(v, C, eps, **how)
    v = lax.fori_loop(0, n, lambda _, x: sinkhorn_ref.step(x, C, eps, **how), v)
    for k in range(C * C):
        o_ref[k] = v[k]


def supported(comb_TCC: jax.Array) -> bool:
    C = comb_TCC.shape[-1]
    return comb_TCC.ndim == 3 and comb_TCC.shape[-2] == C and C >= 1 and C & (C - 1) == 0


@functools.partial(jax.jit, static_argnames=("n", "eps", "first_step", "interpret", "block_t", "division"))
def sinkhorn_iterate(comb_TCC: jax.Array, n: int, eps: float, *, first_step: bool = False,
                     interpret: bool = False, block_t: int | None = None, division: str = "fma") -> jax.Array:
    """Kernel twin of ``sinkhorn_ref.sinkhorn_iterate_ref`` on ``[T, C, C]`` (C a power of two).
    ``first_step``: ``comb`` holds the softmax numerators of ``mhc.sinkhorn_split``, and the
    kernel runs ``sinkhorn_ref.first_step`` before the ``n`` steps (in the step's XLA code that
    step alone was ~20 tiny kernels a call). ``division``: ``"rn"`` or ``"fma"`` (module docstring)."""
    if division not in _DIVISIONS:
        raise ValueError(f"sinkhorn kernel: division {division!r} must be one of {sorted(_DIVISIONS)}")
    if not supported(comb_TCC):
        raise ValueError(f"sinkhorn kernel: comb {comb_TCC.shape} must be [T, C, C] with C a power of two")
    T, C, _ = comb_TCC.shape
    c = comb_TCC.astype(jnp.float32)
    if T == 0 or (n == 0 and not first_step):
        return c
    bt = block_t or min(128, 1 << max(0, (T - 1).bit_length()))
    Tp = -(-T // bt) * bt
    e = c.reshape(T, C * C).T  # [C*C, T]: one row per entry
    if Tp != T:  # padded tokens of ones: finite, discarded
        e = jnp.concatenate([e, jnp.ones((C * C, Tp - T), jnp.float32)], axis=1)
    spec = pl.BlockSpec((C * C, bt), lambda i: (0, i))
    out = pl.pallas_call(
        functools.partial(_kernel, n=int(n), C=C, eps=float(eps), first_step=bool(first_step),
                          interpret=bool(interpret), division=division),
        grid=(Tp // bt,),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((C * C, Tp), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mhc_sinkhorn",
    )(e)
    return out[:, :T].T.reshape(T, C, C)


def sinkhorn_iterate_op(comb_TCC: jax.Array, n: int, eps: float) -> jax.Array:
    """What ``ops.sinkhorn_iterate`` runs once registered: the kernel on one device and the
    shapes it takes; the reference otherwise (a custom call on a sharded operand would make GSPMD
    gather it)."""
    if jax.device_count() > 1 or not supported(comb_TCC):
        return sinkhorn_ref.sinkhorn_iterate_ref(comb_TCC, n, eps)
    return sinkhorn_iterate(comb_TCC, int(n), float(eps))


def sinkhorn_op(comb_TCC: jax.Array, iters: int, eps: float) -> jax.Array:
    """What ``ops.sinkhorn`` runs once registered: the first step and ``iters - 1`` steps in one
    kernel, where ``sinkhorn_iterate_op`` would run the kernel."""
    if jax.device_count() > 1 or not supported(comb_TCC):
        return sinkhorn_ref.sinkhorn_ref(comb_TCC, iters, eps)
    return sinkhorn_iterate(comb_TCC, max(int(iters) - 1, 0), float(eps), first_step=True)


def register() -> None:
    from deepinfer_jax.kernels_pallas import ops

    ops.register_kernel("sinkhorn_iterate", "gpu", sinkhorn_iterate_op)
    ops.register_kernel("sinkhorn", "gpu", sinkhorn_op)


register()
