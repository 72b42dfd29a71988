"""jax_ub.ops against plain JAX on 8 forced host devices: forward values and gradients.

Oracles: the global product in float64 NumPy (forward), and ``jax.grad`` of the same shard_map'ed
function built from :mod:`jax_ub.reference` (gradients), plus ``check_grads`` on a few fp32 cases.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import dot_precisions
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from jax_ub import config, ops, reference, resolve

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
DTYPES = {"bf16": BF16, "f16": F16, "f32": F32}
# Relative Frobenius error bounds (the issues' bound: bf16 1e-2 against float32; fp32 1e-5).
RTOL = {BF16: 1.5e-2, F16: 3e-3, F32: 1e-5}
AGRAD_RTOL = {BF16: 2e-2, F16: 4e-3, F32: 1e-5}


def rel_err(got, want) -> float:
    got = np.asarray(jnp.asarray(got, F32), np.float64)
    want = np.asarray(jnp.asarray(want, F32), np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def rand(key, shape, dtype):
    """Standard normal values (never all zeros), rounded to ``dtype``."""
    return jax.random.normal(key, shape, F32).astype(dtype)


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, F32), np.float64)


# ----------------------------------------------------------------------------------------------
# One test case: global operands, the shard_map specs, and the expected global output.


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # "ag" | "rs"
    tp: int
    dtype: object
    x_local: tuple[int, ...]  # local shape of x on one device
    axis: int = 0  # gather_axis / scatter_axis as passed (may be negative)
    n: int = 7  # AG: n_local; RS: n
    w_sharded: bool = True
    dp: int | None = None  # dp x tp mesh with x's axis 0 sharded over "dp"
    tp_first: bool = False
    return_gathered: bool = False
    check_vma: bool = True

    @property
    def naxis(self) -> int:
        return self.axis % len(self.x_local)

    def x_spec(self) -> P:
        spec: list = [None] * len(self.x_local)
        spec[self.naxis if self.op == "ag" else -1] = "tp"
        if self.dp:
            spec[0] = "dp"
        return P(*spec)

    def w_spec(self) -> P:
        if not self.w_sharded:
            return P()
        return P(None, "tp") if self.op == "ag" else P("tp", None)

    def y_spec(self) -> P:
        """AG: rows full, columns sharded; RS: scatter axis sharded. A replicated-w AG output is
        the same on every device but still typed as varying, so it is stacked on a new axis 0."""
        spec: list = [None] * len(self.x_local)
        if self.dp:
            spec[0] = "dp"
        if self.op == "rs":
            spec[self.naxis] = "tp"
        elif self.w_sharded:
            spec[-1] = "tp"
        else:
            spec = ["tp", *spec]
        return P(*spec)

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, int]]:
        """Global shapes of x and w."""
        xs = list(self.x_local)
        if self.dp:
            xs[0] *= self.dp
        if self.op == "ag":
            xs[self.naxis] *= self.tp
            ws = (self.x_local[-1], self.n * (self.tp if self.w_sharded else 1))
        else:
            xs[-1] *= self.tp
            ws = (self.x_local[-1] * (self.tp if self.w_sharded else 1), self.n)
        return tuple(xs), ws

    def operands(self, seed: int = 0):
        kx, kw = jax.random.split(jax.random.key(seed))
        xs, ws = self.shapes()
        return rand(kx, xs, self.dtype), rand(kw, ws, self.dtype)

    def expected(self, x, w) -> np.ndarray:
        x, w = f64(x), f64(w)
        if self.op == "ag":
            y = x @ w
            return y if self.w_sharded else np.broadcast_to(y, (self.tp, *y.shape))
        if not self.w_sharded:  # every device multiplies its k-slice by the same w
            x = x.reshape(*x.shape[:-1], self.tp, -1).sum(-2)
        return x @ w

    def fn(self, lib, mesh, method: str | None = None):
        """jit(shard_map(the op of ``lib``)) over ``mesh`` on global operands."""
        kw = {} if lib is reference else {"method": method}
        if self.op == "ag":

            def body(x, w):
                out = lib.all_gather_matmul(
                    x, w, "tp", gather_axis=self.axis, return_gathered=self.return_gathered, **kw
                )
                return out if self.w_sharded else jax.tree.map(lambda a: a[None], out)
        else:

            def body(x, w):
                return lib.matmul_reduce_scatter(x, w, "tp", scatter_axis=self.axis, **kw)

        out_specs = self.y_spec()
        if self.return_gathered:  # x_gathered is the same on every "tp" device: concatenate copies
            g: list = [None] * len(self.x_local)
            if self.dp:
                g[0] = "dp"
            out_specs = (out_specs, P(*g[:-1], "tp") if self.w_sharded else P("tp", *g))
        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(self.x_spec(), self.w_spec()),
                out_specs=out_specs,
                check_vma=self.check_vma,
            )
        )


def case_id(c: Case) -> str:
    dt = {BF16: "bf16", F16: "f16", F32: "f32"}[c.dtype]
    xs, ws = c.shapes()
    parts = [c.op, f"tp{c.tp}" if not c.dp else f"dp{c.dp}tp{c.tp}", dt, "x".join(map(str, (*xs, ws[1])))]
    if c.axis:
        parts.append(f"axis{c.axis}")
    if not c.w_sharded:
        parts.append("wrepl")
    if c.tp_first:
        parts.append("tpfirst")
    if c.return_gathered:
        parts.append("gathered")
    if not c.check_vma:
        parts.append("novma")
    return "-".join(parts)


def loss_fn(f, cot):
    """Scalar loss <f(x, w), cot> in float32 over every output leaf."""

    def loss(x, w):
        outs = jax.tree.leaves(f(x, w))
        return sum(jnp.vdot(o.astype(F32), c) for o, c in zip(outs, cot, strict=True))

    return loss


def cotangents(f, x, w, seed=1):
    outs = jax.tree.leaves(jax.eval_shape(f, x, w))
    keys = jax.random.split(jax.random.key(seed), len(outs))
    return [rand(k, o.shape, F32) for k, o in zip(keys, outs, strict=True)]


def outputs_and_grads(c: Case, lib, mesh, x, w, cot):
    """One compiled program per library: the op's outputs and (dx, dw) of <outputs, cot>."""
    f = c.fn(lib, mesh)

    def loss(x, w):
        out = f(x, w)
        return sum(jnp.vdot(o.astype(F32), k) for o, k in zip(jax.tree.leaves(out), cot, strict=True)), out

    return jax.jit(lambda x, w: jax.grad(loss, argnums=(0, 1), has_aux=True)(x, w)[::-1])(x, w)


