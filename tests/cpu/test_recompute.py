"""all_gather_matmul(recompute_gathered=True): the backward re-gathers the saved local shard.

On 4 forced host devices (pure-XLA path). Oracles: ``jax.grad`` of the same shard_map'ed function
built from :mod:`jax_ub.reference`, and the default (x_full saved) backward. The residual checks
look at what the VJP keeps inside the shard_map body, where shapes are per device.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import dot_precisions
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from jax_ub import bulk, config, ops, reference, resolve
from jax_ub import linen as ubl
from jax_ub import nn as ubnn
from jax_ub.config import Config

F32, BF16 = jnp.float32, jnp.bfloat16
TP = 4
B, S, H, N = 2, 3, 5, 7  # local x [B, S, H] gathered along one axis; n_local = N
GRAD_RTOL = {F32: 1e-5, BF16: 2e-2}
HIGHEST = jax.lax.Precision.HIGHEST


@pytest.fixture(autouse=True)
def _on_cpu():
    """Fresh arrays live on the CPU devices the meshes are made of (matters on a GPU host)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def rel_err(got, want) -> float:
    got = np.asarray(jnp.asarray(got, F32), np.float64)
    want = np.asarray(jnp.asarray(want, F32), np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def rand(seed, shape, dtype=F32):
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def operands(axis: int, w_sharded: bool, dtype, local=(B, S, H)):
    """Global x (axis ``axis`` sharded over "tp") and w (columns sharded, or replicated)."""
    xs = list(local)
    xs[axis % len(local)] *= TP
    ws = (local[-1], N * (TP if w_sharded else 1))
    return rand(0, tuple(xs), dtype), rand(1, ws, dtype)


def x_spec(axis: int, ndim: int = 3) -> P:
    spec: list = [None] * ndim
    spec[axis % ndim] = "tp"
    return P(*spec)


def grads_fn(lib, mesh, axis, w_sharded, check_vma, **kw):
    """jit(grad) of <f(x, w), cot> w.r.t. (x, w), plus f's output, for ``lib.all_gather_matmul``.

    A replicated-w output is the same on every device but typed varying: stacked on a new axis."""

    def body(x, w):
        y = lib.all_gather_matmul(x, w, "tp", gather_axis=axis, **kw)
        return y if w_sharded else y[None]

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(x_spec(axis), P(None, "tp") if w_sharded else P()),
        out_specs=P(None, None, "tp") if w_sharded else P("tp"),
        check_vma=check_vma,
    )

    def run(x, w, cot):
        def loss(x, w):
            y = f(x, w)
            return jnp.vdot(y.astype(F32), cot), y

        (_, y), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        return y, g

    return jax.jit(run), f


# ------------------------------------------------------------------------------------------------
# Gradients against jax.grad of the reference and against the default backward.


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("w_sharded", [True, False], ids=["wshard", "wrepl"])
@pytest.mark.parametrize("axis", [0, 1, -2], ids=lambda a: f"axis{a}")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_grads_match_reference_and_default(dtype, axis, w_sharded, check_vma, cpu_mesh):
    mesh = cpu_mesh(TP)
    x, w = operands(axis, w_sharded, dtype)
    run_rc, f = grads_fn(ops, mesh, axis, w_sharded, check_vma, recompute_gathered=True)
    run_def, _ = grads_fn(ops, mesh, axis, w_sharded, check_vma, recompute_gathered=False)
    run_ref, _ = grads_fn(reference, mesh, axis, w_sharded, check_vma)
    cot = rand(2, jax.eval_shape(f, x, w).shape)
    y, (dx, dw) = run_rc(x, w, cot)
    y_ref, (dx_ref, dw_ref) = run_ref(x, w, cot)
    _, (dx_def, dw_def) = run_def(x, w, cot)
    assert dx.shape == x.shape and dx.dtype == dtype
    assert dw.shape == w.shape and dw.dtype == dtype
    assert rel_err(y, y_ref) <= GRAD_RTOL[dtype]
    assert rel_err(dx, dx_ref) <= GRAD_RTOL[dtype]
    assert rel_err(dw, dw_ref) <= GRAD_RTOL[dtype]
    assert rel_err(dx, dx_def) <= GRAD_RTOL[dtype]
    assert rel_err(dw, dw_def) <= GRAD_RTOL[dtype]


