"""FP8 in jax_ub's ops on forced host devices (the reference path), against an oracle built here.

The oracle: the quantization of :mod:`jax_ub.fp8`'s definition redone in NumPy (float32 amax,
scale and division, the cast to float8 by ``ml_dtypes``), then the dequantized products and
collectives in float64, each element compared with the op's output after the rounding to the
output dtype (at most one unit in the last place of that dtype, plus float32 accumulation error).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import fp8

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TINY = np.float32(np.finfo(np.float32).tiny)


# ----------------------------------------------------------------------------------------------
# The oracle.


def np_quantize(t, dtype) -> tuple[np.ndarray, np.float32]:
    """(q as float64, scale) of current scaling over all of ``t`` (NumPy, float32 arithmetic)."""
    t32 = np.asarray(jnp.asarray(t, F32))
    fmax = np.float32(ml_dtypes.finfo(dtype).max)
    scale = max(np.float32(np.max(np.abs(t32))) * (np.float32(1) / fmax), TINY)
    q = np.clip(t32 / scale, -fmax, fmax).astype(dtype)
    return q.astype(np.float64), scale


def np_qdq(t, dtype) -> np.ndarray:
    """The float64 values that the quantized ``t`` stands for."""
    q, scale = np_quantize(t, dtype)
    return q * np.float64(scale)


def ulp(v: np.ndarray, dtype) -> np.ndarray:
    """The spacing of ``dtype`` at |v| (its smallest normal's spacing below that)."""
    fi = ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)
    e = np.floor(np.log2(np.maximum(np.abs(v), float(fi.smallest_normal))))
    return np.exp2(e - int(fi.nmant))


def assert_close(got, want: np.ndarray, terms: np.ndarray, dtype, what: str) -> None:
    """Every element: |got - want| <= 1 ulp of ``dtype`` at want + float32 accumulation error
    (``terms``: the sum of |products| that made each element)."""
    got = np.asarray(jnp.asarray(got, F32), np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bound = ulp(want, dtype) + 64 * np.finfo(np.float32).eps * terms + 1e-30
    bad = np.abs(got - want) > bound
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} elements off; worst {np.max(np.abs(got - want) / bound):.3g}x "
        f"the bound, e.g. got {got[bad][:3]}, want {want[bad][:3]}"
    )


def rand(seed, shape, dtype=F32, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(seed), shape, F32)).astype(dtype)


def shards(a: np.ndarray, tp: int, axis: int) -> list[np.ndarray]:
    return np.split(a, tp, axis=axis)


def smap(mesh, f, in_specs, out_specs, check_vma=True):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


# ----------------------------------------------------------------------------------------------
# Quantization.


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src", [BF16, F32], ids=["bf16", "f32"])
def test_quantize_round_trip(dtype, src):
    """dequantize(quantize(t)) is within the FP8 format's rounding of t, element by element: half
    a mantissa step relative (e4m3 2^-4, e5m2 2^-3), or half the smallest subnormal times the
    scale; the amax element lands on the format's max; q equals the NumPy oracle's exactly."""
    t = rand(3, (37, 53), src, scale=7.0)
    q, s = jax.jit(lambda t: fp8.quantize(t, dtype))(t)
    assert q.dtype == jnp.dtype(dtype) and s.dtype == jnp.float32 and s.shape == ()
    want_q, want_s = np_quantize(t, dtype)
    assert np.float32(s) == want_s
    np.testing.assert_array_equal(np.asarray(q).astype(np.float64), want_q)
    t64 = np.asarray(jnp.asarray(t, F32), np.float64)
    back = np.asarray(fp8.dequantize(q, s), np.float64)
    fi = ml_dtypes.finfo(dtype)
    rel = 2.0 ** -(int(fi.nmant) + 1)
    sub = float(fi.smallest_subnormal) / 2 * float(s)
    err = np.abs(back - t64)
    assert np.all(err <= rel * np.abs(t64) * (1 + 1e-6) + sub), float(np.max(err - rel * np.abs(t64)))
    amax = np.max(np.abs(t64))
    assert np.isclose(np.max(np.abs(back)), amax, rtol=1e-6)
    assert np.max(np.abs(np.asarray(q, np.float32))) == float(fi.max)


def test_quantize_zeros_and_axis(cpu_mesh):
    """An all-zero tensor gets the tiny-amax scale (no division by zero); over an axis every rank
    gets the scale of the largest |value| on any rank."""
    q, s = fp8.quantize(jnp.zeros((4, 4), BF16), E4M3)
    assert np.all(np.asarray(q, np.float32) == 0) and float(s) > 0
    mesh = cpu_mesh(4)
    t = rand(5, (8, 6))
    t = t.at[5, 2].set(40.0)  # on rank 2

    def body(t):
        q, s = fp8.quantize(t, E4M3, "tp")
        return q, s[None]

    q, s = smap(mesh, body, (P("tp"),), (P("tp"), P("tp")))(t)
    want = np.float32(40.0) * (np.float32(1) / np.float32(448.0))
    np.testing.assert_array_equal(np.asarray(s), np.full(4, want, np.float32))
    np.testing.assert_array_equal(np.asarray(q, np.float64), np_quantize(t, E4M3)[0])