@contextlib.contextmanager
def through_custom_vjp():
    """ops run the reference forward through the custom_vjp (how the CUDA path differentiates), not
    jax_ub.reference directly as they do for method "xla": the xla impls under another name."""
    impls = {(op, "xla_vjp"): ops._IMPLS[(op, "xla")] for op in ops.DUAL}
    with (
        mock.patch.dict(ops._IMPLS, impls),
        mock.patch.object(resolve, "method_name", lambda m, fn=None, **kw: "xla_vjp"),
    ):
        yield


def on_both_paths(run):
    """``run()`` as the ops differentiate on the reference path (JAX's own autodiff of
    jax_ub.reference) and through the custom_vjp (the CUDA path's backward, run with the xla impls):
    comparing ops with jax_ub.reference on CPU checks something only on the second."""
    direct = run()
    with through_custom_vjp():
        return [direct, run()]


def check(c: Case, mesh):
    """Forward against the float64 global product and against the reference; gradients against
    jax.grad of the reference, both on the reference path (method "xla": jax_ub.reference itself)
    and through the custom_vjp that the CUDA path differentiates with."""
    x, w = c.operands()
    cot = cotangents(c.fn(ops, mesh), x, w)
    want, g_want = outputs_and_grads(c, reference, mesh, x, w, cot)
    with through_custom_vjp():
        got_vjp, g_vjp = outputs_and_grads(c, ops, mesh, x, w, cot)
    for a, b in zip(jax.tree.leaves(got_vjp), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same forward
    for name, a, b in zip(("dx", "dw"), g_vjp, g_want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) <= AGRAD_RTOL[c.dtype], name
    got, g_got = outputs_and_grads(c, ops, mesh, x, w, cot)
    y = got[0] if c.return_gathered else got
    assert y.dtype == c.dtype
    assert rel_err(y, c.expected(x, w)) <= RTOL[c.dtype]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a, b) <= RTOL[c.dtype]
    for name, a, b in zip(("dx", "dw"), g_got, g_want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) <= AGRAD_RTOL[c.dtype], name
    return got


# ----------------------------------------------------------------------------------------------
# The grid: tp x dtype, non-power-of-two sizes (m=3 per shard, k=5, n=7).

GRID = [Case(op, tp, dt, (3, 5)) for op in ("ag", "rs") for tp in (1, 2, 4, 8) for dt in (BF16, F16, F32)]
# RS needs the scatter dim divisible by tp: 3*tp rows locally.
GRID = [dataclasses.replace(c, x_local=(3 * c.tp, 5)) if c.op == "rs" else c for c in GRID]


@pytest.mark.parametrize("case", GRID, ids=case_id)
def test_grid(case, cpu_mesh):
    check(case, cpu_mesh(case.tp))


# Leading batch dims: [b, s, h] gathered / scattered along s and along b, positive and negative.
BATCH = [
    Case("ag", 4, BF16, (2, 3, 5), axis=1),
    Case("ag", 4, F32, (2, 3, 5), axis=-2),
    Case("ag", 4, F32, (2, 3, 5), axis=0),
    Case("ag", 2, F16, (2, 3, 5), axis=-3),
    Case("ag", 2, F32, (2, 2, 3, 5), axis=-2),  # two batch dims
    Case("rs", 4, BF16, (2, 4, 5), axis=1),
    Case("rs", 4, F32, (2, 8, 5), axis=-2),
    Case("rs", 4, F32, (4, 3, 5), axis=0),
    Case("rs", 2, F16, (2, 3, 5), axis=-3),
    Case("rs", 2, F32, (2, 2, 6, 5), axis=1),
]


@pytest.mark.parametrize("case", BATCH, ids=case_id)
def test_batch_dims(case, cpu_mesh):
    check(case, cpu_mesh(case.tp))


# shard_map's varying-axes checking on and off, with w sharded and replicated.
VMA = [
    Case(op, 4, F32, (2, 4, 5) if op == "rs" else (2, 3, 5), axis=1, w_sharded=ws, check_vma=cv)
    for op in ("ag", "rs")
    for ws in (True, False)
    for cv in (True, False)
]


@pytest.mark.parametrize("case", VMA, ids=case_id)
def test_vma_and_replicated_w(case, cpu_mesh):
    check(case, cpu_mesh(case.tp))