@pytest.mark.parametrize("axis", [1, -3], ids=lambda a: f"axis{a}")
def test_two_batch_dims(axis, cpu_mesh):
    """[b1, b2, s, h]: rows of the flattened dy and re-gathered x line up for any gather axis."""
    mesh = cpu_mesh(TP)
    x, w = operands(axis, True, F32, local=(2, 2, 3, H))

    def grads(lib, **kw):
        f = jax.shard_map(
            lambda x, w: lib.all_gather_matmul(x, w, "tp", gather_axis=axis, **kw),
            mesh=mesh,
            in_specs=(x_spec(axis, 4), P(None, "tp")),
            out_specs=P(None, None, None, "tp"),
        )
        return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))(x, w)

    for a, b in zip(grads(ops, recompute_gathered=True), grads(reference), strict=True):
        assert rel_err(a, b) <= GRAD_RTOL[F32]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_replicated_x_gradient_is_summed(check_vma, cpu_mesh):
    """x replicated (P()) into the AG: its cotangent is the sum over "tp" of the per-device ones."""
    mesh = cpu_mesh(TP)
    x, w = rand(3, (3, H)), rand(4, (H, N * TP))

    def grads(lib, **kw):
        f = jax.shard_map(
            lambda x, w: lib.all_gather_matmul(x, w, "tp", **kw),
            mesh=mesh,
            in_specs=(P(), P(None, "tp")),
            out_specs=P(None, "tp"),
            check_vma=check_vma,
        )
        return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))(x, w)

    for a, b in zip(grads(ops, recompute_gathered=True), grads(reference), strict=True):
        assert rel_err(a, b) <= GRAD_RTOL[F32]


@pytest.mark.parametrize("order", [1, 2])
def test_check_grads_finite_differences(order, cpu_mesh):
    """First and second order (through the bulk ops' own VJPs) against finite differences."""
    mesh = cpu_mesh(TP)
    x, w = operands(1, True, F32)
    f = jax.shard_map(
        lambda x, w: ops.all_gather_matmul(x, w, "tp", gather_axis=1, recompute_gathered=True),
        mesh=mesh,
        in_specs=(x_spec(1), P(None, "tp")),
        out_specs=P(None, None, "tp"),
    )
    cot = rand(5, jax.eval_shape(f, x, w).shape)
    with jax.default_matmul_precision("highest"):
        check_grads(
            lambda x, w: jnp.vdot(f(x, w), cot), (x, w), order=order, modes=("rev",), atol=2e-2, rtol=2e-2
        )


def test_inside_scan(cpu_mesh):
    """A sequence-parallel MLP stack under lax.scan: same grads as the reference."""
    mesh = cpu_mesh(TP)
    layers, b, s, h, f = 3, 2, 8, 6, 12
    x = rand(6, (b, s, h))
    w1, w2 = rand(7, (layers, h, f)) * 0.3, rand(8, (layers, f, h)) * 0.3

    def loss(lib, **kw):
        def stack(x, w1, w2):
            def layer(h, ws):
                u = jnp.tanh(lib.all_gather_matmul(h, ws[0], "tp", gather_axis=1, **kw))
                return h + lib.matmul_reduce_scatter(u, ws[1], "tp", scatter_axis=1), None

            return jax.lax.scan(layer, x, (w1, w2))[0]

        g = jax.shard_map(
            stack,
            mesh=mesh,
            out_specs=P(None, "tp"),
            in_specs=(P(None, "tp"), P(None, None, "tp"), P(None, "tp", None)),
        )
        return lambda *a: jnp.sum(jnp.sin(g(*a)))

    got = jax.jit(jax.grad(loss(ops, recompute_gathered=True), argnums=(0, 1, 2)))(x, w1, w2)
    want = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(x, w1, w2)
    for a, r in zip(got, want, strict=True):
        assert rel_err(a, r) <= GRAD_RTOL[F32]


