"""Invalid input never crashes: hypothesis makes hundreds of invalid calls across the public ops,
the bulk ops, ``matmul``, the NNX and linen layers, ``initialize``, ``check_processes``, the
``JAX_UB_*`` settings and the command lines, and each must be refused by jax_ub's own checks with
a ValueError or TypeError (exit status 2 and ``error:`` for a command line) whose message shows
what was received and says what was expected: no crash, no hang, no raw jax/XLA error, no result.
The judging is :mod:`_refusals`; the last test checks how many refusals were checked.

The layers' constructor options, a norm's input, and the timeouts' upper bound have their own
cases (``test_layer_options_and_timeouts_are_checked``), one per kind of fault.

Deterministic (``derandomize=True``, no example database), and fast: shapes are tiny and the ops
are only traced (``jax.eval_shape``), never run.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import config, methods

sys.path.insert(0, str(Path(__file__).parent))
from _refusals import CALLS, Case, refuse, refuse_cli, shape_text, shown

pytest.importorskip("flax")
from flax import nnx

from jax_ub import linen as ublinen
from jax_ub import nn as ubnn

ROOT = Path(__file__).resolve().parents[2]
TP = 4
MESH = Mesh(np.array(jax.devices("cpu")[:TP]), ("tp",))
FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)
# float8 is refused without its scales (jax_ub.fp8): the message then asks for them.
NOT_FLOATS = (jnp.int8, jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64, jnp.float8_e4m3fn)
MIN_CALLS = 300
PROPERTY_TESTS = (
    "test_ops_refuse_invalid_calls",
    "test_bulk_ops_refuse_invalid_calls",
    "test_matmul_refuses_invalid_calls",
    "test_explain_and_checkpoint_policy_refuse_invalid_calls",
    "test_layers_refuse_invalid_arguments_and_inputs",
    "test_initialize_refuses_invalid_arguments",
    "test_shutdown_refuses_what_is_no_axis_name",
    "test_check_processes_refuses_invalid_arguments",
    "test_settings_variables_refuse_invalid_values",
    "test_settings_in_python_refuse_invalid_values",
    "test_bench_command_line_refuses_invalid_values",
    "test_doctor_command_line_refuses_unknown_arguments",
    "test_config_command_line_refuses_invalid_arguments",
    "test_merge_results_refuses_files_it_cannot_read",
)


def ran(test: str) -> None:
    """Notes that ``test`` ran (the count test checks that every property test did)."""
    CALLS[test] = CALLS.get(test, 0) + 1


def run_settings(n: int):
    return settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def arr(shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(len(shape)).standard_normal(shape), dtype)


def traced(thunk):
    """``thunk()`` traced inside shard_map over :data:`MESH` (axis ``"tp"``); its arrays are
    closed over, replicated. Only traced: the refusals come before any computation."""

    def body():
        return jnp.sum(jax.tree.leaves(thunk())[0]).astype(jnp.float32)

    f = jax.shard_map(body, mesh=MESH, in_specs=(), out_specs=P(), check_vma=False)
    return jax.eval_shape(jax.jit(f))


# Values of the wrong kind, by what they are not.
ASCII = string.ascii_letters + string.digits + "_-. /"
words = st.text(ASCII, min_size=1, max_size=10).filter(lambda s: s.strip() != "")
not_ints = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: not float(v).is_integer()),
    words,
    st.none(),
    st.lists(st.integers(0, 3), max_size=2),
    st.booleans(),
)
not_strs = st.one_of(st.integers(-5, 5), st.floats(-2, 2), st.none(), st.lists(words, max_size=2))
not_bools = st.one_of(st.integers(-3, 3), words, st.floats(-1, 1), st.lists(st.booleans(), max_size=1))
bad_numbers = st.one_of(
    st.floats(max_value=-1e-9),
    st.just(float("nan")),
    st.just(float("inf")),
    st.just(-float("inf")),
    st.integers(max_value=-1),
)


def method_typos():
    return words.filter(lambda s: s.strip().lower() not in methods.METHODS)


def precision_typos():
    names = {p.name.lower() for p in jax.lax.Precision} | {
        "fastest",
        "high",
        "highest",
        "default",
        "bfloat16",
    }
    return st.one_of(
        words.filter(lambda s: s.strip().lower() not in names),
        st.integers(-3, 7),
        st.tuples(st.just("highest"), st.just("highest"), st.just("highest")),
    )


# ------------------------------------------------------------------------------------------------
# all_gather_matmul / matmul_reduce_scatter

OPS = {
    "all_gather_matmul": (jax_ub.all_gather_matmul, "gather_axis"),
    "matmul_reduce_scatter": (jax_ub.matmul_reduce_scatter, "scatter_axis"),
}


@st.composite
def op_cases(draw) -> Case:
    name = draw(st.sampled_from(sorted(OPS)))
    fn, axis_kw = OPS[name]
    m, k, n = TP * draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(FLOATS))
    xs, ws, xd, wd, kw, axis_name = (m, k), (k, n), dtype, dtype, {}, "tp"
    fault = draw(
        st.sampled_from(
            [
                "x_rank",
                "w_rank",
                "dtype",
                "dtype_mismatch",
                "contracting",
                "axis_range",
                "axis_type",
                "unbound_name",
                "name_type",
                "repeated_name",
                "method",
                "method_type",
                "precision",
                "flag",
                "not_array",
                "empty",
                "not_divisible",
            ]
        )
    )
    if fault == "not_divisible" and name != "matmul_reduce_scatter":
        fault = "x_rank"
    if fault == "flag" and name != "all_gather_matmul":
        fault = "w_rank"
    received, expected = None, None
    x_obj = w_obj = None
    if fault == "x_rank":
        xs = tuple(draw(st.lists(st.integers(1, 4), max_size=1)))
        received, expected = (f"shape {shape_text(xs)}",), ("2-D",)
    elif fault == "w_rank":
        ws = tuple(draw(st.lists(st.integers(1, 4), min_size=3, max_size=4))) if draw(st.booleans()) else (k,)
        if len(ws) > 2:
            ws = (k, *ws[1:])
        received, expected = (f"shape {shape_text(ws)}",), ("2-D",)
    elif fault == "dtype":
        xd = wd = draw(st.sampled_from(NOT_FLOATS))
        received, expected = (np.dtype(xd).name,), ("dtype", "scales")
    elif fault == "dtype_mismatch":
        wd = draw(st.sampled_from([d for d in FLOATS if d != dtype]))
        received, expected = (np.dtype(wd).name,), ("same dtype",)
    elif fault == "contracting":
        ws = (k + draw(st.integers(1, 3)), n)
        received, expected = (shape_text(ws),), ("contracting",)
    elif fault == "axis_range":
        axis = draw(st.one_of(st.integers(1, 40), st.integers(-40, -2)))
        kw[axis_kw] = axis
        received, expected = (f"got {axis}",), ("axis of x",)
    elif fault == "axis_type":
        axis = draw(not_ints)
        kw[axis_kw] = axis
        received, expected = shown(axis), ("int",)
    elif fault == "unbound_name":
        axis_name = draw(words.filter(lambda s: s != "tp"))
        received, expected = (repr(axis_name),), ("shard_map",)
    elif fault == "name_type":
        axis_name = draw(
            st.one_of(
                st.integers(-2, 9), st.none(), st.just(()), st.tuples(st.integers(0, 3)), st.floats(0, 1)
            )
        )
        received, expected = (repr(axis_name),), ("axis name",)
    elif fault == "repeated_name":
        axis_name = ("tp", "tp")
        received, expected = (repr(axis_name),), ("more than once",)
    elif fault == "method":
        kw["method"] = draw(method_typos())
        received, expected = (repr(kw["method"]),), ("one of",)
    elif fault == "method_type":
        kw["method"] = draw(not_strs.filter(lambda v: v is not None))
        received, expected = (repr(kw["method"]),), ("str",)
    elif fault == "precision":
        kw["precision"] = draw(precision_typos())
        received, expected = (repr(kw["precision"]),), ("precision",)
    elif fault == "flag":
        flag = draw(st.sampled_from(["return_gathered", "recompute_gathered"]))
        kw[flag] = draw(not_bools.filter(lambda v: v is not None))
        received, expected = (repr(kw[flag]),), ("bool",)
    elif fault == "not_array":
        bad = draw(st.one_of(st.lists(st.floats(-1, 1), min_size=1, max_size=3), st.floats(-1, 1), words))
        if draw(st.booleans()):
            x_obj, which = bad, "x"
        else:
            w_obj, which = bad, "w"
        received, expected = (type(bad).__name__,), (f"`{which}` must be a jax array",)
    elif fault == "empty":
        xs = (0, k)
        received, expected = (shape_text(xs),), ("empty",)
    elif fault == "not_divisible":
        xs = (TP * draw(st.integers(0, 3)) + draw(st.integers(1, TP - 1)), k)
        received, expected = (shape_text(xs),), ("divisible",)
    x = arr(xs, xd) if x_obj is None else x_obj
    w = arr(ws, wd) if w_obj is None else w_obj
    return Case(
        f"{name}(x {xs} {np.dtype(xd).name}, w {ws} {np.dtype(wd).name}, {axis_name!r}, {kw}) [{fault}]",
        lambda: traced(lambda: fn(x, w, axis_name, **kw)),
        received,
        expected,
    )


@run_settings(90)
@given(case=op_cases())
def test_ops_refuse_invalid_calls(case):
    ran("test_ops_refuse_invalid_calls")
    err = refuse(case)
    # Every message names the public function it came from.
    assert case.what.split("(")[0] in str(err), str(err)


# ------------------------------------------------------------------------------------------------
# bulk_all_gather / bulk_reduce_scatter and matmul

BULK = {"bulk_all_gather": jax_ub.bulk_all_gather, "bulk_reduce_scatter": jax_ub.bulk_reduce_scatter}


@st.composite
def bulk_cases(draw) -> Case:
    name = draw(st.sampled_from(sorted(BULK)))
    fn = BULK[name]
    dtype = draw(st.sampled_from(FLOATS))
    xs, as_, bs = (TP * 2, 3), (4, 5), (5, 6)
    xd = ad = bd = dtype
    kw, axis_name, objs = {}, "tp", {}
    fault = draw(
        st.sampled_from(
            [
                "gemm_shapes",
                "gemm_dtypes",
                "dtype",
                "axis_range",
                "axis_type",
                "unbound_name",
                "name_type",
                "method",
                "method_type",
                "precision",
                "not_array",
                "empty",
                "not_divisible",
            ]
        )
    )
    if fault == "not_divisible" and name != "bulk_reduce_scatter":
        fault = "gemm_shapes"
    if fault == "gemm_shapes":
        if draw(st.booleans()):
            bs = (as_[1] + draw(st.integers(1, 3)), 6)
        else:
            as_ = tuple(draw(st.lists(st.integers(1, 4), min_size=3, max_size=3)))
        received, expected = (shape_text(as_), shape_text(bs)), ("[m, k]",)
    elif fault == "gemm_dtypes":
        bd = draw(st.sampled_from([d for d in FLOATS if d != dtype]))
        received, expected = (np.dtype(bd).name,), ("same dtype",)
    elif fault == "dtype":
        bad = draw(st.sampled_from(NOT_FLOATS))
        if draw(st.booleans()):
            xd = bad
        else:
            ad = bd = bad
        received, expected = (np.dtype(bad).name,), ("dtype", "scales")
    elif fault == "axis_range":
        kw["axis"] = draw(st.one_of(st.integers(2, 30), st.integers(-30, -3)))
        received, expected = (f"got {kw['axis']}",), ("axis of x",)
    elif fault == "axis_type":
        kw["axis"] = draw(not_ints)
        received, expected = shown(kw["axis"]), ("int",)
    elif fault == "unbound_name":
        axis_name = draw(words.filter(lambda s: s != "tp"))
        received, expected = (repr(axis_name),), ("shard_map",)
    elif fault == "name_type":
        axis_name = draw(st.one_of(st.integers(-2, 9), st.none(), st.just(()), st.floats(0, 1)))
        received, expected = (repr(axis_name),), ("axis name",)
    elif fault == "method":
        kw["method"] = draw(method_typos())
        received, expected = (repr(kw["method"]),), ("one of",)
    elif fault == "method_type":
        kw["method"] = draw(not_strs.filter(lambda v: v is not None))
        received, expected = (repr(kw["method"]),), ("str",)
    elif fault == "precision":
        kw["precision"] = draw(precision_typos())
        received, expected = (repr(kw["precision"]),), ("precision",)
    elif fault == "not_array":
        which = draw(st.sampled_from("xab"))
        objs[which] = draw(st.one_of(st.lists(st.floats(-1, 1), min_size=1, max_size=2), st.floats(-1, 1)))
        received, expected = (type(objs[which]).__name__,), (f"`{which}` must be a jax array",)
    elif fault == "empty":
        xs = (0, 3)
        received, expected = (shape_text(xs),), ("empty",)
    else:  # not_divisible
        xs = (TP * draw(st.integers(0, 2)) + draw(st.integers(1, TP - 1)), 3)
        received, expected = (shape_text(xs),), ("divisible",)
    x = objs.get("x", arr(xs, xd))
    a = objs.get("a", arr(as_, ad))
    b = objs.get("b", arr(bs, bd))
    return Case(
        f"{name}(x {xs}, a {as_}, b {bs}, {axis_name!r}, {kw}) [{fault}]",
        lambda: traced(lambda: fn(x, a, b, axis_name, **kw)),
        received,
        expected,
    )


@run_settings(50)
@given(case=bulk_cases())
def test_bulk_ops_refuse_invalid_calls(case):
    ran("test_bulk_ops_refuse_invalid_calls")
    err = refuse(case)
    assert case.what.split("(")[0] in str(err), str(err)


@st.composite
def matmul_cases(draw) -> Case:
    dtype = draw(st.sampled_from(FLOATS))
    xs, ws, xd, wd, kw, objs = (3, 4), (4, 5), dtype, dtype, {}, {}
    fault = draw(
        st.sampled_from(
            ["x_rank", "w_rank", "dtype", "mismatch", "contracting", "precision", "method", "not_array"]
        )
    )
    if fault == "x_rank":
        xs = tuple(draw(st.lists(st.integers(1, 4), max_size=1)))
        received, expected = (shape_text(xs),), ("2-D",)
    elif fault == "w_rank":
        ws = (4, *draw(st.lists(st.integers(1, 3), min_size=2, max_size=2))) if draw(st.booleans()) else (4,)
        received, expected = (shape_text(ws),), ("2-D",)
    elif fault == "dtype":
        xd = wd = draw(st.sampled_from(NOT_FLOATS))
        received, expected = (np.dtype(xd).name,), ("dtype must be",)
    elif fault == "mismatch":
        wd = draw(st.sampled_from([d for d in FLOATS if d != dtype]))
        received, expected = (np.dtype(wd).name,), ("share a dtype",)
    elif fault == "contracting":
        ws = (4 + draw(st.integers(1, 5)), 5)
        received, expected = (shape_text(ws),), ("contracting",)
    elif fault == "precision":
        kw["precision"] = draw(precision_typos())
        received, expected = (repr(kw["precision"]),), ("precision",)
    elif fault == "method":
        kw["method"] = draw(words.filter(lambda s: s.strip().lower() not in ("auto", "xla", "cublaslt")))
        received, expected = (repr(kw["method"]),), ("method must be",)
    else:
        which = draw(st.sampled_from("xw"))
        objs[which] = draw(
            st.one_of(st.lists(st.floats(-1, 1), min_size=1, max_size=2), st.floats(-1, 1), words)
        )
        received, expected = (type(objs[which]).__name__,), ("must be a jax array",)
    x, w = objs.get("x", arr(xs, xd)), objs.get("w", arr(ws, wd))
    return Case(
        f"matmul(x {xs}, w {ws}, {kw}) [{fault}]", lambda: jax_ub.matmul(x, w, **kw), received, expected
    )


@run_settings(30)
@given(case=matmul_cases())
def test_matmul_refuses_invalid_calls(case):
    ran("test_matmul_refuses_invalid_calls")
    refuse(case)


@st.composite
def explain_cases(draw) -> Case:
    """jax_ub.explain checks what the op would (on shapes: jax.ShapeDtypeStruct), and
    jax_ub.checkpoint_policy its base policy."""
    op = draw(st.sampled_from(["ag", "rs"]))
    xs, ws, xd, wd, kw = (8, 4), (4, 6), jnp.float32, jnp.float32, {}
    fault = draw(
        st.sampled_from(["op", "x_rank", "dtype", "contracting", "axis", "method", "name_type", "policy"])
    )
    if fault == "op":
        op = draw(st.one_of(words.filter(lambda s: s not in ("ag", "rs")), st.integers(), st.none()))
        received, expected = (repr(op),), ("op must be",)
    elif fault == "x_rank":
        xs = tuple(draw(st.lists(st.integers(1, 4), max_size=1)))
        received, expected = (shape_text(xs),), ("2-D",)
    elif fault == "dtype":
        xd = wd = draw(st.sampled_from(NOT_FLOATS))
        received, expected = (np.dtype(xd).name,), ("dtype", "scales")
    elif fault == "contracting":
        ws = (4 + draw(st.integers(1, 4)), 6)
        received, expected = (shape_text(ws),), ("contracting",)
    elif fault == "axis":
        kw["axis"] = draw(st.one_of(st.integers(1, 20), st.integers(-20, -2)))
        received, expected = (f"got {kw['axis']}",), ("axis of x",)
    elif fault == "method":
        kw["method"] = draw(method_typos())
        received, expected = (repr(kw["method"]),), ("one of",)
    elif fault == "name_type":
        kw["axis_name"] = draw(st.one_of(st.integers(), st.none(), st.just(())))
        received, expected = (repr(kw["axis_name"]),), ("axis name",)
    else:
        base = draw(st.one_of(st.integers(), words, st.lists(st.integers(), max_size=1)))
        return Case(
            f"checkpoint_policy({base!r})", lambda: jax_ub.checkpoint_policy(base), (repr(base),), ("policy",)
        )
    x, w = jax.ShapeDtypeStruct(xs, xd), jax.ShapeDtypeStruct(ws, wd)
    return Case(
        f"explain({op!r}, x {xs}, w {ws}, {kw}) [{fault}]",
        lambda: jax_ub.explain(op, x, w, **kw),
        received,
        expected,
    )


@run_settings(30)
@given(case=explain_cases())
def test_explain_and_checkpoint_policy_refuse_invalid_calls(case):
    ran("test_explain_and_checkpoint_policy_refuse_invalid_calls")
    refuse(case)


# ------------------------------------------------------------------------------------------------
# The layers, NNX and linen (their options one by one: the cases of
# test_layer_options_and_timeouts_are_checked below).

SEQ, HIDDEN = 2 * TP, 8


@st.composite
def layer_cases(draw) -> Case:
    flavour = draw(st.sampled_from(["nnx", "linen"]))
    layer = draw(st.sampled_from(["ColumnParallelDense", "RowParallelDense", "ParallelMLP"]))
    fault = draw(
        st.sampled_from(
            [
                "features_not_divisible",
                "seq_axis_last",
                "seq_axis_type",
                "sequence_parallel_type",
                "axis_name_type",
                "axis_name_missing",
                "method",
                "precision",
                "x_features",
                "x_rank",
                "x_seq_not_divisible",
                "norm",
            ]
        )
    )
    if fault == "norm" and layer != "ParallelMLP":
        fault = "method"
    kw: dict = {}
    x_shape = (2, SEQ, HIDDEN)
    features = HIDDEN  # ColumnParallelDense's out, RowParallelDense's in, ParallelMLP's ffn
    if fault == "features_not_divisible":
        features = TP * draw(st.integers(0, 3)) + draw(st.integers(1, TP - 1))
        received, expected = (f"got {features}",), ("divisible",)
    elif fault == "seq_axis_last":
        kw["seq_axis"] = -1
        received, expected = ("-1",), ("last axis",)
    elif fault == "seq_axis_type":
        # not a list: linen turns a list attribute into a tuple before the layer sees it
        kw["seq_axis"] = draw(not_ints.filter(lambda v: v is not None and not isinstance(v, list)))
        received, expected = (repr(kw["seq_axis"]),), ("int",)
    elif fault == "sequence_parallel_type":
        kw["sequence_parallel"] = draw(not_bools.filter(lambda v: not isinstance(v, list)))
        received, expected = (repr(kw["sequence_parallel"]),), ("bool",)
    elif fault == "axis_name_type":
        kw["axis_name"] = draw(st.one_of(st.integers(-2, 9), st.none(), st.floats(0, 1)))
        received, expected = (repr(kw["axis_name"]),), ("str",)
    elif fault == "axis_name_missing":
        kw["axis_name"] = draw(words.filter(lambda s: s != "tp"))
        received, expected = (repr(kw["axis_name"]),), ("not an axis of the mesh",)
    elif fault == "method":
        kw["method"] = draw(method_typos())
        received, expected = (repr(kw["method"]),), ("one of",)
    elif fault == "precision":
        kw["precision"] = draw(precision_typos())
        received, expected = (repr(kw["precision"]),), ("precision",)
    elif fault == "x_features":
        x_shape = (2, SEQ, HIDDEN + draw(st.sampled_from([-4, 4, 8])))
        received, expected = (shape_text(x_shape),), ("features",)
    elif fault == "x_rank":
        x_shape = (HIDDEN,)
        received, expected = (shape_text(x_shape),), ("at least 2",)
    elif fault == "x_seq_not_divisible":
        x_shape = (2, TP * draw(st.integers(0, 2)) + draw(st.integers(1, TP - 1)), HIDDEN)
        received, expected = (shape_text(x_shape),), ("divisible",)
    else:  # norm
        kw["norm"] = draw(
            st.one_of(words.filter(lambda s: s not in ("layernorm", "rmsnorm")), st.integers(0, 3))
        )
        received, expected = (repr(kw["norm"]),), ("'layernorm', 'rmsnorm' or None",)
    if fault == "x_features" and layer == "RowParallelDense":
        x_shape = (2, SEQ, features + 4)  # its in_features; features % TP stays 0
    if fault == "x_features" and flavour == "linen" and layer == "RowParallelDense":
        fault, x_shape = "x_rank", (HIDDEN,)  # linen takes in_features from x
        received, expected = (shape_text(x_shape),), ("at least 2",)
    x = arr(x_shape)
    what = f"{flavour}.{layer}({features}, {kw})(x {x_shape}) [{fault}]"

    def call():
        with jax.set_mesh(MESH):
            if flavour == "nnx":
                cls = getattr(ubnn, layer)
                if layer == "ColumnParallelDense":
                    m = cls(HIDDEN, features, rngs=nnx.Rngs(0), **kw)
                elif layer == "RowParallelDense":
                    m = cls(features, HIDDEN, rngs=nnx.Rngs(0), **kw)
                else:
                    m = cls(HIDDEN, features, rngs=nnx.Rngs(0), **kw)
                return m(x)
            cls = getattr(ublinen, layer)
            if layer == "ParallelMLP":
                m = cls(ffn_features=features, **kw)
            elif layer == "ColumnParallelDense":
                m = cls(features, **kw)
            else:
                m = cls(HIDDEN, **kw)
                if fault == "features_not_divisible":
                    return m.init(jax.random.key(0), arr((2, SEQ, features)))
            return m.init(jax.random.key(0), x)

    return Case(what, call, received, expected)


@run_settings(60)
@given(case=layer_cases())
def test_layers_refuse_invalid_arguments_and_inputs(case):
    ran("test_layers_refuse_invalid_arguments_and_inputs")
    refuse(case)


# ------------------------------------------------------------------------------------------------
# initialize, shutdown, check_processes


@st.composite
def initialize_cases(draw) -> Case:
    fault = draw(
        st.sampled_from(
            [
                "mesh",
                "axis_missing",
                "axis_type",
                "timeout",
                "timeout_type",
                "buffer",
                "buffer_type",
                "bootstrap",
                "transport",
            ]
        )
    )
    args: list = [MESH, "tp"]
    kw: dict = {}
    if fault == "mesh":
        args[0] = draw(
            st.one_of(st.none(), st.integers(), words, st.just(jax.devices("cpu")[:2]), st.just({"tp": 4}))
        )
        received, expected = (type(args[0]).__name__,), ("jax.sharding.Mesh",)
    elif fault == "axis_missing":
        args[1] = draw(words.filter(lambda s: s != "tp"))
        received, expected = (repr(args[1]),), ("not an axis of the mesh",)
    elif fault == "axis_type":
        args[1] = draw(
            st.one_of(st.integers(), st.none(), st.just(("tp", "tp")), st.lists(words, max_size=2))
        )
        received, expected = (repr(args[1]),), ("str",)
    elif fault == "timeout":
        kw["timeout_s"] = draw(st.one_of(bad_numbers, st.floats(0, 9e-4)))
        received, expected = shown(float(kw["timeout_s"])), ("timeout_s must be",)
    elif fault == "timeout_type":
        kw["timeout_s"] = draw(st.one_of(words, st.booleans(), st.lists(st.integers(), max_size=1)))
        received, expected = (repr(kw["timeout_s"]),), ("number",)
    elif fault == "buffer":
        kw["buffer_mib"] = draw(
            st.one_of(st.integers(max_value=-1), st.integers(min_value=config.MAX_MIB + 1))
        )
        received, expected = (repr(kw["buffer_mib"]),), ("buffer_mib must be",)
    elif fault == "buffer_type":
        kw["buffer_mib"] = draw(
            st.one_of(st.floats().filter(lambda v: not float(v).is_integer()), words, st.booleans())
        )
        received, expected = (repr(kw["buffer_mib"]),), ("int",)
    else:
        kw[fault] = draw(
            st.one_of(
                words.filter(lambda s: s not in ("auto", "kv", "nccl", "ipc")),
                st.integers(),
                st.none().map(lambda _: ["ipc"]),
            )
        )
        received, expected = (repr(kw[fault]),), ("must be one of",)
    return Case(
        f"initialize({args}, {kw}) [{fault}]", lambda: jax_ub.initialize(*args, **kw), received, expected
    )


@run_settings(45)
@given(case=initialize_cases())
def test_initialize_refuses_invalid_arguments(case):
    ran("test_initialize_refuses_invalid_arguments")
    refuse(case)


@run_settings(10)
@given(
    axis=st.one_of(st.integers(), st.floats(), st.lists(words, min_size=1, max_size=2), st.just(("tp", "dp")))
)
def test_shutdown_refuses_what_is_no_axis_name(axis):
    ran("test_shutdown_refuses_what_is_no_axis_name")
    refuse(Case(f"shutdown({axis!r})", lambda: jax_ub.shutdown(axis), (repr(axis),), ("axis name",)))


@st.composite
def check_processes_cases(draw) -> Case:
    fault = draw(st.sampled_from(["fields", "keys", "problem", "blank", "timeout"]))
    kw: dict = {}
    args: list = []
    if fault == "fields":
        args = [draw(st.one_of(st.lists(st.integers(), max_size=2), words, st.integers(), st.tuples(words)))]
        received, expected = (type(args[0]).__name__,), ("mapping",)
    elif fault == "keys":
        key = draw(st.one_of(st.integers(), st.tuples(st.integers(0, 3)), st.none(), st.floats(0, 1)))
        args = [{key: 1, "ok": 2}]
        received, expected = (repr(key),), ("must be str",)
    elif fault == "problem":
        kw["problem"] = draw(
            st.one_of(st.integers(), st.lists(words, max_size=1), st.binary(min_size=1, max_size=3))
        )
        received, expected = (type(kw["problem"]).__name__,), ("None or a str",)
    elif fault == "blank":
        kw["problem"] = draw(st.text(" \t\n", max_size=3))
        received, expected = ("empty string",), ("must say why",)
    else:
        kw["timeout_s"] = draw(st.one_of(bad_numbers, st.just(0), st.just(0.0), words, st.booleans()))
        received, expected = (repr(kw["timeout_s"]),), ("timeout_s must be",)
    return Case(
        f"check_processes({args}, {kw}) [{fault}]",
        lambda: jax_ub.check_processes(*args, **kw),
        received,
        expected,
    )


@run_settings(40)
@given(case=check_processes_cases())
def test_check_processes_refuses_invalid_arguments(case):
    ran("test_check_processes_refuses_invalid_arguments")
    refuse(case)


# ------------------------------------------------------------------------------------------------
# JAX_UB_* settings: variables, Config(...) and config.override(...)


def bad_setting_text(kind) -> st.SearchStrategy[str]:
    """Text that ``kind`` (a setting's values) refuses."""
    name = type(kind).__name__
    if name == "_Bool":
        ok = {"1", "true", "yes", "on", "0", "false", "no", "off"}
        return words.filter(lambda s: s.strip().lower() not in ok)
    if name in ("_Choice", "_Level"):
        ok = {c.lower() for c in getattr(kind, "choices", config.LOG_LEVELS)}
        return words.filter(lambda s: s.strip().lower() not in ok)
    if name == "_Int":
        return st.one_of(
            st.integers(max_value=-1).map(str),
            st.integers(min_value=kind.maximum + 1).map(str),
            st.floats(0.5, 100).filter(lambda v: not v.is_integer()).map(repr),
            st.sampled_from(["nan", "inf", "1e3", "0x10", "ten", "3 4"]),
        )
    if name == "_Seconds":
        return st.one_of(
            st.floats(max_value=9e-4, allow_nan=False).map(repr),
            st.floats(min_value=config.MAX_TIMEOUT_S * 1.01, allow_infinity=False).map(repr),
            st.sampled_from(["nan", "inf", "-inf", "5s", "two", "1e400"]),
        )
    assert name == "_Path", name
    return words.map(lambda s: s + "\0x")


@st.composite
def env_cases(draw) -> Case:
    chosen = draw(
        st.lists(st.sampled_from(config.settings()), min_size=1, max_size=3, unique_by=lambda s: s.env)
    )
    env = {}
    for s in chosen:
        var = s.deprecated_env if s.deprecated_env and draw(st.booleans()) else s.env
        env[var] = draw(bad_setting_text(s.kind))
    case = Case(
        f"Config.from_env({env!r})",
        lambda: config.Config.from_env(env),
        tuple(repr(v) for v in env.values()),
        ("must be",),
    )
    return case, env


@run_settings(60)
@given(case_env=env_cases())
def test_settings_variables_refuse_invalid_values(case_env):
    case, env = case_env
    ran("test_settings_variables_refuse_invalid_values")
    err = refuse(case)
    for var, value in env.items():  # one error names every invalid variable and its value
        assert f"{var} must be" in str(err) and repr(value) in str(err), (var, str(err))


FIELDS = {s.field: s for s in config.settings()}


@st.composite
def python_setting_cases(draw) -> Case:
    fault = draw(st.sampled_from(["type", "value", "unknown"]))
    via = draw(st.sampled_from(["Config", "override"]))
    if fault == "unknown":
        key = draw(st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True).filter(lambda k: k not in FIELDS))
        return Case(
            f"config.override({key}=1)",
            lambda: config.override(**{key: 1}).__enter__(),
            (repr(key),),
            ("not a jax_ub setting",),
        )
    s = draw(st.sampled_from(config.settings()))
    field_type = type(s.default)
    if fault == "type":
        if field_type is bool:
            value = draw(not_bools)
        elif field_type in (int, float):
            value = draw(st.one_of(words, st.none(), st.booleans(), st.lists(st.integers(), max_size=1)))
        else:
            value = draw(st.one_of(st.integers(), st.none(), st.lists(words, max_size=1)))
        expected = (field_type.__name__ if field_type is not float else "number",)
    else:
        kind = type(s.kind).__name__
        if kind == "_Bool":
            value = draw(not_bools)
            expected = ("bool",)
        elif kind == "_Int":
            value = draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=s.kind.maximum + 1)))
            expected = ("must be in",)
        elif kind == "_Seconds":
            value = draw(st.one_of(bad_numbers, st.floats(min_value=config.MAX_TIMEOUT_S * 1.01)))
            expected = ("must be",)
        elif kind == "_Path":
            value = draw(words) + "\0"
            expected = ("path",)
        else:
            value = draw(bad_setting_text(s.kind))
            expected = ("must be one of",)
    received = (repr(value),) if not isinstance(value, float) else shown(value)
    if via == "Config":
        return Case(
            f"Config({s.field}={value!r})", lambda: config.Config(**{s.field: value}), received, expected
        )
    return Case(
        f"config.override({s.field}={value!r})",
        lambda: config.override(**{s.field: value}).__enter__(),
        received,
        expected,
    )


