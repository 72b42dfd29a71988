"""Argument checks shared by the jax_ub primitives; they run at trace time, before any kernel.

Every error says what was expected and what was received (shapes, dtypes, values), and names the
public function it came from. Shape errors are ``ValueError``; wrong types and dtypes ``TypeError``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SUPPORTED_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
DTYPE_NAMES = ", ".join(d.name for d in SUPPORTED_DTYPES)


def shape_str(shape: tuple[int, ...]) -> str:
    """``(3, 5)`` -> ``[3, 5]``, the notation of the docstrings."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def one_axis(axis_name: Any) -> str | None:
    """The mesh axis that ``axis_name`` names (a str, or a tuple of one str), or None where it
    names several: a jax_ub communicator spans one mesh axis."""
    if isinstance(axis_name, tuple) and len(axis_name) == 1:  # a list is no axis name (unhashable)
        axis_name = axis_name[0]
    return axis_name if isinstance(axis_name, str) else None


def check_array(fn: str, name: str, a: Any, abstract_ok: bool = False) -> None:
    """``a`` is an array (a jax or numpy array, or a tracer). ``abstract_ok``: a
    ``jax.ShapeDtypeStruct`` will do too (:func:`jax_ub.explain`, which computes nothing)."""
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"{fn}: `{name}` must be a jax array; got {type(a).__name__}")
    if isinstance(a, jax.ShapeDtypeStruct) and not abstract_ok:
        raise TypeError(
            f"{fn}: `{name}` must be a jax array; got a jax.ShapeDtypeStruct (a shape "
            f"without values): pass an array, or trace with jax.eval_shape(f, ...) to "
            f"work with shapes only"
        )


def check_operands(fn: str, x: Any, w: Any, x_layout: str, w_layout: str, abstract_ok: bool = False) -> None:
    """``x`` at least 2-D, ``w`` 2-D, same supported float dtype, matching contracting dims."""
    check_array(fn, "x", x, abstract_ok)
    check_array(fn, "w", w, abstract_ok)
    if x.ndim < 2:
        raise ValueError(f"{fn}: `x` must be at least 2-D `{x_layout}`; got shape {shape_str(x.shape)}")
    if w.ndim != 2:
        raise ValueError(f"{fn}: `w` must be 2-D `{w_layout}`; got shape {shape_str(w.shape)}")
    for name, a in (("x", x), ("w", w)):
        if np.dtype(a.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: `{name}` must have dtype {DTYPE_NAMES}; got {np.dtype(a.dtype).name}")
    if x.dtype != w.dtype:
        raise TypeError(
            f"{fn}: `x` and `w` must have the same dtype; got x {np.dtype(x.dtype).name}, "
            f"w {np.dtype(w.dtype).name} (cast one first, e.g. `w.astype(x.dtype)`: the op "
            f"communicates and multiplies in one dtype, unlike `@`, which would promote)"
        )
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{fn}: contracting dims must match: x.shape[-1] == w.shape[0] (x `{x_layout}`, "
            f"w `{w_layout}`); got x {shape_str(x.shape)}, w {shape_str(w.shape)}"
        )


def normalize_axis(fn: str, kw: str, axis: Any, x_shape: tuple[int, ...], *, last_ok: bool = False) -> int:
    """A non-negative axis of ``x`` that is not the last (contracting) one (any axis: ``last_ok``)."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{fn}: `{kw}` must be an int; got {axis!r} of type {type(axis).__name__}")
    ndim = len(x_shape)
    if last_ok:
        valid, what = (*range(-ndim, 0), *range(ndim)), "an axis of x"
    else:
        valid = (*range(-ndim, -1), *range(ndim - 1))
        what = "an axis of x other than the last (contracting) one"
    if axis not in valid:
        raise ValueError(
            f"{fn}: `{kw}` must be {what}, i.e. one of {valid} for x of shape {shape_str(x_shape)}; "
            f"got {axis}"
        )
    return int(axis) % ndim


def check_axis_name(fn: str, axis_name: Any) -> None:
    """``axis_name`` is a mesh axis name (str) or a tuple of distinct names, else a TypeError or a
    ValueError naming ``fn``."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(n, str) for n in names):
        # An int would be taken by lax.axis_size as a positional axis and fail deep inside jax.
        raise TypeError(
            f"{fn}: `axis_name` must be a mesh axis name (str) or a tuple of names; got {axis_name!r}"
        )
    check_axis_names(fn, axis_name)


def bound_axis_size(fn: str, axis_name: Any) -> int:
    """The size of mesh axis ``axis_name``, or a ValueError when no enclosing shard_map binds it."""
    check_axis_name(fn, axis_name)
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        pass
    msg = (
        f"{fn}: axis_name {axis_name!r} is not bound: call it inside jax.shard_map over a mesh with that axis"
    )
    bound = _manual_axes()
    if bound:
        msg += f" (axes bound here: {bound})"
    raise ValueError(msg)


def bound_by_shard_map(axis_name: Any) -> bool:
    """Whether ``axis_name`` (bound here) is a mesh axis of an enclosing ``shard_map``, not a
    ``jax.vmap``/``pmap`` axis of that name: the CUDA path runs one rank per device of the mesh
    ``initialize`` saw, which a vmap axis is not. True where jax cannot say (no ``manual_axes``)."""
    try:
        manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None)
    except Exception:  # an older jax without an abstract mesh here
        return True
    if manual is None:
        return True
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return all(n in manual for n in names)