# ----------------------------------------------------------------------------------------------
# Forward: float8 operands with scales (a), and the recipe (b).


def _scaled_operands(tp, op, x_dt, w_dt, m=3, k=8, n=5):
    """Global float8 x, w and per-rank scales (random, not 1)."""
    rng = np.random.default_rng(tp + (op == "rs"))
    xs_shape = (2, m * tp, k) if op == "ag" else (2, m * tp, k * tp)
    ws_shape = (k, n * tp) if op == "ag" else (k * tp, n)
    x8 = (rng.standard_normal(xs_shape) * 100).clip(-400, 400).astype(x_dt)
    w8 = (rng.standard_normal(ws_shape) * 10).astype(w_dt)
    x_scale = rng.uniform(0.01, 0.1, tp).astype(np.float32)
    w_scale = rng.uniform(0.01, 0.1, tp).astype(np.float32)
    if op == "ag":  # one x scale on every rank (what the all-gather needs)
        x_scale[:] = x_scale[0]
    return x8, w8, x_scale, w_scale


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    "tp,pair,out",
    [(2, (E4M3, E4M3), BF16), (4, (E4M3, E5M2), F32), (4, (E5M2, E4M3), BF16)],
    ids=["tp2-e4m3xe4m3-bf16", "tp4-e4m3xe5m2-f32", "tp4-e5m2xe4m3-bf16"],
)
def test_scaled_forward(cpu_mesh, tp, op, pair, out):
    mesh = cpu_mesh(tp)
    x8, w8, xs, ws = _scaled_operands(tp, op, *pair)
    pet = None if out == BF16 else out
    if op == "ag":

        def body(x, w, a, b):
            return jax_ub.all_gather_matmul(
                x, w, "tp", gather_axis=1, scales=(a[0], b[0]), preferred_element_type=pet
            )

        specs = (P(None, "tp"), P(None, "tp"), P("tp"), P("tp"))
        got = smap(mesh, body, specs, P(None, None, "tp"))(x8, w8, xs, ws)
        dx = x8.astype(np.float64) * float(xs[0])
        outs, terms = [], []
        for r, w_r in enumerate(shards(w8.astype(np.float64), tp, 1)):
            outs.append(dx @ (w_r * float(ws[r])))
            terms.append(np.abs(dx) @ np.abs(w_r * float(ws[r])))
        want, t = np.concatenate(outs, -1), np.concatenate(terms, -1)
    else:

        def body(x, w, a, b):
            return jax_ub.matmul_reduce_scatter(
                x, w, "tp", scatter_axis=1, scales=(a[0], b[0]), preferred_element_type=pet
            )

        specs = (P(None, None, "tp"), P("tp", None), P("tp"), P("tp"))
        got = smap(mesh, body, specs, P(None, "tp"))(x8, w8, xs, ws)
        xr = shards(x8.astype(np.float64), tp, 2)
        wr = shards(w8.astype(np.float64), tp, 0)
        parts = [(xr[r] * float(xs[r])) @ (wr[r] * float(ws[r])) for r in range(tp)]
        want = np.sum(parts, 0)
        t = np.sum([np.abs(xr[r] * float(xs[r])) @ np.abs(wr[r] * float(ws[r])) for r in range(tp)], 0)
    assert got.dtype == jnp.dtype(out)
    assert_close(got, want, t, out, f"{op} tp={tp}")


def _recipe_oracle(op, tp, x, w, axis):
    """float64 forward of the recipe from global x, w (x's gather/scatter axis ``axis``)."""
    if op == "ag":
        xq, xs = np_quantize(x, E4M3)  # the pmax-ed amax: the global one
        dx = xq * xs
        outs, terms = [], []
        for w_r in shards(np.asarray(jnp.asarray(w, F32)), tp, 1):
            wq, wsc = np_quantize(w_r, E4M3)
            outs.append(dx @ (wq * wsc))
            terms.append(np.abs(dx) @ np.abs(wq * wsc))
        return np.concatenate(outs, -1), np.concatenate(terms, -1)
    xr = shards(np.asarray(jnp.asarray(x, F32)), tp, -1)
    wr = shards(np.asarray(jnp.asarray(w, F32)), tp, 0)
    parts, terms = [], []
    for r in range(tp):
        xq, xsc = np_quantize(xr[r], E4M3)
        wq, wsc = np_quantize(wr[r], E4M3)
        parts.append((xq * xsc) @ (wq * wsc))
        terms.append(np.abs(xq * xsc) @ np.abs(wq * wsc))
    return np.sum(parts, 0), np.sum(terms, 0)


def _recipe_fn(mesh, op, recipe, check_vma=True, **kw):
    if op == "ag":
        body = lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", gather_axis=1, fp8=recipe, **kw)  # noqa: E731
        return smap(mesh, body, (P(None, "tp"), P(None, "tp")), P(None, None, "tp"), check_vma)
    body = lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", scatter_axis=1, fp8=recipe, **kw)  # noqa: E731
    return smap(mesh, body, (P(None, None, "tp"), P("tp", None)), P(None, "tp"), check_vma)


