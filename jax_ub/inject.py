"""``jax_ub.tp_dot_general``: a ``lax.dot_general`` stand-in that runs jax_ub's overlapped ops.

Flax's dense layers take their product as an argument (``nnx.Linear(..., dot_general=...)``,
``nnx.LinearGeneral``, ``nn.Dense``, ``nn.DenseGeneral``): passing
``jax_ub.tp_dot_general("column")`` or ``("row")`` there makes an existing layer a tensor-parallel
one whose communication overlaps its GEMM, with no other change to the model::

    up = nnx.Linear(h, f, dot_general=jax_ub.tp_dot_general("column", axis="tensor"), rngs=rngs)
    down = nnx.Linear(f, h, dot_general=jax_ub.tp_dot_general("row", axis="tensor"), rngs=rngs)

The callable is called on global arrays (under ``jax.jit`` with a mesh set by ``jax.set_mesh``, or
given as ``mesh=``) and wraps the product in a ``jax.shard_map`` over that mesh:

* ``"column"``: the activations come sequence-sharded over ``axis`` and are all-gathered under the
  GEMM (:func:`jax_ub.all_gather_matmul`), the kernel split over ``axis`` on its output dims; the
  output is split over ``axis`` on its features.
* ``"row"``: the activations come split over ``axis`` on their features, the kernel on its input
  dims; the partial products are reduce-scattered over the sequence under the GEMM
  (:func:`jax_ub.matmul_reduce_scatter`).

With ``sequence_parallel=False`` the sequence stays whole: the column product is a local GEMM and
the row product a GEMM and a ``lax.psum``. The other leading dims keep the sharding they come with
(see :class:`TPDotGeneral`). Gradients are the ops' own (``jax.custom_vjp``), equal to the plain
dot's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_ub import _validate, ops, resolve
from jax_ub import fp8 as fp8_lib

KINDS = ("column", "row")
AUTO = "auto"


def _fmt(shape: Sequence[int]) -> str:
    return _validate.shape_str(tuple(shape))


def _axes_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: Iterable[str]) -> Any:
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


class TPDotGeneral:
    """A ``lax.dot_general``-compatible callable running the TP product of one layer kind.

    Args (as :func:`tp_dot_general`):
      kind: ``"column"`` or ``"row"``.
      mesh: a ``jax.sharding.Mesh`` (or ``AbstractMesh``); ``None``: the mesh set with
        ``jax.set_mesh`` at the call.
      axis: the mesh axis of the TP group (``"tensor"`` on MaxText's meshes).
      sequence_parallel: the sequence is sharded over ``axis`` outside the pair of layers (gathered
        by the column product, scattered by the row product); ``False``: replicated over it.
      seq_axis: the sequence dim of the activations (default ``-2``: ``[batch, seq, features]``;
        ``[tokens, features]`` has the tokens there); never the last (contracted) dim.
      batch_axes: the mesh axes of the activations' other leading dims. ``"auto"``: on
        ``Explicit`` mesh axes the sharding the activations come with (their type's), else the
        first leading dim that is not the sequence is split over every other mesh axis of size
        > 1 when it divides by their product (MaxText's ``(data, fsdp)``), and kept whole
        otherwise. ``None``: whole. A mesh axis name or tuple of names: the first such dim over
        those.
      method: passed to the ops (``None``: ``JAX_UB_METHOD``, default ``"auto"``).
      fp8: a :class:`jax_ub.FP8Recipe` passed to the ops (sequence parallel only).
    """

    def __init__(
        self,
        kind: str,
        *,
        mesh: Any = None,
        axis: str = "tp",
        sequence_parallel: bool = True,
        seq_axis: int = -2,
        batch_axes: Any = AUTO,
        method: str | None = None,
        fp8: fp8_lib.FP8Recipe | None = None,
    ):
        where = "jax_ub.tp_dot_general"
        if kind not in KINDS:
            raise ValueError(f"{where}: `kind` must be 'column' or 'row'; got {kind!r}.")
        self.where = f"{where}({kind!r})"
        if not isinstance(axis, str):
            raise TypeError(
                f"{self.where}: `axis` must be the name (a str) of one mesh axis, the TP group; got {axis!r}."
            )
        _validate.check_bool(self.where, "sequence_parallel", sequence_parallel)
        if isinstance(seq_axis, bool) or not isinstance(seq_axis, int) or seq_axis == -1:
            raise ValueError(
                f"{self.where}: `seq_axis` must be an int naming a leading dim of the activations "
                f"(not -1, the contracted features); got {seq_axis!r}."
            )
        if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
            raise TypeError(
                f"{self.where}: `mesh` must be a jax.sharding.Mesh, an AbstractMesh or None (the "
                f"mesh of jax.set_mesh); got {type(mesh).__name__}."
            )
        if batch_axes != AUTO and batch_axes is not None:
            names = _axes_of(batch_axes)
            if not names or not all(isinstance(n, str) for n in names):
                raise TypeError(
                    f"{self.where}: `batch_axes` must be 'auto', None, a mesh axis name or a tuple "
                    f"of them; got {batch_axes!r}."
                )
            if axis in names:
                raise ValueError(
                    f"{self.where}: `batch_axes` {batch_axes!r} must not name the TP axis {axis!r}."
                )
        if fp8 is not None and not isinstance(fp8, fp8_lib.FP8Recipe):
            raise TypeError(f"{self.where}: `fp8` must be a jax_ub.FP8Recipe or None; got {fp8!r}.")
        if fp8 is not None and not sequence_parallel:
            raise ValueError(
                f"{self.where}: `fp8` needs sequence_parallel=True (the overlapped ops take the "
                f"recipe; without sequence parallelism the product is a plain local GEMM)."
            )
        self.kind = kind
        self.mesh = mesh
        self.axis = axis
        self.sequence_parallel = sequence_parallel
        self.seq_axis = seq_axis
        self.batch_axes = batch_axes
        self.method = None if method is None else resolve.requested(method, self.where)
        self.fp8 = fp8

    def __repr__(self) -> str:
        return (
            f"tp_dot_general({self.kind!r}, axis={self.axis!r}, sequence_parallel="
            f"{self.sequence_parallel}, method={self.method!r})"
        )

    # ---------------------------------------------------------------------------------------------
    # Checks

    def _contraction(self, lhs: Any, rhs: Any, dimension_numbers: Any) -> int:
        """The number of contracted dims: the last ones of lhs, the first ones of rhs, in order."""
        try:
            (lc, rc), (lb, rb) = dimension_numbers
            lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
        except (TypeError, ValueError):
            raise TypeError(
                f"{self.where}: `dimension_numbers` must be ((lhs_contract, rhs_contract), "
                f"(lhs_batch, rhs_batch)), as lax.dot_general's; got {dimension_numbers!r}."
            ) from None
        if lb or rb:
            raise ValueError(
                f"{self.where}: the product must have no batch dims (a dense layer's); got batch "
                f"dims lhs {lb}, rhs {rb}."
            )
        c = len(lc)
        for name, a, dims in (("lhs", lhs, lc), ("rhs", rhs, rc)):
            if any(not -a.ndim <= d < a.ndim for d in dims):
                raise ValueError(
                    f"{self.where}: contracting dims {dims} of {name} {_fmt(a.shape)} must be in "
                    f"[-{a.ndim}, {a.ndim}); got {dims}."
                )
        lc = tuple(d % lhs.ndim for d in lc)
        rc = tuple(d % rhs.ndim for d in rc)
        want_l, want_r = tuple(range(lhs.ndim - c, lhs.ndim)), tuple(range(c))
        if c == 0 or lc != want_l or rc != want_r or rhs.ndim <= c:
            raise ValueError(
                f"{self.where}: the product must contract the last dims of the activations with "
                f"the first dims of the kernel, in order, and leave kernel dims over (a dense "
                f"layer's x[..., k] @ kernel[k, n], any of them flattened); for lhs "
                f"{_fmt(lhs.shape)} and rhs {_fmt(rhs.shape)} that is contracting ((lhs "
                f"{want_l or (lhs.ndim - 1,)}), (rhs {want_r or (0,)})); got (({lc}), ({rc}))."
            )
        if tuple(lhs.shape[-c:]) != tuple(rhs.shape[:c]):
            raise ValueError(
                f"{self.where}: the contracted dims differ: lhs {_fmt(lhs.shape)} dims {lc}, rhs "
                f"{_fmt(rhs.shape)} dims {rc}."
            )
        return c

    def _mesh(self) -> tuple[Any, tuple[str, ...], bool]:
        """(the mesh, its free axes, whether it came from the context)."""
        ctx = jax.sharding.get_abstract_mesh()
        mesh = self.mesh if self.mesh is not None else (None if ctx.empty else ctx)
        if mesh is None:
            raise ValueError(
                f"{self.where}: no mesh: pass `mesh=` to jax_ub.tp_dot_general, or call under "
                f"`with jax.set_mesh(mesh):`; got neither."
            )
        if self.axis not in mesh.axis_names:
            raise ValueError(
                f"{self.where}: the TP axis {self.axis!r} is not an axis of the mesh; its axes "
                f"are {tuple(mesh.axis_names)} (pass `axis=` one of them, e.g. MaxText's 'tensor')."
            )
        manual = set(getattr(ctx, "manual_axes", ()) or ()) | set(getattr(mesh, "manual_axes", ()) or ())
        try:
            lax.axis_size(self.axis)
            bound = True
        except NameError:
            bound = False
        if bound or self.axis in manual:
            raise ValueError(
                f"{self.where}: the TP axis {self.axis!r} is already bound by an enclosing "
                f"shard_map: this entry point takes global arrays; inside shard_map call "
                f"jax_ub.all_gather_matmul / jax_ub.matmul_reduce_scatter on the local shards."
            )
        free = tuple(a for a in mesh.axis_names if a not in manual)
        return mesh, free, self.mesh is None

    def _leading_spec(self, mesh: Any, free: tuple[str, ...], x: Any, seq: int | None) -> list[Any]:
        """Mesh axes of x's leading dims (the seq dim's entry left None: the caller sets it)."""
        lead = [None] * (x.ndim - 1)
        batch = next((d for d in range(x.ndim - 1) if d != seq), None)
        if self.batch_axes is None or batch is None:
            return lead
        if self.batch_axes != AUTO:
            names = _axes_of(self.batch_axes)
            missing = [n for n in names if n not in free]
            if missing:
                raise ValueError(
                    f"{self.where}: `batch_axes` {self.batch_axes!r} names {missing}, not free axes "
                    f"of the mesh {free}."
                )
            size = math.prod(mesh.shape[n] for n in names)
            if x.shape[batch] % size:
                raise ValueError(
                    f"{self.where}: the batch (x.shape={_fmt(x.shape)}, dim {batch}) must divide by "
                    f"the size {size} of `batch_axes` {self.batch_axes!r}; got {x.shape[batch]}."
                )
            lead[batch] = _entry(names)
            return lead
        explicit = _explicit(mesh, free)
        if explicit:
            spec = tuple(getattr(jax.typeof(x).sharding, "spec", ()) or ())
            for d in range(x.ndim - 1):
                if d != seq and d < len(spec):
                    lead[d] = _entry(a for a in _axes_of(spec[d]) if a != self.axis)
            return lead
        axes = tuple(a for a in free if a != self.axis and mesh.shape[a] > 1)
        if axes and x.shape[batch] % math.prod(mesh.shape[a] for a in axes) == 0:
            lead[batch] = _entry(axes)
        return lead

    def _divides(self, what: str, size: int, tp: int) -> None:
        if size % tp:
            raise ValueError(
                f"{self.where}: {what} must divide by the size {tp} of the TP axis {self.axis!r}; got {size}."
            )

    # ---------------------------------------------------------------------------------------------
    # The call

    def __call__(
        self,
        lhs: Any,
        rhs: Any,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
        **kw: Any,
    ) -> jax.Array:
        if kw:
            raise TypeError(
                f"{self.where}: unexpected keyword arguments {sorted(kw)}: it takes lax.dot_general's "
                f"(dimension_numbers, precision, preferred_element_type, out_sharding)."
            )
        _validate.check_array(self.where, "lhs", lhs)
        _validate.check_array(self.where, "rhs", rhs)
        _validate.check_precision(self.where, precision)
        c = self._contraction(lhs, rhs, dimension_numbers)
        dtype = jnp.result_type(lhs, rhs)
        fp8_out = None
        if preferred_element_type is not None and np.dtype(preferred_element_type) != dtype:
            if self.fp8 is None:
                raise ValueError(
                    f"{self.where}: preferred_element_type must be None or the operands' dtype "
                    f"{np.dtype(dtype).name} (jax_ub's ops take and give one dtype); got "
                    f"{np.dtype(preferred_element_type).name}."
                )
            fp8_out = preferred_element_type
        lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
        out_shape = (*lhs.shape[:-c], *rhs.shape[c:])
        k = math.prod(rhs.shape[:c])
        n = math.prod(rhs.shape[c:])
        x = lhs.reshape(*lhs.shape[:-c], k) if c != 1 else lhs
        w = rhs.reshape(k, n) if rhs.ndim != 2 else rhs
        seq = self._seq(x)
        mesh, free, from_ctx = self._mesh()
        tp = int(mesh.shape[self.axis])
        column = self.kind == "column"
        if column:
            self._divides(f"the kernel's output features ({_fmt(rhs.shape[c:])} = {n})", n, tp)
        else:
            self._divides(f"the contracted features (kernel {_fmt(rhs.shape)}: {k})", k, tp)
        if seq is not None:
            self._divides(f"the sequence (x.shape={_fmt(x.shape)}, dim {seq})", x.shape[seq], tp)
        lead = self._leading_spec(mesh, free, x, seq)
        ax = self.axis
        sharded_seq = list(lead)
        if seq is not None:
            sharded_seq[seq] = ax
        if column:
            x_spec, w_spec, out_spec = P(*sharded_seq, None), P(None, ax), P(*lead, ax)
        else:
            x_spec, w_spec, out_spec = P(*lead, ax), P(ax, None), P(*sharded_seq, None)
        body = self._body(seq, precision, fp8_out)
        kwargs: dict[str, Any] = {}
        if len(free) != len(mesh.axis_names):
            kwargs["axis_names"] = set(free)
        mapped = jax.shard_map(
            body,
            mesh=None if from_ctx else mesh,
            in_specs=(x_spec, w_spec),
            out_specs=out_spec,
            **kwargs,
        )
        explicit = _explicit(mesh, free)
        y = mapped(
            _reshard(x, x_spec, explicit, mesh, from_ctx), _reshard(w, w_spec, explicit, mesh, from_ctx)
        )
        y = y.reshape(out_shape) if y.shape != out_shape else y
        if out_sharding is not None:
            y = jax.sharding.reshard(y, out_sharding)
        return y

    def _seq(self, x: Any) -> int | None:
        if not self.sequence_parallel:
            return None
        axis = self.seq_axis + x.ndim if self.seq_axis < 0 else self.seq_axis
        if x.ndim < 2 or not 0 <= axis < x.ndim - 1:
            raise ValueError(
                f"{self.where}: with sequence_parallel=True the activations must be [..., seq, "
                f"features] with the sequence on seq_axis={self.seq_axis} (not the contracted "
                f"last dims); got lhs of {x.ndim} dims after flattening the contracted ones "
                f"({_fmt(x.shape)})."
            )
        return axis

    def _body(self, seq: int | None, precision: Any, fp8_out: Any) -> Any:
        ax, method, recipe = self.axis, self.method, self.fp8
        prec = _validate.static_precision(precision)
        fp8_kw: dict[str, Any] = {}
        if recipe is not None:
            fp8_kw = {"fp8": recipe, "preferred_element_type": fp8_out}

        def dot(x: jax.Array, w: jax.Array) -> jax.Array:
            return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=prec)

        if self.kind == "column":
            if seq is None:
                return dot

            def column(x: jax.Array, w: jax.Array) -> jax.Array:
                return ops.all_gather_matmul(
                    x, w, ax, gather_axis=seq, precision=prec, method=method, **fp8_kw
                )  # type: ignore[return-value]

            return column
        if seq is None:
            return lambda x, w: lax.psum(dot(x, w), ax)

        def row(x: jax.Array, w: jax.Array) -> jax.Array:
            return ops.matmul_reduce_scatter(
                x, w, ax, scatter_axis=seq, precision=prec, method=method, **fp8_kw
            )

        return row


def _explicit(mesh: Any, free: Sequence[str]) -> set[str]:
    types = getattr(mesh, "axis_types", None)
    if types is None:
        return set()
    exp = jax.sharding.AxisType.Explicit
    return {a for a, t in zip(mesh.axis_names, types, strict=True) if t == exp and a in free}


def _reshard(value: jax.Array, spec: P, explicit: set[str], mesh: Any, from_ctx: bool) -> jax.Array:
    """``value`` on ``spec``'s Explicit axes (shard_map reshards Auto ones itself)."""
    if not explicit:
        return value
    target = P(*(_entry(a for a in _axes_of(e) if a in explicit) for e in spec))
    if not from_ctx and jax.sharding.get_abstract_mesh().empty and isinstance(mesh, jax.sharding.Mesh):
        return jax.device_put(value, jax.sharding.NamedSharding(mesh, target))
    return jax.sharding.reshard(value, target)


def tp_dot_general(
    kind: str,
    *,
    mesh: Any = None,
    axis: str = "tp",
    sequence_parallel: bool = True,
    seq_axis: int = -2,
    batch_axes: Any = AUTO,
    method: str | None = None,
    fp8: fp8_lib.FP8Recipe | None = None,
) -> TPDotGeneral:
    """A callable with ``lax.dot_general``'s signature ``(lhs, rhs, dimension_numbers,
    precision=None, preferred_element_type=None, out_sharding=None)`` for Flax's
    ``dot_general=`` argument, running the TP product of a ``"column"`` or ``"row"`` layer with
    jax_ub's overlapped ops (see :mod:`jax_ub.inject`; the arguments are :class:`TPDotGeneral`'s).

    It refuses, naming what it expected and what it got: dimension numbers other than a dense
    layer's (batch dims; a contraction that is not the activations' last dims with the kernel's
    first, in order), a preferred_element_type other than the operands' dtype (without ``fp8``),
    a sequence, kernel features or batch that do not divide, no mesh, a TP axis the mesh lacks or
    that an enclosing ``shard_map`` already binds. See docs/adoption.md.
    """
    return TPDotGeneral(
        kind,
        mesh=mesh,
        axis=axis,
        sequence_parallel=sequence_parallel,
        seq_axis=seq_axis,
        batch_axes=batch_axes,
        method=method,
        fp8=fp8,
    )