@run_settings(50)
@given(case=python_setting_cases())
def test_settings_in_python_refuse_invalid_values(case):
    ran("test_settings_in_python_refuse_invalid_values")
    before = config.get()
    refuse(case)
    assert config.get() is before  # a refused override changes nothing


# ------------------------------------------------------------------------------------------------
# Command lines, called in-process: python -m jax_ub.bench / .doctor / .config


def bench_main(argv):
    from jax_ub.bench.__main__ import main

    return main(argv)


def doctor_main(argv):
    from jax_ub.doctor import main

    return main(argv)


INT_OPTIONS = {"--iters": 1, "--reps": 1, "--warmup": 0, "--chain": 1}


@st.composite
def bench_argvs(draw):
    """(argv, value): a bench command line with one invalid value."""
    op = draw(st.sampled_from(["ag", "rs", "bulk", "mlp", "summary"]))
    fault = draw(
        st.sampled_from(["count", "settle", "shape", "dtype", "machine", "choice", "size", "summary"])
    )
    if op == "summary":
        fault = "summary"
    elif fault == "summary":
        fault = "count"
    elif op == "mlp" and fault in ("shape", "count"):
        fault = "size"
    elif op != "mlp" and fault == "size":
        fault = "shape"
    big = st.integers(min_value=2**31).map(str)
    argv = [op]
    if fault == "count":
        opt = draw(st.sampled_from(sorted(INT_OPTIONS)))
        low = INT_OPTIONS[opt]
        value = draw(
            st.one_of(
                st.integers(max_value=low - 1).map(str), big, st.sampled_from(["1.5", "nan", "inf", "x"])
            )
        )
        if opt == "--chain" and op == "mlp":
            opt = "--iters"
        argv += [f"{opt}={value}"]
        expected = ("must be", "expected")
    elif fault == "settle":
        value = draw(
            st.one_of(st.floats(max_value=-1e-6).map(repr), st.sampled_from(["nan", "inf", "1e400", "soon"]))
        )
        argv += [f"--settle-ms={value}"]
        expected = ("must be", "expected")
    elif fault == "shape":
        value = draw(
            st.one_of(
                st.lists(st.integers(1, 64).map(str), min_size=1, max_size=4)
                .filter(lambda v: len(v) != 3)
                .map(",".join),
                st.tuples(st.integers(max_value=0), st.integers(1, 8), st.integers(1, 8)).map(
                    lambda t: ",".join(map(str, t))
                ),
                st.tuples(st.integers(1, 8), big, st.integers(1, 8)).map(",".join),
                st.just("64,64,abc"),
            )
        )
        argv += [f"--shapes={value}"]
        expected = ("M,K,N",)
    elif fault == "dtype":
        value = draw(
            words.filter(lambda s: s not in ("bfloat16", "float16", "float32") and not s.startswith("-"))
        )
        argv += [f"--dtype={value}"]
        expected = ("invalid choice",)
    elif fault == "machine":
        value = draw(st.sampled_from(["../up", "a/b", ".hidden", "_x", "a b", "x:y", "-", "+1"]))
        argv += [f"--machine={value}"]
        expected = ("plain name",)
    elif fault == "choice":
        if op == "mlp":
            opt = draw(st.sampled_from(["--models", "--remat"]))
        elif op == "bulk":
            opt = "--dtype"
        else:
            opt = "--timeline-method"
        value = draw(words.filter(lambda s: not s.startswith("-")))
        valid = {
            "mlp",
            "attn_proj",
            "swiglu",
            "none",
            "dots",
            "dots_no_batch",
            "auto",
            "bfloat16",
            "float16",
            "float32",
        }
        value = value if value not in valid | set(methods.METHODS) else value + "_x"
        argv += [f"{opt}={value}"]
        expected = ("invalid choice",)
    elif fault == "size":
        opt = draw(st.sampled_from(["--tp", "--hidden", "--ffn", "--tokens"]))
        value = draw(st.one_of(st.integers(max_value=0).map(str), big, st.sampled_from(["x", "2.5"])))
        argv += [f"{opt}={value}"]
        expected = ("must be", "expected")
    else:
        sub = draw(st.sampled_from(["target", "ideal", "tp", "file"]))
        if sub == "target":
            value = draw(
                st.one_of(
                    words.filter(lambda s: "=" not in s),
                    st.tuples(
                        st.sampled_from(["ag_gemm", "gemm_rs", "xx"]),
                        st.sampled_from(["0", "-1", "inf", "a"]),
                    ).map(lambda t: "=".join(t)),
                )
            )
            argv += [f"--target={value}", "f.json"]
            expected = ("expected",)
        elif sub == "ideal":
            value = draw(st.sampled_from(["0", "-2", "inf", "nan", "x"]))
            argv += [f"--ideal-max={value}", "f.json"]
            expected = ("positive number",)
        elif sub == "tp":
            value = draw(st.sampled_from(["x", "1.5", "two"]))
            argv += [f"--tp={value}", "f.json"]
            expected = ("invalid int",)
        else:
            value = str(ROOT / "no_such_dir" / (draw(words).replace("/", "_") + ".json"))
            argv += [value]
            expected = ("no such file",)
    return argv, value, expected