RETURN_GATHERED = [
    Case("ag", 4, F32, (3, 5), return_gathered=True),
    Case("ag", 4, BF16, (2, 3, 5), axis=-2, return_gathered=True),
    Case("ag", 2, F32, (2, 3, 5), axis=1, return_gathered=True, w_sharded=False),
    Case("ag", 2, F32, (2, 3, 5), axis=1, return_gathered=True, check_vma=False),
]


@pytest.mark.parametrize("case", RETURN_GATHERED, ids=case_id)
def test_return_gathered(case, cpu_mesh):
    """The gathered x equals all_gather(x); its cotangent flows back into dx."""
    _, xg = check(case, cpu_mesh(case.tp))
    x, _ = case.operands()
    xg = xg[0] if not case.w_sharded else xg
    want = f64(x)  # gathering the shards gives the global x back (per dp block)
    if case.w_sharded:  # stacked column blocks of identical gathered copies
        want = np.concatenate([want] * case.tp, axis=-1)
    assert rel_err(xg, want) == 0.0


DPTP = [
    Case("ag", 4, F32, (1, 3, 5), axis=1, dp=2),
    Case("ag", 4, BF16, (1, 3, 5), axis=-2, dp=2, w_sharded=False),
    Case("ag", 4, F32, (1, 3, 5), axis=1, dp=2, tp_first=True),
    Case("rs", 4, F32, (1, 4, 5), axis=1, dp=2),
    Case("rs", 4, BF16, (1, 4, 5), axis=-2, dp=2, w_sharded=False),
    Case("rs", 4, F32, (1, 4, 5), axis=1, dp=2, tp_first=True),
    Case("rs", 4, F32, (1, 4, 5), axis=1, dp=2, check_vma=False),
]


@pytest.mark.parametrize("case", DPTP, ids=case_id)
def test_dp_by_tp_mesh(case, cpu_mesh):
    """A 2x4 mesh: TP groups along "tp", batch sharded over "dp"; w replicated over "dp" gets its
    gradient summed over "dp" too."""
    check(case, cpu_mesh(case.tp, dp=case.dp, tp_first=case.tp_first))


# ----------------------------------------------------------------------------------------------
# Gradients by finite differences (fp32), including second order through the dual op.


@pytest.mark.parametrize(
    "case,order",
    [
        (Case("ag", 2, F32, (3, 5)), 1),
        (Case("ag", 4, F32, (2, 3, 5), axis=1, w_sharded=False), 1),
        (Case("rs", 2, F32, (4, 5)), 1),
        (Case("rs", 4, F32, (2, 4, 5), axis=-2, w_sharded=False), 1),
        (Case("ag", 2, F32, (3, 5), return_gathered=True), 2),
        (Case("rs", 2, F32, (4, 5)), 2),
    ],
    ids=lambda v: case_id(v) if isinstance(v, Case) else f"order{v}",
)
def test_check_grads(case, order, cpu_mesh):
    x, w = case.operands()
    f = case.fn(ops, cpu_mesh(case.tp))
    cot = cotangents(f, x, w)
    with jax.default_matmul_precision("highest"):
        check_grads(loss_fn(f, cot), (x, w), order=order, modes=("rev",), atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------
# Composition: scan over layers, several shapes in one jit, precision, dispatch.


def _mlp(lib, x, w1, w2):
    """Sequence-parallel MLP stack: [b, s/tp, h] -> AG along s -> tanh -> RS along s, per layer."""

    def layer(h, ws):
        a, b = ws
        u = jnp.tanh(lib.all_gather_matmul(h, a, "tp", gather_axis=1))
        return h + lib.matmul_reduce_scatter(u, b, "tp", scatter_axis=1), None

    return lax.scan(layer, x, (w1, w2))[0]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_inside_scan(dtype, cpu_mesh):
    tp, layers, b, s, h, f = 4, 3, 2, 8, 6, 12
    mesh = cpu_mesh(tp)
    k = jax.random.split(jax.random.key(3), 3)
    x = rand(k[0], (b, s, h), dtype)
    w1 = (rand(k[1], (layers, h, f), F32) * 0.3).astype(dtype)
    w2 = (rand(k[2], (layers, f, h), F32) * 0.3).astype(dtype)
    specs = (P(None, "tp"), P(None, None, "tp"), P(None, "tp", None))

    def loss(lib):
        g = jax.shard_map(lambda *a: _mlp(lib, *a), mesh=mesh, in_specs=specs, out_specs=P(None, "tp"))
        return lambda *a: jnp.sum(jnp.sin(g(*a).astype(F32)))

    v2, g2 = jax.jit(jax.value_and_grad(loss(reference), argnums=(0, 1, 2)))(x, w1, w2)
    for v1, g1 in on_both_paths(lambda: jax.jit(jax.value_and_grad(loss(ops), argnums=(0, 1, 2)))(x, w1, w2)):
        assert rel_err(v1, v2) <= AGRAD_RTOL[dtype]
        for a, r in zip(g1, g2, strict=True):
            assert rel_err(a, r) <= AGRAD_RTOL[dtype]


def test_several_shapes_in_one_jit(cpu_mesh):
    mesh = cpu_mesh(4)
    k = jax.random.split(jax.random.key(4), 4)
    x1, w1 = rand(k[0], (3, 5), F32), rand(k[1], (5, 7), F32)  # AG, m=3
    x2, w2 = rand(k[2], (2, 4, 6), F32), rand(k[3], (6, 3), F32)  # RS along s=4

    def body(lib):
        def f(x1, w1, x2, w2):
            return (
                lib.all_gather_matmul(x1, w1, "tp"),
                lib.all_gather_matmul(x2, w2, "tp", gather_axis=-2),
                lib.matmul_reduce_scatter(x2, w2, "tp", scatter_axis=1),
            )

        return f

    def run(lib):
        g = jax.shard_map(body(lib), mesh=mesh, in_specs=P("tp"), out_specs=(P("tp"), P("tp"), P("tp")))
        return jax.jit(
            lambda *a: (
                g(*a),
                jax.grad(lambda *a: sum(jnp.sum(jnp.cos(o)) for o in g(*a)), argnums=(0, 1, 2, 3))(*a),
            )
        )

    shapes = (x1.repeat(4, 0), w1.repeat(4, 0), x2.repeat(4, 0), w2.repeat(4, 0))
    want = run(reference)(*shapes)
    for got in on_both_paths(lambda: run(ops)(*shapes)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_precision_reaches_every_dot(op, cpu_mesh):
    mesh = cpu_mesh(2)
    x, w = rand(jax.random.key(5), (4, 6), F32), rand(jax.random.key(6), (6, 8), F32)
    hi = lax.Precision.HIGHEST
    if op == "ag":
        body = lambda x, w: ops.all_gather_matmul(x, w, "tp", precision=hi)  # noqa: E731
    else:
        body = lambda x, w: ops.matmul_reduce_scatter(x, w, "tp", precision=hi)  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P("tp"))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1)))(x, w)
    precisions = list(dot_precisions(jaxpr.jaxpr))
    assert len(precisions) == 3  # forward, dgrad, wgrad
    assert all(p == (hi, hi) for p in precisions), precisions


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_backward_uses_same_dispatch(op, cpu_mesh, monkeypatch):
    """The backward of each op is its dual, through the same (op, method) dispatch."""
    calls = []

    def spy(kind):
        def impl(x, w, **kw):
            calls.append(kind)
            return ops._IMPLS[(kind, "xla")](x, w, **kw)

        return impl

    monkeypatch.setitem(ops._IMPLS, ("ag", "spy"), spy("ag"))
    monkeypatch.setitem(ops._IMPLS, ("rs", "spy"), spy("rs"))
    monkeypatch.setattr(resolve, "method_name", lambda method, fn=None, **kw: "spy")
    c = Case(op, 2, F32, (4, 5))
    x, w = c.operands()
    f = c.fn(ops, cpu_mesh(2))
    cot = cotangents(f, x, w)
    calls.clear()
    jax.grad(loss_fn(f, cot), argnums=(0, 1))(x, w)
    assert calls[-1] == ops.DUAL[op] and set(calls) == {op, ops.DUAL[op]}, calls