# ------------------------------------------------------------------------------------------------
# What the forward keeps for the backward.


def _residual_shapes(mesh, axis, **kw):
    """Shapes of the arrays jax.vjp keeps for the backward of one AG, seen inside the body."""
    seen: list = []

    def body(x, w):
        _, vjp = jax.vjp(lambda x, w: ops.all_gather_matmul(x, w, "tp", gather_axis=axis, **kw), x, w)
        seen.extend(tuple(r.shape) for r in jax.tree.leaves(vjp))
        return x

    x, w = operands(axis, True, F32)
    jax.shard_map(body, mesh=mesh, in_specs=(x_spec(axis), P(None, "tp")), out_specs=x_spec(axis))(x, w)
    return seen


def _gathered(axis):
    shape = [B, S, H]
    shape[axis % 3] *= TP
    return tuple(shape)


@pytest.mark.parametrize("axis", [0, 1], ids=lambda a: f"axis{a}")
def test_residual_is_the_local_shard(axis, cpu_mesh):
    mesh = cpu_mesh(TP)
    default = _residual_shapes(mesh, axis, recompute_gathered=False)
    recompute = _residual_shapes(mesh, axis, recompute_gathered=True)
    assert _gathered(axis) in default and (B, S, H) not in default  # the control: x_full kept
    assert (B, S, H) in recompute and _gathered(axis) not in recompute
    assert sorted(recompute) == sorted([(B, S, H), (H, N)])
    nbytes = lambda shapes: sum(int(np.prod(s)) for s in shapes)  # noqa: E731
    assert nbytes(default) - nbytes(recompute) == (TP - 1) * B * S * H


@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute"])
def test_print_saved_residuals(recompute, cpu_mesh, capsys):
    """jax.ad_checkpoint.print_saved_residuals names the saved x: the argument, or the gather."""
    mesh = cpu_mesh(TP)

    def body(x, w):
        print_saved_residuals(
            lambda x, w: ops.all_gather_matmul(x, w, "tp", gather_axis=1, recompute_gathered=recompute), x, w
        )
        return x

    x, w = operands(1, True, F32)
    jax.shard_map(body, mesh=mesh, in_specs=(x_spec(1), P(None, "tp")), out_specs=x_spec(1))(x, w)
    lines = capsys.readouterr().out.splitlines()
    shapes = {re.match(r"f32\[([\d,]*)\]", ln).group(1) for ln in lines if ln.startswith("f32[")}
    local, full = f"{B},{S},{H}", f"{B},{S * TP},{H}"
    if recompute:
        assert local in shapes and full not in shapes, lines
        assert any(ln.startswith(f"f32[{local}]") and "argument x" in ln for ln in lines), lines
    else:
        assert full in shapes and local not in shapes, lines


def test_return_gathered_keeps_x_full_and_its_cotangent(cpu_mesh):
    """With return_gathered the caller holds x_full already: it is saved as usual, and the
    x_full cotangent still flows back into dx."""
    mesh = cpu_mesh(TP)
    kw = dict(recompute_gathered=True, return_gathered=True)
    assert (B, S * TP, H) in _residual_shapes(mesh, 1, **kw)
    x, w = operands(1, True, F32)

    def grads(lib, **kw):
        f = jax.shard_map(
            lambda x, w: lib.all_gather_matmul(x, w, "tp", gather_axis=1, return_gathered=True, **kw),
            mesh=mesh,
            in_specs=(x_spec(1), P(None, "tp")),
            out_specs=(P(None, None, "tp"), P(None, None, "tp")),
        )

        def loss(x, w):
            y, xg = f(x, w)
            return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(xg) * jnp.arange(xg.shape[-1]))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    for a, b in zip(grads(ops, recompute_gathered=True), grads(reference), strict=True):
        assert rel_err(a, b) <= GRAD_RTOL[F32]


# ------------------------------------------------------------------------------------------------
# The backward runs the two bulk overlaps; options and configuration.