@run_settings(60)
@given(case=bench_argvs())
def test_bench_command_line_refuses_invalid_values(case):
    ran("test_bench_command_line_refuses_invalid_values")
    argv, value, expected = case
    refuse_cli(f"bench {argv}", bench_main, argv, (value, repr(value)), expected)


@run_settings(15)
@given(
    argv=st.one_of(
        words.filter(lambda s: not s.startswith("-")).map(lambda s: [s]),
        st.from_regex(r"--[a-z]{2,8}", fullmatch=True)
        .filter(lambda s: s not in ("--json", "--no-live", "--help"))
        .map(lambda s: [s]),
        st.sampled_from([["--json=1"], ["--no-live=yes"]]),
    )
)
def test_doctor_command_line_refuses_unknown_arguments(argv):
    ran("test_doctor_command_line_refuses_unknown_arguments")
    refuse_cli(f"doctor {argv}", doctor_main, argv, (argv[0].split("=")[-1],), ("usage",))


@run_settings(15)
@given(
    argv=st.one_of(
        words.filter(lambda s: not s.startswith("-")).map(lambda s: [s]),
        st.from_regex(r"--[a-z]{2,8}", fullmatch=True)
        .filter(lambda s: s not in ("--markdown", "--help"))
        .map(lambda s: [s]),
        words.map(lambda s: ["--markdown", str(ROOT / "no_such_dir" / s.replace("/", "_"))]),
    )
)
def test_config_command_line_refuses_invalid_arguments(argv):
    ran("test_config_command_line_refuses_invalid_arguments")
    refuse_cli(f"config {argv}", config.main, argv, (argv[-1], repr(argv[-1])), ("usage",))