def test_duality_table():
    assert ops.DUAL == {"ag": "rs", "rs": "ag"}
    assert all(ops.DUAL[ops.DUAL[k]] == k for k in ops.DUAL)
    assert {("ag", "xla"), ("rs", "xla")} <= set(ops._IMPLS)


@pytest.mark.parametrize(
    "cfg,method,want",
    [
        ({}, None, "xla"),
        ({}, "auto", "xla"),
        ({}, "xla", "xla"),
        ({"method": "xla"}, None, "xla"),
        ({"disable": True}, "ring", "xla"),
        ({"disable": True, "method": "nccl"}, None, "xla"),
    ],
    ids=["default", "auto", "xla", "config-xla", "disable-ring", "disable-config-nccl"],
)
def test_resolve_method(cfg, method, want):
    with config.override(method="auto", disable=False), config.override(**cfg):
        assert ops._resolve_method(method) == want


def test_disable_runs_reference_for_cuda_method(cpu_mesh):
    c = Case("ag", 2, F32, (3, 5))
    x, w = c.operands()
    with config.override(disable=True):
        y = c.fn(ops, cpu_mesh(2), method="ring")(x, w)
    assert rel_err(y, c.expected(x, w)) <= RTOL[F32]


@pytest.mark.parametrize(
    "op,method",
    [("ag", "ring"), ("ag", "push"), ("rs", "chain"), ("rs", "columns"), ("ag", "nccl"), ("rs", None)],
)
def test_axis_of_size_one_runs_a_plain_dot_for_every_method(cpu_mesh, op, method):
    """tp=1 (a dp-only mesh): nothing to communicate, so any method, CUDA ones included (which
    would need the extension on a larger axis), runs the reference: values and gradients."""
    c = Case(op, 1, F32, (2, 6, 5), axis=1, dp=4)
    x, w = c.operands()
    mesh = cpu_mesh(1, dp=4)
    with config.override(method="ring" if method is None else "auto", disable=False):
        f = c.fn(ops, mesh, method=method)
        assert rel_err(f(x, w), c.expected(x, w)) <= RTOL[F32]
        g = jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))(x, w)
    g_ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(c.fn(reference, mesh)(x, w))), argnums=(0, 1))(x, w)
    for a, b in zip(g, g_ref, strict=True):
        assert rel_err(a, b) <= RTOL[F32]
    with pytest.raises(ValueError, match="`method` must be None or one of"):
        c.fn(ops, mesh, method="no_such_method")(x, w)