@pytest.fixture
def bulk_calls(monkeypatch):
    """Records each bulk op the backward calls (then runs the real one)."""
    calls: list = []

    def spy(name):
        real = getattr(bulk, name)

        def fn(x, a, b, axis_name, **kw):
            calls.append((name, tuple(x.shape), tuple(a.shape), tuple(b.shape), kw["axis"]))
            return real(x, a, b, axis_name, **kw)

        return fn

    monkeypatch.setattr(bulk, "bulk_all_gather", spy("bulk_all_gather"))
    monkeypatch.setattr(bulk, "bulk_reduce_scatter", spy("bulk_reduce_scatter"))
    return calls


@pytest.mark.parametrize("axis", [0, 1], ids=lambda a: f"axis{a}")
def test_backward_is_two_bulk_overlaps(axis, cpu_mesh, bulk_calls):
    mesh = cpu_mesh(TP)
    x, w = operands(axis, True, F32)
    run, f = grads_fn(ops, mesh, axis, True, True, recompute_gathered=True)
    run(x, w, rand(2, jax.eval_shape(f, x, w).shape))
    full, rows = _gathered(axis), B * S * TP
    assert (
        bulk_calls
        == [
            ("bulk_all_gather", (B, S, H), (rows, N), (N, H), axis),  # x under dy @ wᵀ
            ("bulk_reduce_scatter", (*full[:-1], H), (H, rows), (rows, N), axis),  # dgrad under wgrad
        ]
    )


def test_default_backward_has_no_bulk_ops(cpu_mesh, bulk_calls):
    mesh = cpu_mesh(TP)
    x, w = operands(1, True, F32)
    run, f = grads_fn(ops, mesh, 1, True, True, recompute_gathered=False)
    run(x, w, rand(2, jax.eval_shape(f, x, w).shape))
    assert bulk_calls == []


@pytest.mark.parametrize(
    "knob,arg,want",
    [
        (False, None, False),
        (True, None, True),
        (True, False, False),
        (False, True, True),
    ],
    ids=["knob-off", "knob-on", "arg-overrides-on", "arg-overrides-off"],
)
def test_none_follows_the_config_knob(knob, arg, want, cpu_mesh):
    with config.override(recompute_gathered=knob):
        kw = {} if arg is None else {"recompute_gathered": arg}
        shapes = _residual_shapes(cpu_mesh(TP), 1, **kw)
    assert ((B, S, H) in shapes) is want
    assert ((B, S * TP, H) in shapes) is not want


def test_call_is_static_and_rs_never_recomputes():
    x, w = jnp.ones((3, 5)), jnp.ones((5, 7))
    ag = ops._call_for(ops.AG, "xla", "tp", 0, None, x, w, return_full=False, recompute_gathered=True)
    assert ag.recompute_gathered is True and hash(ag) == hash(
        ops._call_for(ops.AG, "xla", "tp", 0, None, x, w, return_full=False, recompute_gathered=True)
    )
    assert ag != ops._call_for(ops.AG, "xla", "tp", 0, None, x, w, return_full=False)
    full = ops._call_for(ops.AG, "xla", "tp", 0, None, x, w, return_full=True, recompute_gathered=True)
    assert full.recompute_gathered is False
    rs = ops._call_for(ops.RS, "xla", "tp", 0, None, x, w, return_full=False, recompute_gathered=True)
    assert rs.recompute_gathered is False


def test_matmul_reduce_scatter_has_no_such_option(cpu_mesh):
    f = jax.shard_map(
        lambda x, w: ops.matmul_reduce_scatter(x, w, "tp", recompute_gathered=True),
        mesh=cpu_mesh(TP),
        in_specs=(P(None, "tp"), P("tp")),
        out_specs=P("tp"),
    )
    with pytest.raises(TypeError, match="recompute_gathered"):
        f(jnp.ones((8, 8)), jnp.ones((8, 3)))