def _recipe_operands(op, tp, dtype, m=3, k=8, n=5):
    if op == "ag":
        return rand(11 + tp, (2, m * tp, k), dtype, 3.0), rand(12 + tp, (k, n * tp), dtype)
    return rand(13 + tp, (2, m * tp, k * tp), dtype, 3.0), rand(14 + tp, (k * tp, n), dtype)


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    "tp,dtype,out,check_vma",
    [(2, BF16, None, True), (4, BF16, None, True), (2, F32, None, False), (4, BF16, F32, False)],
    ids=["tp2-bf16", "tp4-bf16", "tp2-f32-novma", "tp4-bf16-f32out-novma"],
)
def test_recipe_forward(cpu_mesh, tp, op, dtype, out, check_vma):
    mesh = cpu_mesh(tp)
    x, w = _recipe_operands(op, tp, dtype)
    got = _recipe_fn(mesh, op, jax_ub.FP8Recipe(), check_vma, preferred_element_type=out)(x, w)
    want_dt = out or dtype
    assert got.dtype == jnp.dtype(want_dt)
    want, terms = _recipe_oracle(op, tp, x, w, 1)
    assert_close(got, want, terms, want_dt, f"{op} tp={tp}")


def test_recipe_out_dtype_and_gathered(cpu_mesh):
    """The recipe's out_dtype sets the output; return_gathered gives the dequantized gathered x
    (the values the GEMM multiplied), in x's dtype."""
    mesh = cpu_mesh(2)
    x, w = _recipe_operands("ag", 2, BF16)
    r = jax_ub.FP8Recipe(out_dtype=F32)

    def body(x, w):
        return jax_ub.all_gather_matmul(x, w, "tp", gather_axis=1, fp8=r, return_gathered=True)

    y, xg = smap(mesh, body, (P(None, "tp"), P(None, "tp")), (P(None, None, "tp"), P(None, "tp")))(x, w)
    assert y.dtype == jnp.float32 and xg.dtype == jnp.bfloat16
    xq, xs = np_quantize(x, E4M3)
    g = np.asarray(xg, np.float64).reshape(2, 2, 6, 8)  # the copy of each rank, side by side
    for r in range(2):
        np.testing.assert_array_equal(g[:, r], np.asarray(jnp.asarray(xq * xs, BF16), np.float64))
    want, terms = _recipe_oracle("ag", 2, x, w, 1)
    assert_close(y, want, terms, F32, "ag out_dtype f32")


# ----------------------------------------------------------------------------------------------
# Backward: the hybrid recipe (dy in e5m2) and the backward in the operands' precision.


def _grads(f, x, w, cot):
    def loss(x, w):
        return jnp.vdot(f(x, w).astype(F32), cot)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


