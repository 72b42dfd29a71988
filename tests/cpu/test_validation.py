"""Every argument error of the primitives: its exception type, and a message that names the function,
what was expected and what was received."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ub import bulk, config, ops, resolve

F32 = jnp.float32


def arr(shape, dtype=F32):
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)


def call_in_mesh(mesh, fn, x, w, **kw):
    """Trace ``fn(x, w, **kw)`` inside shard_map with x, w replicated (only shapes matter here)."""
    axis_name = kw.pop("axis_name", "tp")

    def body(x, w):
        return jnp.sum(jax.tree.leaves(fn(x, w, axis_name, **kw))[0])

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return jax.eval_shape(jax.jit(f), x, w)


OPS = [
    pytest.param(ops.all_gather_matmul, "gather_axis", id="ag"),
    pytest.param(ops.matmul_reduce_scatter, "scatter_axis", id="rs"),
]


def expect(exc, thunk, *fragments):
    """``thunk()`` raises ``exc`` whose message contains every fragment."""
    with pytest.raises(exc) as info:
        thunk()
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_x_rank(fn, axis_kw, cpu_mesh):
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((5,)), arr((5, 4))),
        fn.__name__,
        "`x` must be at least 2-D",
        "got shape [5]",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_w_rank(fn, axis_kw, cpu_mesh):
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((2, 5, 4))),
        "`w` must be 2-D",
        "got shape [2, 5, 4]",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_], ids=["int32", "uint8", "bool"])
def test_unsupported_dtype(fn, axis_kw, dtype, cpu_mesh):
    expect(
        TypeError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)).astype(dtype), arr((5, 4)).astype(dtype)),
        "`x` must have dtype bfloat16, float16, float32",
        f"got {np.dtype(dtype).name}",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_dtype_mismatch(fn, axis_kw, cpu_mesh):
    expect(
        TypeError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5), jnp.bfloat16), arr((5, 4))),
        "same dtype",
        "x bfloat16",
        "w float32",
        "w.astype(x.dtype)",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_contracting_dim_mismatch(fn, axis_kw, cpu_mesh):
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((2, 4, 5)), arr((6, 4))),
        "x.shape[-1] == w.shape[0]",
        "got x [2, 4, 5], w [6, 4]",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
@pytest.mark.parametrize("axis", [3, -4, 2, -1], ids=["3", "-4", "contracting2", "contracting-1"])
def test_axis_out_of_range(fn, axis_kw, axis, cpu_mesh):
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((2, 4, 5)), arr((5, 4)), **{axis_kw: axis}),
        f"`{axis_kw}` must be an axis of x other than the last",
        "(-3, -2, 0, 1) for x of shape [2, 4, 5]",
        f"got {axis}",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
@pytest.mark.parametrize("axis", [1.0, "0", True], ids=["float", "str", "bool"])
def test_axis_type(fn, axis_kw, axis, cpu_mesh):
    expect(
        TypeError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), **{axis_kw: axis}),
        f"`{axis_kw}` must be an int",
        f"got {axis!r}",
    )


def test_scatter_dim_not_divisible(cpu_mesh):
    expect(
        ValueError,
        lambda: call_in_mesh(
            cpu_mesh(4), ops.matmul_reduce_scatter, arr((2, 6, 5)), arr((5, 3)), scatter_axis=1
        ),
        "x.shape[scatter_axis=1] must be divisible",
        "'tp' (4)",
        "got x [2, 6, 5]",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_unknown_axis_name(fn, axis_kw, cpu_mesh):
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), axis_name="model"),
        f"{fn.__name__}: axis_name 'model' is not bound",
        "inside jax.shard_map over a mesh with that axis",
        "axes bound here: ('tp',)",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
def test_outside_shard_map(fn, axis_kw, under_jit):
    def f(x, w):
        return fn(x, w, "tp")

    f = jax.jit(f) if under_jit else f
    expect(
        ValueError,
        lambda: f(arr((4, 5)), arr((5, 4))),
        f"{fn.__name__}: axis_name 'tp' is not bound: call it inside "
        "jax.shard_map over a mesh with that axis",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_unhashable_axis_name(fn, axis_kw, cpu_mesh):
    expect(
        TypeError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), axis_name=["tp"]),
        "`axis_name` must be a mesh axis name",
        "got ['tp']",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
@pytest.mark.parametrize("name", [0, ("tp", 1)], ids=["int", "tuple-with-int"])
def test_axis_name_not_a_name(fn, axis_kw, name, cpu_mesh):
    """An int would be taken by jax as a positional axis and fail deep inside it."""
    expect(
        TypeError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), axis_name=name),
        f"{fn.__name__}: `axis_name` must be a mesh axis name",
        f"got {name!r}",
    )


def test_explain_checks_its_arguments():
    from jax_ub.overlap import explain

    expect(
        ValueError, lambda: explain("xx", arr((8, 4)), arr((4, 3))), "explain: op must be 'ag'", "got 'xx'"
    )
    expect(
        ValueError,
        lambda: explain("ag", arr((8, 4)), arr((9, 3))),
        "explain('ag'): contracting dims",
        "got x [8, 4], w [9, 3]",
    )
    assert explain("rs", arr((8, 4)), arr((4, 3))).startswith("xla: ")  # no CUDA path here


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_unknown_method(fn, axis_kw, cpu_mesh):
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), method="fast"),
        f"{fn.__name__}: `method` must be None or one of",
        "'ring'",
        "got 'fast'",
    )
    with pytest.raises(ValueError) as info:  # "fast" is like no method: no guess
        call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), method="fast")
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("fn,axis_kw", OPS)
@pytest.mark.parametrize("typo, meant", [("rng", "ring"), ("all-peer", "all_peer"), ("pipline", "pipeline")])
def test_a_misspelt_method_gets_the_likely_one(fn, axis_kw, typo, meant, cpu_mesh):
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), method=typo),
        f"{fn.__name__}: `method` must be None or one of",
        f"got {typo!r} (did you mean {meant!r}?)",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
@pytest.mark.parametrize("method", ["ring", "all_peer", "pipeline", "chain", "nccl"])
def test_cuda_method_without_extension(fn, axis_kw, method, cpu_mesh):
    reason = ops._cuda_unavailable_reason()
    with config.override(disable=False):
        expect(
            ValueError,
            lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), method=method),
            f"{fn.__name__}: method={method!r} needs the CUDA overlap extension",
            reason,
        )
    # The same method from JAX_UB_METHOD: the error names the variable, not an argument never given.
    with config.override(disable=False, method=method):
        expect(
            ValueError,
            lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4))),
            f"{fn.__name__}: JAX_UB_METHOD={method} needs the CUDA overlap extension",
            "Unset JAX_UB_METHOD or set it to 'auto' or 'xla'",
        )


def test_return_gathered_type(cpu_mesh):
    expect(
        TypeError,
        lambda: call_in_mesh(
            cpu_mesh(2), ops.all_gather_matmul, arr((4, 5)), arr((5, 4)), return_gathered="yes"
        ),
        "`return_gathered` must be a bool",
        "got 'yes'",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_not_an_array(fn, axis_kw):
    expect(TypeError, lambda: fn([[1.0, 2.0]], arr((2, 3)), "tp"), "`x` must be a jax array", "got list")
    # A ShapeDtypeStruct has a shape and a dtype but no values: refused by name (jax's own error
    # about an invalid JAX type came later), with the way to trace shapes.
    expect(
        TypeError,
        lambda: fn(jax.ShapeDtypeStruct((4, 2), jnp.float32), arr((2, 3)), "tp"),
        f"{fn.__name__}: `x` must be a jax array; got a jax.ShapeDtypeStruct",
        "jax.eval_shape",
    )


def test_errors_come_before_any_kernel(monkeypatch, cpu_mesh):
    """A bad call never reaches an implementation."""

    def boom(*a, **k):
        raise AssertionError("kernel reached")

    monkeypatch.setitem(ops._IMPLS, ("ag", "xla"), boom)
    with pytest.raises(ValueError, match=re.escape("x.shape[-1] == w.shape[0]")):
        call_in_mesh(cpu_mesh(2), ops.all_gather_matmul, arr((4, 5)), arr((6, 4)))


def test_unregistered_method_names_what_exists(monkeypatch, cpu_mesh):
    monkeypatch.setattr(resolve, "method_name", lambda method, fn=None, **kw: "no_such_algo")
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), ops.all_gather_matmul, arr((4, 5)), arr((5, 4))),
        "all_gather_matmul: no implementation of method 'no_such_algo'",
        "'xla'",
    )


# ----------------------------------------------------------------------------------------------
# The bulk ops (jax_ub.bulk): the same validators, the same kind of messages.

BULK = [
    pytest.param(bulk.bulk_all_gather, id="bulk_ag"),
    pytest.param(bulk.bulk_reduce_scatter, id="bulk_rs"),
]


def call_bulk(mesh, fn, x, a, b, axis_name="tp", **kw):
    """Trace ``fn(x, a, b, axis_name, **kw)`` inside shard_map (a, b closed over, x replicated)."""

    def body(x):
        return jnp.sum(fn(x, a, b, axis_name, **kw)[1])

    f = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return jax.eval_shape(jax.jit(f), x)


@pytest.mark.parametrize("fn", BULK)
def test_bulk_unknown_axis_name(fn, cpu_mesh):
    expect(
        ValueError,
        lambda: call_bulk(cpu_mesh(2), fn, arr((4, 5)), arr((3, 5)), arr((5, 2)), axis_name="model"),
        f"{fn.__name__}: axis_name 'model' is not bound",
        "axes bound here: ('tp',)",
    )


@pytest.mark.parametrize("fn", BULK)
@pytest.mark.parametrize("axis", [0.5, "0", True], ids=["float", "str", "bool"])
def test_bulk_axis_type(fn, axis, cpu_mesh):
    expect(
        TypeError,
        lambda: call_bulk(cpu_mesh(2), fn, arr((4, 5)), arr((3, 5)), arr((5, 2)), axis=axis),
        f"{fn.__name__}: `axis` must be an int",
        f"got {axis!r}",
    )


@pytest.mark.parametrize("fn", BULK)
def test_bulk_axis_out_of_range(fn, cpu_mesh):
    expect(
        ValueError,
        lambda: call_bulk(cpu_mesh(2), fn, arr((4, 6)), arr((3, 5)), arr((5, 2)), axis=2),
        f"{fn.__name__}: `axis` must be an axis of x",
        "(-2, -1, 0, 1) for x of shape [4, 6]",
        "got 2",
    )


@pytest.mark.parametrize("fn", BULK)
@pytest.mark.parametrize("which", ["x", "a", "b"])
def test_bulk_not_an_array(fn, which, cpu_mesh):
    args = {"x": arr((4, 5)), "a": arr((3, 5)), "b": arr((5, 2))}
    args[which] = [[1.0]]
    expect(
        TypeError,
        lambda: fn(args["x"], args["a"], args["b"], "tp"),
        f"{fn.__name__}: `{which}` must be a jax array",
        "got list",
    )


@pytest.mark.parametrize("fn", BULK)
def test_bulk_dtype_mismatch(fn, cpu_mesh):
    expect(
        TypeError,
        lambda: call_bulk(cpu_mesh(2), fn, arr((4, 5)), arr((3, 5)), arr((5, 2), jnp.bfloat16)),
        f"{fn.__name__}: `a` and `b` must have the same dtype",
        "got a float32, b bfloat16",
    )


@pytest.mark.parametrize("fn", BULK)
@pytest.mark.parametrize("which", ["x", "a"])
def test_bulk_unsupported_dtype(fn, which, cpu_mesh):
    args = {"x": arr((4, 5)), "a": arr((3, 5)), "b": arr((5, 2))}
    args[which] = args[which].astype(jnp.int32)
    if which == "a":
        args["b"] = args["b"].astype(jnp.int32)
    expect(
        TypeError,
        lambda: call_bulk(cpu_mesh(2), fn, args["x"], args["a"], args["b"]),
        f"{fn.__name__}: `{which}` must have dtype bfloat16, float16, float32",
        "got int32",
    )


@pytest.mark.parametrize("fn", BULK)
def test_bulk_gemm_shapes(fn, cpu_mesh):
    expect(
        ValueError,
        lambda: call_bulk(cpu_mesh(2), fn, arr((4, 5)), arr((3, 5)), arr((4, 2))),
        f"{fn.__name__}: the GEMM operands must be a `[m, k]` and b `[k, n]`",
        "got a [3, 5], b [4, 2]",
    )


def test_bulk_reduce_scatter_not_divisible(cpu_mesh):
    expect(
        ValueError,
        lambda: call_bulk(cpu_mesh(4), bulk.bulk_reduce_scatter, arr((6, 5)), arr((3, 5)), arr((5, 2))),
        "bulk_reduce_scatter: x.shape[axis=0] must be divisible",
        "'tp' (4)",
        "got x [6, 5]",
    )


def test_bulk_valid_calls_still_run(cpu_mesh):
    """The last axis is a valid bulk axis (no contracting dim in x), negative axes too."""
    x, a, b = arr((4, 8)), arr((3, 5)), arr((5, 2))
    assert call_bulk(cpu_mesh(2), bulk.bulk_all_gather, x, a, b, axis=-1).shape == ()
    assert call_bulk(cpu_mesh(2), bulk.bulk_reduce_scatter, x, a, b, axis=1).shape == ()


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_method_names_in_any_case(fn, axis_kw, cpu_mesh):
    """method="XLA" is method="xla", as JAX_UB_METHOD=XLA is."""
    got = call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), method=" XLA")
    assert got.shape == ()


@pytest.mark.parametrize("fn,axis_kw", OPS)
@pytest.mark.parametrize(
    "precision,exc",
    [("bogus", ValueError), (3, TypeError), (("highest", "nope"), ValueError), (("highest", 3), TypeError)],
    ids=["str", "int", "pair", "pair-int"],
)
def test_bad_precision(fn, axis_kw, precision, exc, cpu_mesh):
    """A bad name is a ValueError, a value of the wrong type a TypeError."""
    expect(
        exc,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), precision=precision),
        f"{fn.__name__}: `precision` must be None, a jax.lax.Precision",
        f"got {precision!r}",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
@pytest.mark.parametrize("method", [3, b"ring", ("ring",)], ids=["int", "bytes", "tuple"])
def test_a_method_that_is_not_a_str_is_a_type_error(fn, axis_kw, method, cpu_mesh):
    expect(
        TypeError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), method=method),
        f"{fn.__name__}: `method` must be None or a str, one of",
        f"got {method!r} ({type(method).__name__})",
    )


@pytest.mark.parametrize(
    "precision",
    [
        None,
        "highest",
        jax.lax.Precision.HIGH,
        ("high", "default"),
        ["highest", "highest"],
        jax.lax.DotAlgorithmPreset.F32_F32_F32,
    ],
    ids=["none", "name", "enum", "pair", "list", "preset"],
)
def test_good_precisions_pass(precision, cpu_mesh):
    assert (
        call_in_mesh(cpu_mesh(2), ops.all_gather_matmul, arr((4, 5)), arr((5, 4)), precision=precision).shape
        == ()
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_repeated_axis_name(fn, axis_kw, cpu_mesh):
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((4, 5)), arr((5, 4)), axis_name=("tp", "tp")),
        f"{fn.__name__}: `axis_name` ('tp', 'tp') names an axis more than once",
    )


@pytest.mark.parametrize("fn,axis_kw", OPS)
def test_empty_collective_axis(fn, axis_kw, cpu_mesh):
    """XLA's verifier refuses a collective over an empty dimension: said in jax_ub's words."""
    expect(
        ValueError,
        lambda: call_in_mesh(cpu_mesh(2), fn, arr((0, 5)), arr((5, 4))),
        f"{fn.__name__}: x.shape[{axis_kw}=0] is 0 (x [0, 5])",
        "over an empty dimension",
    )


@pytest.mark.parametrize("fn", BULK)
def test_bulk_empty_collective_axis(fn, cpu_mesh):
    expect(
        ValueError,
        lambda: call_bulk(cpu_mesh(2), fn, arr((0, 5)), arr((3, 5)), arr((5, 2))),
        f"{fn.__name__}: x.shape[axis=0] is 0 (x [0, 5])",
    )


@pytest.mark.parametrize("fn", BULK)
def test_bulk_bad_method_and_precision(fn, cpu_mesh):
    args = (arr((4, 5)), arr((3, 5)), arr((5, 2)))
    expect(
        ValueError,
        lambda: call_bulk(cpu_mesh(2), fn, *args, method="fast"),
        f"{fn.__name__}: `method` must be None or one of",
        "got 'fast'",
    )
    expect(
        ValueError,
        lambda: call_bulk(cpu_mesh(2), fn, *args, precision="bogus"),
        f"{fn.__name__}: `precision` must be None",
        "got 'bogus'",
    )


def test_matmul_arguments():
    from jax_ub import gemm

    expect(TypeError, lambda: gemm.matmul([[1.0]], [[1.0]]), "matmul: `x` must be a jax array", "got list")
    # The method in any case, as the ops take theirs; a wrong name is still refused.
    assert gemm.matmul(arr((4, 5)), arr((5, 2)), method=" XLA").shape == (4, 2)
    expect(
        ValueError,
        lambda: gemm.matmul(arr((4, 5)), arr((5, 2)), method="cublas"),
        "matmul: method must be 'auto', 'xla' or 'cublaslt'; got 'cublas'",
    )
    expect(
        ValueError,
        lambda: gemm.matmul(arr((4, 5)), arr((6, 2))),
        "matmul: contracting dims differ: x is [4, 5] (k=5), w is [6, 2] (k=6)",
    )
    expect(
        ValueError,
        lambda: gemm.matmul(arr((4, 5)), arr((5, 2)), precision="bogus"),
        "matmul: `precision` must be None",
        "got 'bogus'",
    )


def test_checkpoint_policy_base_must_be_a_policy():
    expect(
        TypeError,
        lambda: ops.checkpoint_policy("dots_saveable"),
        "checkpoint_policy: `base` must be a jax.checkpoint policy",
        "got 'dots_saveable'",
    )
    assert callable(ops.checkpoint_policy(jax.checkpoint_policies.dots_saveable))


@pytest.mark.parametrize("layer", ["column", "row"])
def test_layer_names_itself_in_method_and_precision_errors(layer, cpu_mesh):
    from jax_ub.layers import core as _layers

    mesh = cpu_mesh(2)
    x, k = arr((2, 4, 8)), arr((8, 8))
    fn = _layers.column_parallel_dense if layer == "column" else _layers.row_parallel_dense
    where = "ColumnParallelDense" if layer == "column" else "RowParallelDense"
    kw = dict(out_features=8) if layer == "column" else {}
    expect(
        ValueError,
        lambda: fn(x, k, None, mesh=mesh, method="fast", **kw),
        f"{where}: `method` must be None or one of",
        "got 'fast'",
    )
    expect(
        ValueError,
        lambda: fn(x, k, None, mesh=mesh, precision="bogus", **kw),
        f"{where}: `precision` must be None",
        "got 'bogus'",
    )


def test_bare_collectives_check_their_arguments(cpu_mesh):
    from jax_ub import overlap

    mesh = cpu_mesh(2)

    def run(f, x):
        g = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
        return jax.eval_shape(jax.jit(g), x)

    expect(
        ValueError,
        lambda: run(lambda x: overlap.all_gather(x, "tp", axis=2), arr((4, 8))),
        "all_gather: `axis` must be an axis of x",
        "got 2",
    )
    expect(
        ValueError,
        lambda: run(lambda x: overlap.all_gather(x, "tp", method="fast"), arr((4, 8))),
        "all_gather: `method` must be one of",
        "got 'fast'",
    )
    expect(
        ValueError,
        lambda: run(lambda x: overlap.reduce_scatter(x, "tp", method="fast"), arr((4, 8))),
        "reduce_scatter: `method` must be one of",
        "got 'fast'",
    )
    expect(
        ValueError,
        lambda: run(lambda x: overlap.reduce_scatter(x, "tp"), arr((5, 8))),
        "reduce_scatter: x.shape[axis=0] must be divisible",
    )
    if not ops._cuda_status()[0]:  # no communicator without the CUDA path: it says why
        expect(
            ValueError,
            lambda: run(lambda x: overlap.all_gather(x, "tp"), arr((4, 8))),
            "all_gather: no jax_ub communicator for mesh axis 'tp': the CUDA path is unavailable here (",
        )