def test_recompute_gathered_must_be_a_bool(cpu_mesh):
    f = jax.shard_map(
        lambda x, w: ops.all_gather_matmul(x, w, "tp", recompute_gathered="yes"),
        mesh=cpu_mesh(TP),
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )
    with pytest.raises(TypeError, match="`recompute_gathered` must be a bool; got 'yes'"):
        f(jnp.ones((8, 5)), jnp.ones((5, 8)))


def test_need_full_tells_the_implementation(cpu_mesh, monkeypatch):
    """need_full is False for a plain call and a recompute forward, True when x_full is used."""
    seen: list = []

    def spy(op):
        def impl(x, w, *, need_full, **kw):
            seen.append((op, need_full))
            return ops._IMPLS[(op, "xla")](x, w, need_full=need_full, **kw)

        return impl

    monkeypatch.setitem(ops._IMPLS, ("ag", "spy"), spy("ag"))
    monkeypatch.setitem(ops._IMPLS, ("rs", "spy"), spy("rs"))
    # The op calls resolve to the spies; the bulk ops of the backward (given "spy") to the reference.
    requested = resolve.requested
    monkeypatch.setattr(
        resolve,
        "requested",
        lambda method, fn=None, **kw: method if method == "spy" else requested(method, fn, **kw),
    )
    monkeypatch.setattr(
        resolve, "method_name", lambda method, fn=None, **kw: "xla" if method == "spy" else "spy"
    )
    mesh = cpu_mesh(TP)
    x, w = operands(0, True, F32)

    def trace(fn, grad):
        seen.clear()
        f = jax.shard_map(fn, mesh=mesh, in_specs=(x_spec(0), P(None, "tp")), out_specs=P())
        (jax.grad(lambda x, w: f(x, w), argnums=(0, 1)) if grad else f)(x, w)
        return list(seen)

    def loss(**kw):
        def fn(x, w):
            out = ops.all_gather_matmul(x, w, "tp", **kw)
            return jax.lax.psum(sum(jnp.sum(o) for o in jax.tree.leaves(out)), "tp")

        return fn

    assert trace(loss(), grad=False) == [("ag", False)]
    assert trace(loss(return_gathered=True), grad=False) == [("ag", True)]
    assert trace(loss(), grad=True) == [("ag", True), ("rs", True)]  # x_full saved; dual's dy_full
    assert trace(loss(recompute_gathered=True), grad=True) == [("ag", False)]  # bulk backward


def test_precision_reaches_every_dot(cpu_mesh):
    mesh = cpu_mesh(TP)
    x, w = operands(0, True, F32)
    f = jax.shard_map(
        lambda x, w: ops.all_gather_matmul(x, w, "tp", precision=HIGHEST, recompute_gathered=True),
        mesh=mesh,
        in_specs=(x_spec(0), P(None, "tp")),
        out_specs=P(None, None, "tp"),
    )
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1)))(x, w)

    precisions = list(dot_precisions(jaxpr.jaxpr))
    assert len(precisions) == 3  # forward, dgrad, wgrad
    assert all(p == (HIGHEST, HIGHEST) for p in precisions), precisions


# ------------------------------------------------------------------------------------------------
# Environment variable.


@pytest.mark.parametrize(
    "value,want",
    [
        ("1", True),
        ("true", True),
        (" ON ", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("", False),
    ],
)
def test_env_var(value, want):
    c = Config.from_env({"JAX_UB_RECOMPUTE_GATHERED": value})
    assert c.recompute_gathered is want
    assert Config.from_env({}).recompute_gathered is False
    assert c == Config(recompute_gathered=want)  # nothing else changed


def test_env_var_bad_value_names_variable():
    with pytest.raises(ValueError, match=r"JAX_UB_RECOMPUTE_GATHERED must be one of .*'maybe'"):
        Config.from_env({"JAX_UB_RECOMPUTE_GATHERED": "maybe"})


def test_get_reads_the_env_var(monkeypatch, cpu_mesh):
    monkeypatch.setattr(config, "_active", None)
    monkeypatch.setenv("JAX_UB_RECOMPUTE_GATHERED", "1")
    assert config.get().recompute_gathered is True
    assert (B, S, H) in _residual_shapes(cpu_mesh(TP), 1)  # None -> the env var's value
    monkeypatch.setattr(config, "_active", None)  # the next test reads its own environment


# ------------------------------------------------------------------------------------------------
# Flax layers: same outputs and gradients with and without, and the bulk backward really runs.

LH, LF, LB, LS = 16, 32, 2, 8  # hidden, ffn, batch, sequence


def _loss_and_grads(fn, params, x, ct):
    loss = lambda p, x: jnp.sum(fn(p, x) * ct)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


def _assert_close(a, b):
    jax.tree.map(
        lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-5, atol=2e-5), a, b
    )