def _hybrid_oracle(op, tp, x, w, dy):
    """float64 (dx, dw, their |terms|) of the hybrid recipe from global x, w and dy (y's dtype)."""
    x32, w32 = np.asarray(jnp.asarray(x, F32)), np.asarray(jnp.asarray(w, F32))
    dy32 = np.asarray(jnp.asarray(dy, F32))
    dxs, dws, tdx, tdw = [], [], [], []
    if op == "ag":  # dx = RS(dy8_r @ w8_rᵀ), own dy scale per rank; dw_r = x8_fullᵀ @ dy8_r
        xq, xsc = np_quantize(x32, E4M3)
        xd = (xq * xsc).reshape(-1, x32.shape[-1])
        parts, pterms = [], []
        for w_r, dy_r in zip(shards(w32, tp, 1), shards(dy32, tp, -1), strict=True):
            wq, wsc = np_quantize(w_r, E4M3)
            dq, dsc = np_quantize(dy_r, E5M2)
            parts.append((dq * dsc) @ (wq * wsc).T)
            pterms.append(np.abs(dq * dsc) @ np.abs(wq * wsc).T)
            d2 = (dq * dsc).reshape(-1, dq.shape[-1])
            dws.append(xd.T @ d2)
            tdw.append(np.abs(xd).T @ np.abs(d2))
        return np.sum(parts, 0), np.concatenate(dws, 1), np.sum(pterms, 0), np.concatenate(tdw, 1)
    # RS: dy8 with the global amax; dx_r = AG(dy8) @ w8_rᵀ; dw_r = x8_rᵀ @ AG(dy8)
    dq, dsc = np_quantize(dy32, E5M2)
    dd = dq * dsc
    d2 = dd.reshape(-1, dd.shape[-1])
    for x_r, w_r in zip(shards(x32, tp, -1), shards(w32, tp, 0), strict=True):
        xq, xsc = np_quantize(x_r, E4M3)
        wq, wsc = np_quantize(w_r, E4M3)
        dxs.append(dd @ (wq * wsc).T)
        tdx.append(np.abs(dd) @ np.abs(wq * wsc).T)
        x2 = (xq * xsc).reshape(-1, xq.shape[-1])
        dws.append(x2.T @ d2)
        tdw.append(np.abs(x2).T @ np.abs(d2))
    return np.concatenate(dxs, -1), np.concatenate(dws, 0), np.concatenate(tdx, -1), np.concatenate(tdw, 0)


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    "tp,dtype,check_vma",
    [(2, BF16, True), (4, BF16, False), (4, F32, True)],
    ids=["tp2-bf16", "tp4-bf16-novma", "tp4-f32"],
)
def test_hybrid_backward(cpu_mesh, tp, op, dtype, check_vma):
    """dx and dw of <op(x, w), cot> against the float64 hybrid recipe (dy quantized to e5m2),
    element by element; the gradients have the (master) operands' dtypes."""
    mesh = cpu_mesh(tp)
    x, w = _recipe_operands(op, tp, dtype)
    f = _recipe_fn(mesh, op, jax_ub.FP8Recipe(), check_vma)
    y = jax.eval_shape(f, x, w)
    cot = rand(99, y.shape, F32, 2.0)
    dx, dw = _grads(f, x, w, cot)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    dy = jnp.asarray(cot).astype(y.dtype)  # the cotangent the op sees
    want_dx, want_dw, tdx, tdw = _hybrid_oracle(op, tp, x, w, dy)
    assert_close(dx, want_dx, tdx, dtype, f"{op} dx")
    assert_close(dw, want_dw, tdw, dtype, f"{op} dw")


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_backward_in_operand_precision(cpu_mesh, op):
    """bwd_dtype=None: dgrad and wgrad in the operands' dtype on the dequantized x8 and w8 (the
    straight-through gradient of the quantized forward), within bfloat16 rounding of float64."""
    tp = 2
    mesh = cpu_mesh(tp)
    x, w = _recipe_operands(op, tp, BF16)
    f = _recipe_fn(mesh, op, jax_ub.FP8Recipe(bwd_dtype=None))
    y = jax.eval_shape(f, x, w)
    cot = rand(98, y.shape, F32, 2.0)
    dx, dw = _grads(f, x, w, cot)
    dy = np.asarray(jnp.asarray(jnp.asarray(cot).astype(BF16), F32), np.float64)
    x32, w32 = np.asarray(jnp.asarray(x, F32)), np.asarray(jnp.asarray(w, F32))
    if op == "ag":
        xq, xsc = np_quantize(x32, E4M3)
        xd = (xq * xsc).reshape(-1, x32.shape[-1])
        wd = np.concatenate([np_qdq(s, E4M3) for s in shards(w32, tp, 1)], 1)
        want_dx = dy @ wd.T
        tdx = np.abs(dy) @ np.abs(wd).T
        want_dw = xd.T @ dy.reshape(-1, dy.shape[-1])
        tdw = np.abs(xd).T @ np.abs(dy.reshape(-1, dy.shape[-1]))
    else:
        xd = np.concatenate([np_qdq(s, E4M3) for s in shards(x32, tp, -1)], -1)
        wd = np.concatenate([np_qdq(s, E4M3) for s in shards(w32, tp, 0)], 0)
        want_dx, tdx = dy @ wd.T, np.abs(dy) @ np.abs(wd).T
        x2, d2 = xd.reshape(-1, xd.shape[-1]), dy.reshape(-1, dy.shape[-1])
        want_dw, tdw = x2.T @ d2, np.abs(x2).T @ np.abs(d2)
    for got, want, t, name in ((dx, want_dx, tdx, "dx"), (dw, want_dw, tdw, "dw")):
        got = np.asarray(jnp.asarray(got, F32), np.float64)
        bound = 2 * ulp(want, BF16) + 2.0**-7 * t  # bf16 partial products and sums
        assert np.all(np.abs(got - want) <= bound), (op, name, float(np.max(np.abs(got - want) / bound)))


def test_gradients_reach_master_weights(cpu_mesh):
    """float32 master x and w: their gradients are float32 and those of the hybrid recipe; an SGD
    step on them lowers the loss of a fixed target."""
    tp = 2
    mesh = cpu_mesh(tp)
    x, w = _recipe_operands("ag", tp, F32)
    f = _recipe_fn(mesh, "ag", jax_ub.FP8Recipe())
    target = rand(7, jax.eval_shape(f, x, w).shape, F32)

    def loss(w):
        return jnp.mean((f(x, w).astype(F32) - target) ** 2)

    lw, gw = jax.jit(jax.value_and_grad(loss))(w)
    assert gw.dtype == jnp.float32 and float(jnp.linalg.norm(gw)) > 0
    w2 = w - 0.1 * lw / jnp.vdot(gw, gw) * gw  # to first order, the loss drops by 10 %
    assert float(jax.jit(loss)(w2)) < float(lw)


# ----------------------------------------------------------------------------------------------
# Transformations: remat (with jax_ub's policy), scan, and the float8-operand path's gradients.