def _manual_axes() -> tuple[str, ...]:
    """Mesh axes of the enclosing shard_map, for error messages only (best effort)."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        manual = getattr(mesh, "manual_axes", ())
        return tuple(n for n in mesh.axis_names if n in manual)
    except Exception:
        return ()


def mesh_platform() -> str | None:
    """The platform (``"cpu"``, ``"gpu"``, ...) of the enclosing mesh's devices, or None where jax
    does not say (best effort: only advisory messages depend on it)."""
    try:
        return getattr(getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None), "platform", None)
    except Exception:
        return None


def check_divisible(fn: str, kw: str, axis: int, x_shape: tuple[int, ...], axis_name: Any, tp: int) -> None:
    if x_shape[axis] % tp:
        raise ValueError(
            f"{fn}: x.shape[{kw}={axis}] must be divisible by the size of mesh axis {axis_name!r} "
            f"({tp}); got x {shape_str(x_shape)}"
        )


def check_nonempty_axis(fn: str, kw: str, axis: int, x_shape: tuple[int, ...], collective: str) -> None:
    """XLA's verifier refuses an all-gather or reduce-scatter over a zero-size dimension (lax's
    own ops included): said here, naming the call, rather than as an MLIR verifier error."""
    if x_shape[axis] == 0:
        raise ValueError(
            f"{fn}: x.shape[{kw}={axis}] is 0 (x {shape_str(x_shape)}): XLA cannot {collective} "
            f"over an empty dimension (its verifier refuses it, for lax's own collectives too); "
            f"skip the call when that dimension is empty"
        )


def check_bool(fn: str, kw: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: `{kw}` must be a bool; got {value!r}")


def static_precision(precision: Any, fn: str | None = None) -> Any:
    """``precision`` in a hashable form (lists become tuples): a static argument of jit/custom_vjp.
    With ``fn``, a value jax would refuse is refused here, naming ``fn``."""
    if fn is not None:
        check_precision(fn, precision)
    return tuple(precision) if isinstance(precision, list) else precision


def check_precision(fn: str, precision: Any) -> None:
    """What ``lax.dot_general`` accepts: None, a ``lax.Precision`` or its name, a pair of those, or
    a dot algorithm (preset). Checked with jax's own canonicalization where this jax has it."""
    try:
        from jax._src.lax.lax import canonicalize_precision
    except ImportError:  # a jax without it: the GEMM itself reports a bad value
        return
    try:
        canonicalize_precision(precision)
    except (TypeError, ValueError) as e:
        # A wrong type (3, a pair holding one) is a TypeError, a wrong name a ValueError.
        parts = precision if isinstance(precision, (tuple, list)) else (precision,)
        typed = all(isinstance(p, (str, jax.lax.Precision)) for p in parts)
        raise (ValueError if typed else TypeError)(
            f"{fn}: `precision` must be None, a jax.lax.Precision or one of its names (e.g. "
            f"'highest'), a pair of them, or a jax.lax.DotAlgorithmPreset; got {precision!r}"
        ) from e


def check_axis_names(fn: str, axis_name: Any) -> None:
    """A tuple of axis names names each axis once."""
    if isinstance(axis_name, tuple) and len(set(axis_name)) != len(axis_name):
        raise ValueError(f"{fn}: `axis_name` {axis_name!r} names an axis more than once")


# ------------------------------------------------------------------------------------------------
# The layers' constructor arguments: each names the layer (``fn``), the argument, what it takes
# and what it got, before any parameter is drawn (jax's own errors there name neither).


def check_size(fn: str, name: str, value: Any, *, minimum: int = 1) -> int:
    """A dimension such as ``in_features``: an int (not a bool) >= ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}: `{name}` must be an int >= {minimum}; got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{fn}: `{name}` must be an int >= {minimum}; got {value}")
    return int(value)


def check_epsilon(fn: str, value: Any, name: str = "epsilon") -> float:
    """A norm's ``epsilon``: a finite real number >= 0 (a negative one or NaN gives NaN outputs)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{fn}: `{name}` must be a finite number >= 0; got {value!r} ({type(value).__name__})"
        )
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"{fn}: `{name}` must be a finite number >= 0; got {value!r}")
    return float(value)


def check_callable(fn: str, name: str, value: Any, *, optional: bool = False) -> None:
    """An initializer or activation: a callable (or None where ``optional``)."""
    if value is None and optional:
        return
    if not callable(value):
        raise TypeError(
            f"{fn}: `{name}` must be a callable{' or None' if optional else ''}; "
            f"got {value!r} ({type(value).__name__})"
        )


def check_optional_bool(fn: str, kw: str, value: Any) -> None:
    """A bool, or None for the configured default (``recompute_gathered``)."""
    if value is not None:
        check_bool(fn, kw, value)


def check_float_dtype(fn: str, name: str, value: Any, *, optional: bool = False) -> None:
    """A floating dtype (``param_dtype``; ``dtype`` with ``optional``: None follows the inputs)."""
    if value is None and optional:
        return
    try:
        dtype = None if value is None else np.dtype(jnp.dtype(value))
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{fn}: `{name}` must be a floating dtype (e.g. jnp.float32, jnp.bfloat16)"
            f"{' or None' if optional else ''}; got {value!r}"
        )


def check_mesh_arg(fn: str, mesh: Any) -> None:
    """A layer's ``mesh=``: None (the context's), a ``jax.sharding.Mesh`` or an ``AbstractMesh``."""
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(
            f"{fn}: `mesh` must be None, a jax.sharding.Mesh or a jax.sharding.AbstractMesh; "
            f"got {type(mesh).__name__}"
        )