def test_method_nccl_is_deprecated_and_behaves_as_before(cpu_mesh, monkeypatch):
    """NCCL is a transport: method="nccl" (and JAX_UB_METHOD=nccl) is still accepted, with a
    DeprecationWarning naming transport="nccl"; it runs as before (the reference on an axis of size
    1, the CUDA path's error without it, the NCCL schedule on transport nccl only)."""
    from jax_ub import bulk, collectives, methods

    assert "nccl" in config.METHODS and "nccl" not in methods.CUDA_METHODS
    c = Case("ag", 1, F32, (2, 6, 5), axis=1, dp=4)
    x, w = c.operands()
    with (
        config.override(method="auto", disable=False),
        pytest.warns(DeprecationWarning, match=r"method='nccl' is deprecated.*transport='nccl'"),
    ):
        y = c.fn(ops, cpu_mesh(1, dp=4), method="nccl")(x, w)
    assert rel_err(y, c.expected(x, w)) <= RTOL[F32]
    with (
        config.override(method="nccl", disable=False),
        pytest.warns(DeprecationWarning, match=r"JAX_UB_METHOD=nccl is deprecated.*JAX_UB_TRANSPORT"),
    ):
        y = c.fn(ops, cpu_mesh(1, dp=4))(x, w)
    assert rel_err(y, c.expected(x, w)) <= RTOL[F32]
    monkeypatch.setattr(resolve, "cuda_status", lambda: (False, "no GPU (stand-in)"))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="method='nccl' needs the CUDA"):
        resolve.for_size(resolve.requested("nccl", "all_gather_matmul"), 2, x, w, fn="all_gather_matmul")
    with pytest.warns(DeprecationWarning, match="bulk_all_gather: method='nccl' is deprecated"):
        jax.shard_map(
            lambda a: bulk.bulk_all_gather(a, a, a.T, "tp", method="nccl")[1],
            mesh=cpu_mesh(1),
            in_specs=P(),
            out_specs=P(),
        )(jnp.ones((2, 2)))
    with pytest.warns(DeprecationWarning, match="all_gather: method='nccl' is deprecated"):
        jax.shard_map(
            lambda a: collectives.all_gather(a, "tp", method="nccl"),
            mesh=cpu_mesh(1),
            in_specs=P(),
            out_specs=P(),
        )(jnp.ones((2, 2)))
    # the schedule code it hands the kernel is the one it always did (the NCCL schedule ignores it)
    assert [methods.runs(op, "nccl") for op in ("ag", "rs", "bulk_ag", "reduce_scatter")] == [
        "push",
        "ring",
        "push",
        "ring",
    ]


@pytest.mark.parametrize("which", ["all_gather", "reduce_scatter"])
def test_bare_collective_on_an_axis_of_size_one_returns_its_input(cpu_mesh, which):
    """jax_ub.overlap.all_gather / reduce_scatter over a size-1 axis (where initialize makes no
    communicator) are the identity, as lax.all_gather / psum_scatter are there; on a larger axis
    without a communicator they still say that initialize is missing."""
    from jax_ub import overlap

    fn = getattr(overlap, which)
    x = jax.random.normal(jax.random.key(3), (4 * 6, 5), jnp.float32)
    mesh = cpu_mesh(1, dp=4)
    y = jax.jit(
        jax.shard_map(lambda x: fn(x, "tp") * 2.0, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))
    )(x)
    np.testing.assert_array_equal(np.asarray(y), 2.0 * np.asarray(x))
    with pytest.raises(ValueError, match="no jax_ub communicator for mesh axis 'tp'"):
        jax.jit(jax.shard_map(lambda x: fn(x, "tp"), mesh=cpu_mesh(2), in_specs=P("tp"), out_specs=P("tp")))(
            x
        )


def test_missing_communicator_warns_once_per_gpu_axis(monkeypatch, caplog, cpu_mesh):
    """method='auto' without a communicator runs XLA: on a GPU mesh that is most likely a missing
    jax_ub.initialize, said once per axis; a CPU mesh (the reference path on purpose) says nothing."""
    from jax_ub import _validate, comm

    seen = []
    jax.jit(
        jax.shard_map(
            lambda x: seen.append(_validate.mesh_platform()) or x,
            mesh=cpu_mesh(2),
            in_specs=P("tp"),
            out_specs=P("tp"),
        )
    )(jnp.ones(4))
    assert seen == ["cpu"]  # what the check reads inside shard_map on this jax
    monkeypatch.setattr(comm, "_warned_axes", set())
    with caplog.at_level("WARNING", logger="jax_ub"):
        comm.warn_no_communicator("all_gather_matmul", "tp")
        assert not caplog.records
        monkeypatch.setattr(_validate, "mesh_platform", lambda: "gpu")
        for _ in range(3):
            comm.warn_no_communicator("all_gather_matmul", "tp")
        comm.warn_no_communicator("bulk_all_gather", "model")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "GPU mesh axis 'tp' has no jax_ub communicator" in msgs[0]
    assert "jax_ub.initialize(mesh, axis='tp')" in msgs[0]
    assert "bulk_all_gather" in msgs[1] and "'model'" in msgs[1]


