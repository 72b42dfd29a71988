"""CPU tier: activation layouts of the TP layers (NNX and linen): any number of leading dims, the
sequence on ``seq_axis``, and ``sequence_parallel=False`` (Megatron's TP without SP: replicated
activations, a local GEMM in the column layer, a GEMM and an all-reduce in the row layer), e.g. for
decode steps of one token.

The oracle is the plain unsharded float32 model; the sequence-parallel path is also checked bit for
bit against the primitives it is made of, written out with ``jax.shard_map`` by hand.
"""

from __future__ import annotations

import functools

import jax
import pytest
from _layer_helpers import (
    HIGHEST,
    IN,
    NORMAL,
    OUT,
    PLAIN,
    B,
    F,
    H,
    assert_close,
    data,
    linen_layer,
    linen_matches,
    nnx_fn,
    nnx_layer,
    nnx_matches,
    on_cpu,  # noqa: F401  (autouse fixture)
    param_specs,
    plain_mlp,
    pure,
    value_and_grads,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub.layers import core

# the builders with the oracle's precision and non-zero biases
make_nnx = functools.partial(nnx_layer, precision=HIGHEST, bias_init=NORMAL)
make_linen = functools.partial(linen_layer, precision=HIGHEST, bias_init=NORMAL)


def spec_of(a, mesh):
    """``a``'s sharding as a PartitionSpec over ``mesh``, trailing Nones dropped."""
    assert a.sharding.mesh.shape == mesh.shape
    spec = list(a.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


# ------------------------------------------------------------------------------------------------
# sequence_parallel=False: decode steps, odd lengths, replicated activations.

SHAPES = {"decode": (B, 1), "odd": (B, 7), "tokens": (5,)}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("kind", ["column", "row", "mlp"])
def test_nnx_no_sequence_parallel_matches_plain(cpu_mesh, kind, shape):
    mesh = cpu_mesh(2, dp=2)
    lead = SHAPES[shape]
    x, ct = data(*lead, IN[kind]), data(*lead, OUT[kind], seed=2)
    got = nnx_matches(mesh, lambda: make_nnx(kind, sequence_parallel=False), PLAIN[kind], x, ct)
    # column: features split over tp; row and MLP: replicated over tp (batch over dp when it divides)
    b = "dp" if len(lead) == 2 else None
    if kind == "column":
        assert spec_of(got, mesh) == P(b, None, "tp") if b else P(None, "tp")
    else:
        assert spec_of(got, mesh) == (P("dp") if b else P())


@pytest.mark.parametrize("kind", ["column", "row", "mlp"])
def test_linen_no_sequence_parallel_matches_plain(cpu_mesh, kind):
    model = make_linen(kind, sequence_parallel=False)
    x, ct = data(B, 3, IN[kind]), data(B, 3, OUT[kind], seed=2)
    linen_matches(cpu_mesh(4), model, PLAIN[kind], x, ct)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("kind", ["column", "row", "mlp"])
def test_nnx_no_sequence_parallel_inside_user_shard_map(cpu_mesh, kind, check_vma):
    """Local mode: activations whole on every device of the TP axis; the row layer's output too."""
    mesh = cpu_mesh(4)
    module = make_nnx(kind, sequence_parallel=False)  # built without a mesh: whole arrays
    params = pure(module)
    specs = param_specs(module)
    x_spec = P(None, None, "tp") if kind == "row" else P()
    out_spec = P(None, None, "tp") if kind == "column" else P()
    fn = jax.shard_map(
        nnx_fn(module), mesh=mesh, in_specs=(specs, x_spec), out_specs=out_spec, check_vma=check_vma
    )
    x, ct = data(B, 3, IN[kind]), data(B, 3, OUT[kind], seed=2)
    got, got_g = value_and_grads(fn, params, x, ct)
    want, want_g = value_and_grads(PLAIN[kind], params, x, ct)
    assert_close(got, want)
    assert_close(got_g, want_g)


def test_decode_after_a_sequence_parallel_prefill_shares_the_parameters(cpu_mesh):
    """One set of parameters, two layers: prefill with SP, then one-token steps without it."""
    x = data(B, 8, H)
    step = data(B, 1, H, seed=3)
    with jax.set_mesh(cpu_mesh(4)):
        prefill = make_nnx("mlp")
        decode = make_nnx("mlp", sequence_parallel=False)
        params = pure(prefill)
        y = jax.jit(nnx_fn(prefill))(params, x)
        y1 = jax.jit(nnx_fn(decode))(params, step)
    p = jax.device_get(params)
    assert_close(y, plain_mlp(p, x))
    assert_close(y1, plain_mlp(p, step))


def test_no_sequence_parallel_runs_no_gather_or_scatter(cpu_mesh):
    """The non-SP MLP's forward has one all-reduce (the row layer's) and neither an all-gather nor
    a reduce-scatter; the SP one the reverse."""
    x = data(B, 8, H)
    counts = {}
    with jax.set_mesh(cpu_mesh(4)):
        for sp in (True, False):
            mlp = make_nnx("mlp", sequence_parallel=sp, method="xla")
            text = jax.jit(nnx_fn(mlp)).lower(pure(mlp), x).compile().as_text()
            counts[sp] = {op: text.count(f" {op}(") for op in ("all-gather", "reduce-scatter", "all-reduce")}
    assert counts[False]["all-gather"] == 0 and counts[False]["reduce-scatter"] == 0, counts
    assert counts[False]["all-reduce"] >= 1, counts
    assert counts[True]["all-gather"] >= 1 and counts[True]["reduce-scatter"] >= 1, counts


# ------------------------------------------------------------------------------------------------
# seq_axis and leading dims (sequence parallel).

LAYOUTS = {  # name: (leading dims, seq_axis, position of the sequence in the leading dims)
    "bsh": ((B, 8), -2, 1),
    "sbh": ((8, B), 0, 0),
    "tokens": ((8,), -2, 0),
    "b-s-x-h": ((2, 8, 3), 1, 1),
    "b-x-s-h": ((2, 3, 8), -2, 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("kind", ["column", "row", "mlp"])
def test_nnx_seq_axis_and_leading_dims(cpu_mesh, kind, layout):
    mesh = cpu_mesh(4)
    lead, seq_axis, seq = LAYOUTS[layout]
    x, ct = data(*lead, IN[kind]), data(*lead, OUT[kind], seed=2)
    got = nnx_matches(mesh, lambda: make_nnx(kind, seq_axis=seq_axis), PLAIN[kind], x, ct)
    # the sequence, not another leading dim, is what comes out split over tp
    spec = [None] * (len(lead) + 1)
    if kind == "column":
        spec[-1] = "tp"
    else:
        spec[seq] = "tp"
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), got.ndim), got.sharding


def test_linen_seq_first_layout(cpu_mesh):
    mesh = cpu_mesh(2, dp=2)
    model = make_linen("mlp", seq_axis=0)
    x, ct = data(8, B, H), data(8, B, H, seed=2)  # [seq, batch, hidden]
    got = linen_matches(mesh, model, plain_mlp, x, ct)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("tp", "dp")), 3), got.sharding