def test_remat_and_scan_give_the_same_gradients(cpu_mesh):
    """Two stacked AG->RS blocks: under jax.checkpoint (jax_ub.checkpoint_policy) and under
    lax.scan the gradients equal those of the plain program, bit for bit."""
    tp = 2
    mesh = cpu_mesh(tp)
    r = jax_ub.FP8Recipe()
    x = rand(1, (2, 6, 8), F32)
    w1 = rand(2, (2, 8, 4 * tp), F32)
    w2 = rand(3, (2, 4 * tp, 8), F32)

    def block(h, ws):
        a, b = ws
        u = jax_ub.all_gather_matmul(h, a, "tp", gather_axis=1, fp8=r)
        return h + jax_ub.matmul_reduce_scatter(jax.nn.gelu(u), b, "tp", scatter_axis=1, fp8=r)

    def plain(h, w1, w2):
        for i in range(2):
            h = block(h, (w1[i], w2[i]))
        return h

    def remat(h, w1, w2):
        blk = jax.checkpoint(block, policy=jax_ub.checkpoint_policy())
        for i in range(2):
            h = blk(h, (w1[i], w2[i]))
        return h

    def scanned(h, w1, w2):
        return jax.lax.scan(lambda h, ws: (block(h, ws), None), h, (w1, w2))[0]

    specs = (P(None, "tp"), P(None, None, "tp"), P(None, "tp", None))
    outs = []
    for body in (plain, remat, scanned):
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, "tp"))
        loss = lambda x, w1, w2, f=f: jnp.sum(f(x, w1, w2).astype(F32) ** 2)  # noqa: E731
        outs.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2))
    for name, got in zip(("remat", "scan"), outs[1:], strict=True):
        for i, (a, b) in enumerate(zip(got, outs[0], strict=True)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} grad {i}")
    assert all(float(jnp.linalg.norm(g.astype(F32))) > 0 for g in outs[0])


def test_scaled_gradients_are_the_references(cpu_mesh):
    """Float8 operands with scales: the gradient with respect to the scales is jax's of the
    reference, d<y, c>/d x_scale = <y_f32, c> / x_scale."""
    tp = 2
    mesh = cpu_mesh(tp)
    x8, w8, xs, ws = _scaled_operands(tp, "ag", E4M3, E4M3)

    def body(x, w, a, b):
        return jax_ub.all_gather_matmul(x, w, "tp", scales=(a[0], b[0]), preferred_element_type=F32)

    specs = (P(None, "tp"), P(None, "tp"), P("tp"), P("tp"))
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, None, "tp"))
    cot = rand(4, jax.eval_shape(f, x8, w8, xs, ws).shape)
    y = f(x8, w8, xs, ws)
    g = jax.jit(jax.grad(lambda a: jnp.vdot(f(x8, w8, a, ws), cot)))(jnp.asarray(xs))
    want = float(jnp.vdot(y, cot)) / float(xs[0])
    np.testing.assert_allclose(float(jnp.sum(g)), want, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# Validation: messages name what was expected and what was received.


def _call(mesh, op, x, w, **kw):
    if op == "ag":
        body = lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", **kw)  # noqa: E731
        specs, out = (P("tp"), P(None, "tp")), P(None, "tp")
    else:
        body = lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", **kw)  # noqa: E731
        specs, out = (P(None, "tp"), P("tp")), P("tp")
    return smap(mesh, body, specs, out)(x, w)


S = jnp.float32(0.5)
R, R32 = jax_ub.FP8Recipe(), jax_ub.FP8Recipe(out_dtype=F32)


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    "xd,wd,kw,match",
    [
        (E5M2, E5M2, {"scales": (S, S)}, "no float8_e5m2 x float8_e5m2 GEMM.*x float8_e5m2, w float8_e5m2"),
        (E4M3, E4M3, {}, "float8 operands need their dequantization scales.*got x float8_e4m3fn"),
        (E4M3, BF16, {"scales": (S, S)}, "must both be FP8.*got x float8_e4m3fn, w bfloat16"),
        (BF16, BF16, {"scales": (S, S)}, "must both be FP8.*got x bfloat16, w bfloat16"),
        (E4M3, E4M3, {"scales": (S,)}, "`scales` must be a pair.*got tuple of length 1"),
        (E4M3, E4M3, {"scales": (S, 0.5)}, "w_scale must be a float32 .* shape \\(\\); got float"),
        (E4M3, E4M3, {"scales": (jnp.ones((2,), F32), S)}, "x_scale must .*got float32 of shape \\(2,\\)"),
        (E4M3, E4M3, {"scales": (S, jnp.bfloat16(1))}, "w_scale.*got bfloat16 of shape \\(\\)"),
        (E4M3, E4M3, {"scales": (S, S), "preferred_element_type": F16}, "bfloat16, float32.*got float16"),
        (BF16, BF16, {"fp8": R, "preferred_element_type": F16}, "preferred_element.*got float16"),
        (BF16, BF16, {"preferred_element_type": F32}, "applies to FP8 calls.*got float32"),
        (E4M3, E4M3, {"fp8": R}, "quantizes `x` and `w` of one dtype of bfloat16, .*; got x float8_e4m3fn"),
        (BF16, BF16, {"fp8": "e4m3"}, "`fp8` must be a jax_ub.FP8Recipe or None; got str"),
        (BF16, BF16, {"fp8": R, "scales": (S, S)}, "not both"),
        (BF16, BF16, {"fp8": R32, "preferred_element_type": BF16}, "differ; got bfloat16 and float32"),
    ],
)  # fmt: skip
def test_validation(cpu_mesh, op, xd, wd, kw, match):
    """Each wrong combination is a TypeError naming what was expected and what was got."""
    mesh = cpu_mesh(2)
    x = rand(1, (4, 8), F32).astype(xd)
    w = rand(2, (8, 4), F32).astype(wd)
    with pytest.raises(TypeError, match=match):
        _call(mesh, op, x, w, **kw)