def test_eager_shard_map_without_jit(cpu_mesh):
    mesh = cpu_mesh(2)
    x, w = rand(jax.random.key(7), (4, 5), F32), rand(jax.random.key(8), (5, 6), F32)
    f = jax.shard_map(
        lambda x, w: ops.all_gather_matmul(x, w, "tp"),
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )
    assert rel_err(f(x, w), f64(x) @ f64(w)) <= RTOL[F32]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_replicated_x_gradient_is_summed(check_vma, cpu_mesh):
    """x replicated (P()) into an AG: its cotangent is the sum over "tp" of the per-device ones."""
    mesh = cpu_mesh(4)
    x, w = rand(jax.random.key(9), (3, 5), F32), rand(jax.random.key(10), (5, 28), F32)

    def grads(lib):
        f = jax.shard_map(
            lambda x, w: lib.all_gather_matmul(x, w, "tp"),
            mesh=mesh,
            in_specs=(P(), P(None, "tp")),
            out_specs=P(None, "tp"),
            check_vma=check_vma,
        )
        return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))(x, w)

    want = grads(reference)
    for got in on_both_paths(lambda: grads(ops)):
        for a, b in zip(got, want, strict=True):
            assert rel_err(a, b) <= 1e-5


# ----------------------------------------------------------------------------------------------
# Forward mode: the reference path calls jax_ub.reference directly (no custom_vjp).

FWD = [
    Case("ag", 4, F32, (2, 5)),
    Case("ag", 2, F32, (2, 3, 5), axis=1, return_gathered=True),
    Case("rs", 4, F32, (4, 5)),
    Case("rs", 2, F32, (2, 4, 5), axis=-2, w_sharded=False),
]


@pytest.mark.parametrize("case", FWD, ids=case_id)
def test_forward_mode_on_the_reference_path(case, cpu_mesh):
    mesh = cpu_mesh(case.tp)
    x, w = case.operands()
    dx, dw = case.operands(seed=1)
    f, ref = case.fn(ops, mesh), case.fn(reference, mesh)
    for a, b in zip(
        jax.tree.leaves(jax.jvp(f, (x, w), (dx, dw))),
        jax.tree.leaves(jax.jvp(ref, (x, w), (dx, dw))),
        strict=True,
    ):
        assert rel_err(a, b) <= 1e-6
    loss = lambda lib: lambda x: jnp.sum(jax.tree.leaves(lib(x, w))[0] ** 2)  # noqa: E731
    assert rel_err(jax.jacfwd(loss(f))(x), jax.jacfwd(loss(ref))(x)) <= 1e-6
    assert rel_err(jax.hessian(loss(f))(x), jax.hessian(loss(ref))(x)) <= 1e-6
    assert rel_err(jax.jacfwd(loss(f))(x), jax.grad(loss(f))(x)) <= 1e-5


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_reference_path_reverse_mode_equals_the_custom_vjp(op, cpu_mesh):
    """Calling the reference directly changes no number of the reverse mode (2-D: bit for bit)."""
    c = Case(op, 4, F32, (4, 5))
    mesh = cpu_mesh(4)
    x, w = c.operands()
    cot = cotangents(c.fn(ops, mesh), x, w)
    direct = outputs_and_grads(c, ops, mesh, x, w, cot)
    with through_custom_vjp():
        via_vjp = outputs_and_grads(c, ops, mesh, x, w, cot)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(via_vjp), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_forward_mode_needs_the_reference_path(cpu_mesh):
    """recompute_gathered (like the CUDA path) goes through the custom_vjp: reverse mode only."""
    c = Case("ag", 2, F32, (2, 5))
    x, w = c.operands()
    f = jax.shard_map(
        lambda x, w: ops.all_gather_matmul(x, w, "tp", recompute_gathered=True),
        mesh=cpu_mesh(2),
        in_specs=(c.x_spec(), c.w_spec()),
        out_specs=c.y_spec(),
    )
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jacfwd(lambda x: jnp.sum(f(x, w)))(x)
    assert jax.grad(lambda x: jnp.sum(f(x, w)))(x).shape == x.shape


@pytest.mark.parametrize(
    "cfg,method,want",
    [
        ({"disable": True}, None, "JAX_UB_DISABLE=1"),
        ({}, "xla", "'xla' (the pure-XLA reference): requested"),
        ({}, "auto", "method 'auto' -> "),
    ],
    ids=["disable", "xla", "auto"],
)
def test_resolve_method_logs_its_choice(cfg, method, want, caplog):
    with (
        config.override(method="auto", disable=False),
        config.override(**cfg),
        caplog.at_level("DEBUG", logger="jax_ub"),
    ):
        got = ops._resolve_method(method)
    msgs = [r.getMessage() for r in caplog.records if r.name == "jax_ub" and r.levelname == "DEBUG"]
    assert any(want in m and repr(got) in m for m in msgs), msgs