def _nnx(kind, **kw):
    if kind == "column":
        return ubnn.ColumnParallelDense(LH, LF, precision=HIGHEST, rngs=nnx.Rngs(0), **kw)
    return ubnn.ParallelMLP(LH, LF, precision=HIGHEST, rngs=nnx.Rngs(0), **kw)


def _nnx_fn(module):
    graphdef, rest = nnx.graphdef(module), nnx.state(module, nnx.Not(nnx.Param))
    return lambda params, x: nnx.merge(graphdef, params, rest)(x)


@pytest.mark.parametrize("kind", ["column", "mlp"])
def test_nnx_layers(kind, cpu_mesh, bulk_calls):
    x = rand(10, (LB, LS, LH))
    ct = rand(11, (LB, LS, LF if kind == "column" else LH))
    out = {}
    with jax.set_mesh(cpu_mesh(TP)):
        for rc in (False, True):
            module = _nnx(kind, recompute_gathered=rc)
            params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
            bulk_calls.clear()
            out[rc] = _loss_and_grads(_nnx_fn(module), params, x, ct)
            assert len(bulk_calls) == (2 if rc else 0), bulk_calls
    assert (module.up if kind == "mlp" else module).recompute_gathered is True
    _assert_close(out[True], out[False])
    assert float(jnp.abs(out[True][1][1]).sum()) > 0  # dx is not trivially zero


@pytest.mark.parametrize("kind", ["column", "mlp"])
def test_linen_layers(kind, cpu_mesh, bulk_calls):
    x = rand(12, (LB, LS, LH))
    ct = rand(13, (LB, LS, LF if kind == "column" else LH))
    cls = ubl.ColumnParallelDense if kind == "column" else ubl.ParallelMLP
    out = {}
    with jax.set_mesh(cpu_mesh(TP)):
        params = nn.unbox(jax.jit(cls(LF, precision=HIGHEST).init)(jax.random.key(0), x))["params"]
        for rc in (False, True):
            model = cls(LF, precision=HIGHEST, recompute_gathered=rc)
            bulk_calls.clear()
            out[rc] = _loss_and_grads(lambda p, x, m=model: m.apply({"params": p}, x), params, x, ct)
            assert len(bulk_calls) == (2 if rc else 0), bulk_calls
    _assert_close(out[True], out[False])


def test_nnx_column_inside_user_shard_map(cpu_mesh, bulk_calls):
    """Local mode (the user's own shard_map) with a whole kernel closed over."""
    mesh = cpu_mesh(TP)
    x, ct = rand(14, (LB, LS, LH)), rand(15, (LB, LS, LF))
    out = {}
    for rc in (False, True):
        layer = ubnn.ColumnParallelDense(LH, LF, precision=HIGHEST, recompute_gathered=rc, rngs=nnx.Rngs(0))
        f = jax.shard_map(
            lambda x, layer=layer: layer(x), mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, None, "tp")
        )
        bulk_calls.clear()
        out[rc] = jax.jit(jax.value_and_grad(lambda x, f=f: jnp.sum(f(x) * ct)))(x)
        assert len(bulk_calls) == (2 if rc else 0)
    _assert_close(out[True], out[False])


# ------------------------------------------------------------------------------------------------
# Forward mode: the custom_vjp is reverse mode only, and the error says which option made it so.