def test_scaled_shape_checks(cpu_mesh):
    mesh = cpu_mesh(2)
    x, w = jnp.ones((4, 8), E4M3), jnp.ones((6, 4), E4M3)
    with pytest.raises(ValueError, match=r"contracting dims must match.*got x \[2, 8\], w \[6, 2\]"):
        _call(mesh, "ag", x, w, scales=(S, S))


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"fwd_dtype": E5M2}, "fwd_dtype` must be float8_e4m3fn.*got float8_e5m2"),
        ({"bwd_dtype": BF16}, "bwd_dtype` must be one of float8_e4m3fn, float8_e5m2, or None.*got bfloat16"),
        (
            {"out_dtype": E4M3},
            "out_dtype` must be one of bfloat16, float16, float32, or None.*got float8_e4m",
        ),
    ],
)
def test_recipe_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        jax_ub.FP8Recipe(**kw)


def test_recipe_is_hashable_and_normalised():
    a, b = jax_ub.FP8Recipe(bwd_dtype=jnp.float8_e5m2), jax_ub.FP8Recipe()
    assert a == b and hash(a) == hash(b)
    assert jax_ub.FP8Recipe(bwd_dtype=None).bwd_dtype is None


# ----------------------------------------------------------------------------------------------
# The bulk ops: an FP8 GEMM beside the collective (reference path).