@pytest.mark.parametrize("path", ["reference", "custom_vjp", "recompute"])
def test_vmap_over_microbatches(cpu_mesh, path):
    """jax.vmap over the ops inside shard_map equals the ops on each batch element, values and
    gradients: on the reference path, through the custom_vjp (the CUDA path's backward) and with
    recompute_gathered (the custom_vjp with its bulk backward)."""
    recompute = path == "recompute"
    mesh = cpu_mesh(4)
    k = jax.random.split(jax.random.key(5), 3)
    x, w1, w2 = rand(k[0], (3, 16, 8), F32), rand(k[1], (8, 12), F32), rand(k[2], (12, 8), F32)

    def one(x, w1, w2):
        h = ops.all_gather_matmul(x, w1, "tp", recompute_gathered=recompute, precision=lax.Precision.HIGHEST)
        return ops.matmul_reduce_scatter(jnp.tanh(h), w2, "tp", precision=lax.Precision.HIGHEST)

    def wrap(body):
        return jax.shard_map(
            body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp")), out_specs=P(None, "tp")
        )

    def plain(x, w1, w2):  # the same model without jax_ub, on the global arrays
        h = jnp.matmul(x, w1, precision=lax.Precision.HIGHEST)
        return jnp.matmul(jnp.tanh(h), w2, precision=lax.Precision.HIGHEST)

    want = plain(x, w1, w2)
    g_want = jax.grad(lambda *a: jnp.sum(plain(*a) ** 2), (0, 1, 2))(x, w1, w2)
    batched = wrap(jax.vmap(one, in_axes=(0, None, None)))
    looped = wrap(lambda x, w1, w2: jnp.stack([one(x[i], w1, w2) for i in range(x.shape[0])]))
    with through_custom_vjp() if path == "custom_vjp" else contextlib.nullcontext():
        for f in (batched, looped):
            np.testing.assert_allclose(f(x, w1, w2), want, rtol=1e-5, atol=1e-6)
            g = jax.grad(lambda *a, f=f: jnp.sum(f(*a) ** 2), (0, 1, 2))(x, w1, w2)
            for name, a, b in zip(("dx", "dw1", "dw2"), g, g_want, strict=True):
                # fp32 sums in another order: an element's error scales with the terms summed (up
                # to ~170 here), not with the element (a CI run: dw1 0.091053 against 0.091028)
                scale = float(np.max(np.abs(b)))
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=max(1e-5, 1e-6 * scale), err_msg=name)


def test_zero_size_operand_resolves_to_the_reference():
    """A zero-size dimension leaves nothing to overlap: even a CUDA method (which would raise here,
    without the extension) resolves to the reference; a bad method name is still refused."""
    x, w = jnp.zeros((0, 8)), jnp.zeros((8, 4))
    assert ops._resolve_for_size("ring", 2, x, w) == "xla"
    assert ops._resolve_for_size("pipeline", 2, jnp.zeros((8, 0)), jnp.zeros((0, 4))) == "xla"
    with pytest.raises(ValueError, match="`method` must be None or one of"):
        ops._resolve_for_size("bogus", 2, x, w)
    if not ops._cuda_status()[0]:
        with pytest.raises(ValueError, match="needs the CUDA overlap extension"):
            ops._resolve_for_size("ring", 2, jnp.ones((8, 8)), jnp.ones((8, 4)))


def test_zero_width_output_on_the_reference(cpu_mesh):
    """n = 0 is the zero-size case JAX itself lowers in shard_map (in jax 0.10 a zero-size gather
    axis fails XLA's verifier, and all-empty operands fail shardy, with lax's own ops too)."""
    mesh = cpu_mesh(4)
    x, w = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8), jnp.ones((8, 0))
    ag = jax.jit(
        jax.shard_map(
            lambda x, w: ops.all_gather_matmul(x, w, "tp", method="ring"),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
        )
    )
    rs = jax.jit(
        jax.shard_map(
            lambda x, w: ops.matmul_reduce_scatter(x, w, "tp", method="ring"),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P("tp", None),
        )
    )
    assert ag(x, w).shape == (16, 0)
    assert rs(x, w).shape == (16, 0)


def _dots(f, *args) -> int:
    return f.lower(*args).as_text().count("dot_general")


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("empty", ["n", "k"])
@pytest.mark.parametrize("check_vma", [False, True], ids=["no_vma", "vma"])
def test_an_empty_operand_compiles_no_dot(cpu_mesh, op, empty, check_vma):
    """XLA of jax 0.11.2 dies with SIGSEGV compiling a dot with an empty result in a shard_map
    with a split operand (lab-2026-11:scripts/zero_size_probe.py), which every zero-size operand of these ops
    used to emit. Now the
    program has no dot, forward or backward, and the results and gradients are the zeros the
    product equals: an empty output (n = 0), or a sum over nothing (k = 0, a full-size output)."""
    mesh = cpu_mesh(2)
    n, k = (0, 8) if empty == "n" else (6, 0)
    x = jax.random.normal(jax.random.key(1), (16, k), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (k, n), jnp.float32)
    if op == "ag":
        fn, specs, out = ops.all_gather_matmul, (P("tp", None), P(None, "tp")), P(None, "tp")
    else:
        fn, specs, out = ops.matmul_reduce_scatter, (P(None, "tp"), P("tp", None)), P("tp", None)
    want = (16, n)
    sm = jax.shard_map(
        lambda x, w: fn(x, w, "tp", method="ring"),
        mesh=mesh,
        in_specs=specs,
        out_specs=out,
        check_vma=check_vma,
    )
    f = jax.jit(sm)
    y = f(x, w)
    assert y.shape == want and _dots(f, x, w) == 0
    np.testing.assert_array_equal(np.asarray(y), np.zeros(want, np.float32))
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(sm(x, w) * 3.0), argnums=(0, 1)))
    dx, dw = grad(x, w)
    assert _dots(grad, x, w) == 0
    assert dx.shape == x.shape and dw.shape == w.shape
    np.testing.assert_array_equal(np.asarray(dx), np.zeros(x.shape, np.float32))
    np.testing.assert_array_equal(np.asarray(dw), np.zeros(w.shape, np.float32))