# ------------------------------------------------------------------------------------------------
# tools/*.py, called in-process


def tool(name: str):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "tools"))


@run_settings(10)
@given(names=st.lists(words.map(lambda s: s.replace("/", "_") + ".json"), min_size=2, max_size=2))
def test_merge_results_refuses_files_it_cannot_read(names):
    ran("test_merge_results_refuses_files_it_cannot_read")
    paths = [str(ROOT / "no_such_dir" / n) for n in names]
    main = tool("merge_results").main
    refuse_cli(f"merge_results {paths}", main, paths, (paths[0],), ("cannot read a bench JSON",))


# ------------------------------------------------------------------------------------------------
# The layers' options, a norm's x, an x that is no array, and timeouts above config.MAX_TIMEOUT_S:
# one case each.


def _nnx(cls, *args, **kw):
    def call():
        with jax.set_mesh(MESH):
            return getattr(ubnn, cls)(*args, rngs=kw.pop("rngs", nnx.Rngs(0)), **kw)

    return call


def _linen(cls, x_shape=(2, SEQ, HIDDEN), **kw):
    def call():
        with jax.set_mesh(MESH):
            return getattr(ublinen, cls)(**kw).init(jax.random.key(0), arr(x_shape))

    return call


OPTION_CASES = [
    pytest.param(
        Case("nnx ColumnParallelDense(-4, 8)", _nnx("ColumnParallelDense", -4, 8), ("-4",), ("in_features",)),
        id="nnx-in-negative",
    ),
    pytest.param(
        Case("nnx ColumnParallelDense(0, 8)", _nnx("ColumnParallelDense", 0, 8), ("0",), ("in_features",)),
        id="nnx-in-zero",
    ),
    pytest.param(
        Case("nnx RowParallelDense(8, 2.5)", _nnx("RowParallelDense", 8, 2.5), ("2.5",), ("out_features",)),
        id="nnx-out-float",
    ),
    pytest.param(
        Case("nnx LayerNorm('8')", _nnx("LayerNorm", "8"), ("'8'",), ("features",)),
        id="nnx-norm-features-str",
    ),
    pytest.param(
        Case("nnx ParallelMLP(-8, 16)", _nnx("ParallelMLP", -8, 16), ("-8",), ("features",)),
        id="nnx-mlp-features-negative",
    ),
    pytest.param(
        Case(
            "linen ColumnParallelDense(-4)",
            _linen("ColumnParallelDense", features=-4),
            ("-4",),
            ("features",),
        ),
        id="linen-features-negative",
    ),
    pytest.param(
        Case(
            "nnx ColumnParallelDense(use_bias='no')",
            _nnx("ColumnParallelDense", 8, 8, use_bias="no"),
            ("'no'",),
            ("bool",),
        ),
        id="nnx-use-bias",
    ),
    pytest.param(
        Case("nnx ParallelMLP(gated='yes')", _nnx("ParallelMLP", 8, 16, gated="yes"), ("'yes'",), ("bool",)),
        id="nnx-gated",
    ),
    pytest.param(
        Case(
            "nnx ParallelMLP(recompute_gathered='yes')",
            _nnx("ParallelMLP", 8, 16, recompute_gathered="yes"),
            ("'yes'",),
            ("bool",),
        ),
        id="nnx-recompute",
    ),
    pytest.param(
        Case(
            "linen ColumnParallelDense(use_bias=2)",
            _linen("ColumnParallelDense", features=8, use_bias=2),
            ("2",),
            ("bool",),
        ),
        id="linen-use-bias",
    ),
    pytest.param(
        Case(
            "nnx ParallelMLP(epsilon=-1)", _nnx("ParallelMLP", 8, 16, epsilon=-1.0), ("-1.0",), ("epsilon",)
        ),
        id="nnx-mlp-eps-negative",
    ),
    pytest.param(
        Case(
            "nnx LayerNorm(epsilon=nan)", _nnx("LayerNorm", 8, epsilon=float("nan")), ("nan",), ("epsilon",)
        ),
        id="nnx-ln-eps-nan",
    ),
    pytest.param(
        Case("nnx RMSNorm(epsilon='a')", _nnx("RMSNorm", 8, epsilon="a"), ("'a'",), ("epsilon",)),
        id="nnx-rms-eps-str",
    ),
    pytest.param(
        Case("linen LayerNorm(epsilon=-1)", _linen("LayerNorm", epsilon=-1.0), ("-1.0",), ("epsilon",)),
        id="linen-ln-eps-negative",
    ),
    pytest.param(
        Case(
            "nnx ColumnParallelDense(dtype='foo')",
            _nnx("ColumnParallelDense", 8, 8, dtype="foo"),
            ("'foo'",),
            ("dtype",),
        ),
        id="nnx-dtype",
    ),
    pytest.param(
        Case(
            "nnx ColumnParallelDense(param_dtype=int32)",
            _nnx("ColumnParallelDense", 8, 8, param_dtype=jnp.int32),
            ("int32",),
            ("floating",),
        ),
        id="nnx-param-dtype",
    ),
    pytest.param(
        Case(
            "nnx ParallelMLP(activation=3)", _nnx("ParallelMLP", 8, 16, activation=3), ("3",), ("callable",)
        ),
        id="nnx-activation",
    ),
    pytest.param(
        Case(
            "nnx ColumnParallelDense(kernel_init=3)",
            _nnx("ColumnParallelDense", 8, 8, kernel_init=3),
            ("3",),
            ("callable",),
        ),
        id="nnx-kernel-init",
    ),
    pytest.param(
        Case(
            "nnx ColumnParallelDense(mesh='x')",
            _nnx("ColumnParallelDense", 8, 8, mesh="x"),
            ("str",),
            ("Mesh",),
        ),
        id="nnx-mesh",
    ),
    pytest.param(
        Case(
            "nnx ColumnParallelDense(rngs=0)", _nnx("ColumnParallelDense", 8, 8, rngs=0), ("int",), ("Rngs",)
        ),
        id="nnx-rngs",
    ),
    pytest.param(
        Case(
            "nnx LayerNorm(8)(x [2, 6])",
            lambda: _nnx("LayerNorm", 8)()(arr((2, 6))),
            ("[2, 6]",),
            ("features",),
        ),
        id="nnx-ln-x-features",
    ),
    pytest.param(
        Case(
            "nnx RMSNorm(8)(x [])",
            lambda: _nnx("RMSNorm", 8)()(jnp.float32(1.0)),
            ("[]",),
            ("at least 1", "features", "x must be"),
        ),
        id="nnx-rms-x-scalar",
    ),
    pytest.param(
        Case(
            "linen RMSNorm()(x [])",
            _linen("RMSNorm", x_shape=()),
            ("[]",),
            ("at least 1", "features", "x must be"),
        ),
        id="linen-rms-x-scalar",
    ),
    pytest.param(
        Case(
            "nnx ColumnParallelDense(8, 8)(list)",
            lambda: _nnx("ColumnParallelDense", 8, 8)()([[1.0] * 8] * 8),
            ("list",),
            ("array",),
        ),
        id="nnx-x-list",
    ),
    pytest.param(
        Case(
            "nnx QKVParallelDense(0, 4, 2, 8)", _nnx("QKVParallelDense", 0, 4, 2, 8), ("0",), ("in_features",)
        ),
        id="nnx-qkv-in-zero",
    ),
    pytest.param(
        Case(
            "nnx QKVParallelDense(recompute_gathered=1)",
            _nnx("QKVParallelDense", 8, 4, 2, 8, recompute_gathered=1),
            ("1",),
            ("bool",),
        ),
        id="nnx-qkv-recompute",
    ),
    pytest.param(
        Case(
            "nnx ParallelMLP(up_kernel_init='x')",
            _nnx("ParallelMLP", 8, 16, up_kernel_init="x"),
            ("'x'",),
            ("callable",),
        ),
        id="nnx-mlp-up-kernel-init",
    ),
    pytest.param(
        Case("nnx RMSNorm(8, dtype=int8)", _nnx("RMSNorm", 8, dtype=jnp.int8), ("int8",), ("floating",)),
        id="nnx-rms-dtype",
    ),
    pytest.param(
        Case(
            "linen ParallelMLP(activation=3)",
            _linen("ParallelMLP", ffn_features=16, activation=3),
            ("3",),
            ("callable",),
        ),
        id="linen-mlp-activation",
    ),
    pytest.param(
        Case(
            "linen ParallelMLP(ffn_features=0)",
            _linen("ParallelMLP", ffn_features=0),
            ("0",),
            ("ffn_features",),
        ),
        id="linen-mlp-ffn-zero",
    ),
    pytest.param(
        Case(
            "linen RowParallelDense(8)(list)",
            lambda: ublinen.RowParallelDense(8).init(jax.random.key(0), [[1.0] * 8] * 8),
            ("list",),
            ("array",),
        ),
        id="linen-x-list",
    ),
    pytest.param(
        Case(
            "linen LayerNorm(param_dtype='foo')",
            _linen("LayerNorm", param_dtype="foo"),
            ("'foo'",),
            ("dtype",),
        ),
        id="linen-ln-param-dtype",
    ),
    pytest.param(
        Case(
            "initialize(timeout_s=1e300)",
            lambda: jax_ub.initialize(MESH, "tp", timeout_s=1e300),
            ("1e+300",),
            ("timeout_s",),
        ),
        id="initialize-timeout-huge",
    ),
    pytest.param(
        Case(
            "check_processes(timeout_s=1e300)",
            lambda: jax_ub.check_processes(timeout_s=1e300),
            ("1e+300",),
            ("timeout_s",),
        ),
        id="check-processes-timeout-huge",
    ),
]