@pytest.mark.parametrize("explicit_seq_axis", [False, True], ids=["default", "seq_axis=1"])
def test_sequence_parallel_path_is_the_primitives_bit_for_bit(cpu_mesh, explicit_seq_axis):
    """The default path is unchanged: exactly the all_gather_matmul / matmul_reduce_scatter of
    before, written here with a hand-made shard_map, bit for bit (forward and gradients)."""
    mesh = cpu_mesh(4)
    kw = dict(seq_axis=1) if explicit_seq_axis else {}
    x, ct = data(B, 8, H), data(B, 8, H, seed=2)
    with jax.set_mesh(mesh):
        mlp = make_nnx("mlp", **kw)
        params = pure(mlp)
        got, got_g = value_and_grads(nnx_fn(mlp), params, x, ct)

    def by_hand(p, x):
        h = core.layer_norm(x, p["norm"]["scale"], p["norm"]["bias"])  # outside the shard_maps
        up = jax.shard_map(
            lambda h, k, b: jax_ub.all_gather_matmul(h, k, "tp", gather_axis=1, precision=HIGHEST) + b,
            mesh=mesh,
            in_specs=(P(None, "tp"), P(None, "tp"), P("tp")),
            out_specs=P(None, None, "tp"),
        )
        down = jax.shard_map(
            lambda h, k, b: jax_ub.matmul_reduce_scatter(h, k, "tp", scatter_axis=1, precision=HIGHEST) + b,
            mesh=mesh,
            in_specs=(P(None, None, "tp"), P("tp", None), P(None)),
            out_specs=P(None, "tp"),
        )
        h = jax.nn.gelu(up(h, p["up"]["kernel"], p["up"]["bias"]))
        return down(h, p["down"]["kernel"], p["down"]["bias"])

    with jax.set_mesh(mesh):
        want, want_g = value_and_grads(by_hand, params, x, ct)
    assert_close(got, want, rtol=0, atol=0)
    assert_close(got_g, want_g, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Errors.


def test_error_sequence_not_divisible_suggests_sequence_parallel_false(cpu_mesh):
    hint = r"got 7\. .*build the layer with `sequence_parallel=False`"
    with jax.set_mesh(cpu_mesh(4)):
        col = make_nnx("column")
        with pytest.raises(
            ValueError,
            match=r"ColumnParallelDense: the sequence length .*axis 1\) "
            r"must be divisible .*'tp' \(4\); " + hint,
        ):
            col(data(B, 7, H))
        row = make_nnx("row")
        with pytest.raises(ValueError, match=r"RowParallelDense: the sequence length .*" + hint):
            row(data(B, 7, F))
        with pytest.raises(ValueError, match=r"ColumnParallelDense: the sequence length .*" + hint):
            make_linen("mlp").init(jax.random.key(0), data(B, 7, H))


def test_error_bad_seq_axis(cpu_mesh):
    with pytest.raises(ValueError, match=r"ColumnParallelDense: `seq_axis` must not be the last axis"):
        make_nnx("column", seq_axis=-1)
    with pytest.raises(ValueError, match=r"ParallelMLP: `seq_axis` must not be the last axis"):
        make_linen("mlp", seq_axis=-1).init(jax.random.key(0), data(B, 8, H))
    with pytest.raises(TypeError, match=r"RowParallelDense: `seq_axis` must be an int"):
        make_nnx("row", seq_axis=1.0)
    with pytest.raises(TypeError, match=r"ColumnParallelDense: `sequence_parallel` must be a bool"):
        make_nnx("column", sequence_parallel="no")
    with jax.set_mesh(cpu_mesh(2)):
        col = make_nnx("column", seq_axis=2)  # fine for 4-D x, not for 3-D: axis 2 is the features
        with pytest.raises(
            ValueError,
            match=r"ColumnParallelDense: x must be `\[\.\.\., in_features\] "
            r"with the sequence \(seq\) on axis 2`: at least 2 dims, "
            r"the sequence on axis seq_axis=2 .*got x.shape=\[4, 8, 16\]",
        ):
            col(data(B, 8, H))
        assert col(data(2, 3, 8, H)).shape == (2, 3, 8, F)