def test_empty_products_of_matmul_and_the_layers_dot_compile_no_dot():
    """jax_ub.matmul's reference and reference.matmul itself: no dot where an operand is empty,
    the dot where none is (with its value)."""
    import jax_ub

    for a, b in [((0, 4), (4, 3)), ((5, 0), (0, 3)), ((5, 4), (4, 0)), ((2, 0, 4), (4, 3))]:
        x, w = jnp.ones(a, jnp.bfloat16), jnp.ones(b, jnp.bfloat16)
        for f in (jax.jit(lambda x, w: jax_ub.matmul(x, w, method="xla")), jax.jit(reference.matmul)):
            y = f(x, w)
            assert y.shape == jnp.matmul(x, w).shape and y.dtype == jnp.bfloat16 and _dots(f, x, w) == 0
            assert not np.asarray(y, np.float32).any()
    x, w = jax.random.normal(jax.random.key(3), (5, 4)), jax.random.normal(jax.random.key(4), (4, 3))
    f = jax.jit(reference.matmul)
    assert _dots(f, x, w) == 1
    np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(jax.jit(jnp.matmul)(x, w)))


def test_axis_name_tuples(cpu_mesh):
    """("tp",) is the axis "tp" (the ops see the plain name); a tuple of several axes gathers and
    scatters over their product on the reference path."""
    mesh = cpu_mesh(2, dp=2)
    x = jax.random.normal(jax.random.key(5), (16, 8))
    w = jax.random.normal(jax.random.key(6), (8, 12))

    def run(op, axes, spec_x, spec_w, spec_y):
        fn = ops.all_gather_matmul if op == "ag" else ops.matmul_reduce_scatter
        return jax.jit(
            jax.shard_map(
                lambda x, w: fn(x, w, axes),
                mesh=mesh,
                check_vma=False,
                in_specs=(spec_x, spec_w),
                out_specs=spec_y,
            )
        )(x, w)

    want = np.asarray(x) @ np.asarray(w)
    for axes in ("tp", ("tp",)):
        y = run("ag", axes, P(axes, None), P(None, "dp"), P(None, "dp"))
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    both = ("dp", "tp")
    y = run("ag", both, P(both, None), P(), P())
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    y = run("rs", both, P(None, both), P(both, None), P(both, None))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_a_tuple_of_one_axis_reaches_the_implementation_as_its_name(monkeypatch, cpu_mesh):
    seen = []

    def spy(x, w, *, axis_name, **kw):
        seen.append(axis_name)
        return ops._IMPLS[(ops.AG, "xla")](x, w, axis_name=axis_name, **kw)

    monkeypatch.setitem(ops._IMPLS, (ops.AG, "spy"), spy)
    monkeypatch.setattr(ops, "_resolve_for_size", lambda method, tp, *operands, fn=None: "spy")
    x, w = jnp.ones((8, 4)), jnp.ones((4, 6))
    jax.jit(
        jax.shard_map(
            lambda x, w: ops.all_gather_matmul(x, w, ("tp",)),
            mesh=cpu_mesh(2),
            in_specs=(P("tp", None), P()),
            out_specs=P(),
            check_vma=False,
        )
    )(x, w)
    assert seen == ["tp"], seen


def test_bulk_gather_beside_an_empty_gemm(cpu_mesh):
    """The bulk all-gather whose independent GEMM is empty (x[0, K] @ w[K, 0]): the gather is whole
    and the GEMM's result has its zero size (with a dot, the program XLA of jax 0.11.2 crashed
    compiling, on two GPUs and on CPU: tests/multigpu/test_overlap.py::
    test_zero_size_operands_give_xla_results, lab-2026-11:scripts/zero_size_probe.py)."""
    from jax_ub import bulk

    mesh = cpu_mesh(2)
    a = jax.random.normal(jax.random.key(53), (16, 4), jnp.float32)
    x, w = jnp.ones((0, 6)), jnp.ones((6, 0))
    f = jax.jit(
        jax.shard_map(
            lambda a, x, w: bulk.bulk_all_gather(a, x, w, "tp", method="ring"),
            mesh=mesh,
            in_specs=(P("tp", None), P(), P()),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    gathered, y = f(a, x, w)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(a))
    assert y.shape == (0, 0)


@pytest.mark.parametrize("cuda", [False, True], ids=["reference", "cuda_auto"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gradient_over_a_vmap_axis_named_like_the_tp_axis(monkeypatch, op, recompute, cuda):
    """A jax.vmap axis named "tp" (no shard_map) runs XLA's collectives over it, and reverse mode
    works there too: with recompute_gathered (its re-gather needs a shard_map axis) and where the
    CUDA path is available (`auto`'s custom_vjp; here the CUDA path is only reported available)."""
    if cuda:
        monkeypatch.setattr(resolve, "cuda_status", lambda: (True, ""))
    xs = jax.random.normal(jax.random.key(7), (4, 8, 5), jnp.float32)
    w = jax.random.normal(jax.random.key(8), (5, 3), jnp.float32)
    if op == "ag":

        def f(x, w):
            return ops.all_gather_matmul(x, w, "tp", recompute_gathered=recompute)

        def ref(x, w):
            return lax.all_gather(x, "tp", axis=0, tiled=True) @ w
    else:

        def f(x, w):
            return ops.matmul_reduce_scatter(x, w, "tp")

        def ref(x, w):
            return lax.psum_scatter(x @ w, "tp", scatter_dimension=0, tiled=True)

    def loss(fn):
        return lambda xs, w: jnp.sum(jnp.sin(jax.vmap(fn, in_axes=(0, None), axis_name="tp")(xs, w)))

    got = jax.grad(loss(f), argnums=(0, 1))(xs, w)
    want = jax.grad(loss(ref), argnums=(0, 1))(xs, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