@pytest.mark.parametrize("case", OPTION_CASES)
def test_layer_options_and_timeouts_are_checked(case):
    refuse(case)


def test_measured_table_refuses_a_missing_file():
    path = str(ROOT / "no_such_dir" / "x-ag.json")
    refuse_cli("measured_table", tool("measured_table").main, ["--check", path], (path,), ("bench",))


@pytest.mark.parametrize("argv", [["only_one.json"], ["a.json", "b.json", "c.json"], ["--force", "a", "b"]])
def test_merge_results_says_what_arguments_it_got(argv):
    refuse_cli("merge_results", tool("merge_results").main, argv, (repr(argv[-1]), argv[-1]), ("usage",))


# ------------------------------------------------------------------------------------------------


def test_at_least_300_invalid_calls_were_checked():
    """The count of the refusals checked by this file's tests (run before this one: file order;
    skipped where some of them did not run, e.g. under ``-k``)."""
    ran = {k for k, n in CALLS.items() if k != "checked" and n}
    if ran != set(PROPERTY_TESTS):
        pytest.skip(f"not every property test ran (missing: {sorted(set(PROPERTY_TESTS) - ran)})")
    print(f"{CALLS['checked']} invalid calls refused as they should be")
    assert CALLS["checked"] >= MIN_CALLS, f"only {CALLS['checked']} invalid calls were checked"