@pytest.mark.parametrize("how", ["argument", "env"])
def test_forward_mode_through_recompute_names_the_option_and_the_way_out(how, cpu_mesh):
    """jvp of an eager shard_map gave jax's "unhashable type: 'Unhashable'", naming neither jax_ub
    nor recompute_gathered. (Under jit, jax applies the jvp to the traced custom_vjp after jax_ub's
    code has run: its own "can't apply forward-mode autodiff (jvp) to a custom_vjp function"
    stands there, with a stack trace that points at the op.)"""
    mesh = cpu_mesh(TP)
    x, w = operands(0, True, F32)
    kw = {"recompute_gathered": True} if how == "argument" else {}
    f = jax.shard_map(
        lambda x, w: ops.all_gather_matmul(x, w, "tp", **kw),
        mesh=mesh,
        in_specs=(x_spec(0), P(None, "tp")),
        out_specs=P(None, None, "tp"),
    )
    with (
        config.override(recompute_gathered=(how == "env")),
        pytest.raises(
            TypeError,
            match=re.escape(
                "all_gather_matmul: forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian) cannot go "
                "through recompute_gathered=True (given, or JAX_UB_RECOMPUTE_GATHERED=1): jax_ub gives "
                "it a custom_vjp, which jax differentiates in reverse mode only (jax.grad, jax.vjp). "
                "For forward mode use method='xla'"
            ),
        ),
    ):
        jax.jvp(f, (x, w), (rand(3, x.shape), rand(4, w.shape)))
    # The way out it names works: without recompute, jax derives the jvp of the reference.
    plain = jax.shard_map(
        lambda x, w: ops.all_gather_matmul(x, w, "tp", recompute_gathered=False),
        mesh=mesh,
        in_specs=(x_spec(0), P(None, "tp")),
        out_specs=P(None, None, "tp"),
    )
    ref = jax.shard_map(
        lambda x, w: reference.all_gather_matmul(x, w, "tp"),
        mesh=mesh,
        in_specs=(x_spec(0), P(None, "tp")),
        out_specs=P(None, None, "tp"),
    )
    tangents = (rand(3, x.shape), rand(4, w.shape))
    y, dy = jax.jvp(plain, (x, w), tangents)
    y_ref, dy_ref = jax.jvp(ref, (x, w), tangents)
    assert rel_err(y, y_ref) <= GRAD_RTOL[F32] and rel_err(dy, dy_ref) <= GRAD_RTOL[F32]


@pytest.mark.parametrize("recompute", [True, False])
def test_grad_with_an_empty_w_shard(recompute, cpu_mesh):
    """w with no columns here: the forward gives [m, 0]; its gradient is zeros of x's shape and an
    empty dw. The recompute backward flattened dy with reshape(-1, 0), which jax cannot infer (a
    bare ZeroDivisionError). Run under GSPMD: Shardy refuses this program itself (a jax bug that a
    plain lax.all_gather + dot meets too)."""
    from jax._src import config as jax_config  # the partitioner switch has no public context manager

    mesh = cpu_mesh(2)
    f = jax.shard_map(
        lambda x, w: ops.all_gather_matmul(x, w, "tp", recompute_gathered=recompute),
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )
    x, w = rand(0, (8, 16)), jnp.ones((16, 0))
    with jax_config.use_shardy_partitioner(False):
        dx, dw = jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))(x, w)
    assert dx.shape == x.shape and dw.shape == w.shape
    assert not np.asarray(dx).any()


@pytest.mark.parametrize("k, n", [(0, 8), (8, 0)])
def test_matmul_backward_with_an_empty_dim(k, n):
    """jax_ub.matmul's backward (the cuBLASLt path's, here on its XLA GEMMs) with k or n of 0."""
    from jax_ub import gemm

    x, w = rand(0, (2, 4, k)), rand(1, (k, n))
    dy = rand(2, (2, 4, n))
    dx, dw = gemm._matmul_bwd(None, False, (x, w), dy)
    assert dx.shape == x.shape and dw.shape == w.shape
    assert not np.asarray(dw).any() and not np.asarray(dx).any()