def test_bulk_fp8(cpu_mesh):
    """bulk_all_gather moves float8 x as it is, its GEMM on float8 a, b with scales;
    bulk_reduce_scatter's GEMM quantized by a recipe, differentiable (straight-through)."""
    tp = 2
    mesh = cpu_mesh(tp)
    rng = np.random.default_rng(5)
    x8 = (rng.standard_normal((4 * tp, 6)) * 50).astype(E4M3)
    a8 = (rng.standard_normal((5, 8)) * 50).astype(E4M3)
    b8 = (rng.standard_normal((8, 3)) * 5).astype(E5M2)
    sa, sb = jnp.float32(0.03), jnp.float32(0.2)

    def ag(x, a, b):
        out, y = jax_ub.bulk_all_gather(x, a, b, "tp", scales=(sa, sb), preferred_element_type=F32)
        return out[None], y[None]

    out, y = smap(mesh, ag, (P("tp"), P(), P()), (P("tp"), P("tp")))(x8, a8, b8)
    assert out.dtype == jnp.dtype(E4M3)
    for r in range(tp):  # every rank's gathered x: x, bit for bit
        np.testing.assert_array_equal(np.asarray(out[r], np.float32), np.asarray(x8, np.float32))
    da, db = a8.astype(np.float64) * float(sa), b8.astype(np.float64) * float(sb)
    for r in range(tp):
        assert_close(y[r], da @ db, np.abs(da) @ np.abs(db), F32, "bulk_all_gather fp8 gemm")

    x = rand(6, (4 * tp, 6), F32)
    a, b = rand(7, (5, 8), BF16, 3.0), rand(8, (8, 3), BF16)

    def rs(x, a, b):
        out, y = jax_ub.bulk_reduce_scatter(x, a, b, "tp", fp8=jax_ub.FP8Recipe())
        return out, y[None]

    f = smap(mesh, rs, (P(), P(), P()), (P("tp"), P("tp")))
    out, y = f(x, a, b)
    np.testing.assert_allclose(np.asarray(out), tp * np.asarray(x), rtol=1e-6)
    da, db = np_qdq(a, E4M3), np_qdq(b, E4M3)
    assert y.dtype == jnp.bfloat16
    for r in range(tp):
        assert_close(y[r], da @ db, np.abs(da) @ np.abs(db), BF16, "bulk_reduce_scatter fp8 gemm")
    ga, gb = jax.jit(jax.grad(lambda a, b: jnp.sum(f(x, a, b)[1].astype(F32)), argnums=(0, 1)))(a, b)
    assert ga.dtype == jnp.bfloat16 and gb.dtype == jnp.bfloat16
    ones = np.ones((5, 3))  # d sum(y_r) over tp ranks: tp * ones @ Q(b)ᵀ, tp * Q(a)ᵀ @ ones
    np.testing.assert_allclose(np.asarray(ga, np.float64), tp * ones @ db.T, rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(gb, np.float64), tp * da.T @ ones, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize(
    "fn,x_dt,a_dt,b_dt,kw,match",
    [
        ("ag", F32, E5M2, E5M2, {"scales": (S, S)}, "no float8_e5m2 x float8_e5m2 GEMM.*a float8_e5m2"),
        ("ag", F32, E4M3, E4M3, {}, "need their dequantization scales.*got a float8_e4m3fn"),
        ("rs", E4M3, F32, F32, {"fp8": R}, "`x` must have dtype.*a reduce-scatter sums it.*float8_e4m3fn"),
        ("ag", F32, E4M3, E4M3, {"scales": (S, 1)}, "b_scale must be a float32 array"),
        ("ag", F32, F32, BF16, {"fp8": R}, "one dtype of.*got a float32, b bfloat16"),
    ],
)
def test_bulk_fp8_validation(cpu_mesh, fn, x_dt, a_dt, b_dt, kw, match):
    mesh = cpu_mesh(2)
    x, a, b = jnp.ones((4, 4), x_dt), jnp.ones((3, 4), a_dt), jnp.ones((4, 2), b_dt)
    op = jax_ub.bulk_all_gather if fn == "ag" else jax_ub.bulk_reduce_scatter
    with pytest.raises(TypeError, match=match):
        smap(mesh, lambda x, a, b: op(x, a, b, "tp", **kw)[1], (P("tp"), P(), P()), P())(x, a, b)


# ----------------------------------------------------------------------------------------------
# What the collectives move, and the AG options.


def _collective_dtypes(jaxpr, name: str) -> list:
    """The operand dtypes of every ``name`` collective in ``jaxpr``, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            out.append(eqn.invars[0].aval.dtype)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _collective_dtypes(inner, name)
    return out


def test_the_collectives_move_fp8_bytes(cpu_mesh):
    """With a recipe the forward all-gather moves e4m3 x, and RS's backward gathers e5m2 dy; the
    reduce-scatters sum float32 (each in the program of its op and its gradient)."""
    mesh = cpu_mesh(2)
    for op in ("ag", "rs"):
        x, w = _recipe_operands(op, 2, BF16)
        f = _recipe_fn(mesh, op, jax_ub.FP8Recipe())
        cot = rand(3, jax.eval_shape(f, x, w).shape)
        loss = lambda x, w, f=f, c=cot: jnp.vdot(f(x, w).astype(F32), c)  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w)
        gathers = _collective_dtypes(jaxpr.jaxpr, "all_gather")
        scatters = _collective_dtypes(jaxpr.jaxpr, "reduce_scatter")
        assert gathers == [jnp.dtype(E4M3 if op == "ag" else E5M2)], (op, gathers)
        assert scatters == [jnp.dtype(F32)], (op, scatters)


def test_recompute_and_return_gathered_with_a_recipe(cpu_mesh):
    """recompute_gathered (the local x8 saved, re-gathered in the backward) gives the same
    gradients bit for bit; with return_gathered the gathered x's cotangent goes back to x through
    the all-gather's transpose (a reduce-scatter)."""
    tp = 2
    mesh = cpu_mesh(tp)
    x, w = _recipe_operands("ag", tp, F32)
    r = jax_ub.FP8Recipe()
    specs = (P(None, "tp"), P(None, "tp"))
    grads = []
    for recompute in (False, True):
        body = lambda x, w, rc=recompute: jax_ub.all_gather_matmul(  # noqa: E731
            x, w, "tp", gather_axis=1, fp8=r, recompute_gathered=rc
        )
        f = smap(mesh, body, specs, P(None, None, "tp"))
        grads.append(_grads(f, x, w, rand(4, (2, 3 * tp, 5 * tp))))
    for a, b in zip(*grads, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def both(x, w):
        y, xg = jax_ub.all_gather_matmul(x, w, "tp", gather_axis=1, fp8=r, return_gathered=True)
        return y, xg[None]

    g = smap(mesh, both, specs, (P(None, None, "tp"), P("tp")))
    cy, cg = rand(4, (2, 3 * tp, 5 * tp)), rand(5, (tp, 2, 3 * tp, 8))

    def loss(x, w):
        y, xg = g(x, w)
        return jnp.vdot(y, cy) + jnp.vdot(xg, cg)

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(grads[0][1]))
    # dx = the y part (as without return_gathered) + the sum over ranks of the gathered x's cotangent
    want = np.asarray(grads[0][0], np.float64) + np.asarray(cg, np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(dx, np.float64), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# XLA's FP8 path: where the ops run through XLA (tp=1, method="xla", off the CUDA path) their GEMMs
# are XLA's own FP8 dot (fp8.scaled_dot), held here to the reference (fp8.scaled_matmul) run on the
# same quantized data.


def _dot_operand_dtypes(jaxpr) -> list:
    """The operand dtype pairs of every ``dot_general`` in ``jaxpr``, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(jnp.dtype(v.aval.dtype) for v in eqn.invars))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _dot_operand_dtypes(inner)
    return out


def _close_to_reference(got, ref, terms: np.ndarray, k: int, tp: int, dtype, what: str) -> None:
    """Every element of XLA's FP8 path within its bound of the reference's (fp8.scaled_dot's
    docstring): ``(k + 2) eps(float32) T`` for the GEMM (``T`` the sum of |products|, ``k`` the
    contraction), ``2 (tp - 1) eps(float32) T`` more for the float32 sums of a reduce-scatter, one
    unit in the last place of ``dtype`` for the final cast."""
    got = np.asarray(jnp.asarray(got, F32), np.float64)
    ref = np.asarray(jnp.asarray(ref, F32), np.float64)
    assert got.shape == ref.shape == terms.shape, (what, got.shape, ref.shape, terms.shape)
    bound = ulp(ref, dtype) + (k + 2 + 2 * (tp - 1)) * np.finfo(np.float32).eps * terms + 1e-30
    bad = np.abs(got - ref) > bound
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} elements off; worst {np.max(np.abs(got - ref) / bound):.3g}x "
        f"the bound, e.g. got {got[bad][:3]}, reference {ref[bad][:3]}"
    )


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    "tp,dtype,method",
    [(1, BF16, None), (2, BF16, "xla"), (4, F32, "xla")],
    ids=["tp1", "tp2-bf16", "tp4-f32"],
)
def test_xla_fp8_dot_is_the_reference(cpu_mesh, monkeypatch, tp, op, dtype, method):
    """The forward and the hybrid backward (e5m2 dy, dgrad, wgrad) of a recipe on XLA's path run
    every GEMM as a float8 dot_general, and give the reference's results (the float32 dot of the
    dequantized operands, patched in here) within the float32 rounding bound, every element."""
    mesh = cpu_mesh(tp)
    m, k, n = 4, 48, 8  # contractions: k (forward), n (dgrad), 2 * m * tp (wgrad)
    x, w = _recipe_operands(op, tp, dtype, m=m, k=k, n=n)
    kw = {} if method is None else {"method": method}
    runs = []
    for dot in ("xla", "reference"):
        if dot == "reference":
            monkeypatch.setattr(fp8, "scaled_dot", fp8.scaled_matmul)
        f = _recipe_fn(mesh, op, jax_ub.FP8Recipe(), **kw)
        y = f(x, w)
        cot = rand(98, y.shape, F32, 2.0)
        loss = lambda x, w, f=f, c=cot: jnp.sum(f(x, w).astype(F32) * c)  # noqa: E731  (no dot)
        dots = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w).jaxpr)
        runs.append((y, *_grads(f, x, w, cot), dots))
    (y, dx, dw, dots), (y_ref, dx_ref, dw_ref, ref_dots) = runs
    fp8_types = {jnp.dtype(E4M3), jnp.dtype(E5M2)}
    assert len(dots) == 3 and all(set(d) <= fp8_types for d in dots), dots  # fwd, dgrad, wgrad
    assert len(ref_dots) == 3 and all(set(d) == {jnp.dtype(F32)} for d in ref_dots), ref_dots
    want, terms = _recipe_oracle(op, tp, x, w, 1)
    assert_close(y, want, terms, dtype, f"{op} tp={tp} y against float64")  # not only each other
    _close_to_reference(y, y_ref, terms, k, tp, dtype, f"{op} tp={tp} y")
    _, _, tdx, tdw = _hybrid_oracle(op, tp, x, w, jnp.asarray(cot).astype(y.dtype))
    _close_to_reference(dx, dx_ref, tdx, n, tp, dtype, f"{op} tp={tp} dx")
    _close_to_reference(dw, dw_ref, tdw, 2 * m * tp, tp, dtype, f"{op} tp={tp} dw")


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_local_matmul_is_the_recipe_on_one_device(dtype):
    """ops.local_matmul (the no-communication floor's GEMM) with a recipe: the forward and the
    hybrid backward of the ops at tp=1 (each tensor its own scale), every element against float64,
    its GEMMs float8 dots; without a recipe jax_ub.matmul."""
    x, w = _recipe_operands("ag", 1, dtype, m=4, k=24, n=8)
    f = lambda x, w: jax_ub.ops.local_matmul(x, w, fp8=jax_ub.FP8Recipe())  # noqa: E731
    y = jax.jit(f)(x, w)
    assert y.dtype == jnp.dtype(dtype)
    want, terms = _recipe_oracle("ag", 1, x, w, 1)
    assert_close(y, want, terms, dtype, "local y")
    cot = rand(97, y.shape, F32, 2.0)
    dx, dw = _grads(f, x, w, cot)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    want_dx, want_dw, tdx, tdw = _hybrid_oracle("ag", 1, x, w, jnp.asarray(cot).astype(y.dtype))
    assert_close(dx, want_dx, tdx, dtype, "local dx")
    assert_close(dw, want_dw, tdw, dtype, "local dw")
    loss = lambda x, w: jnp.sum(f(x, w).astype(F32) * cot)  # noqa: E731
    dots = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w).jaxpr)
    assert len(dots) == 3 and all(set(d) <= {jnp.dtype(E4M3), jnp.dtype(E5M2)} for d in dots), dots
    plain = np.asarray(jax_ub.ops.local_matmul(x, w), np.float64)
    np.testing.assert_array_equal(plain, np.asarray(jax_ub.matmul(x, w), np.float64))
    with pytest.raises(TypeError, match=r"local_matmul: `fp8` must be a jax_ub.FP8Recipe or None; got str"):
        jax_ub.ops.local_matmul(x, w, fp8="e4m3")
