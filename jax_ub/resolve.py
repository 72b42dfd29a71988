"""What one call runs, and why: the method a call asked for (``None``: ``JAX_UB_METHOD``) resolved
against ``JAX_UB_DISABLE``, the CUDA path's availability, the mesh axis and its communicator, and
``method="auto"``'s measured choice (:mod:`jax_ub.choice`); :func:`explain` says it in words.

The names and the rules come from :mod:`jax_ub.methods`; :mod:`jax_ub.ops` and :mod:`jax_ub.bulk`
call this module at trace time, before any kernel.

Never silently slow: on a mesh of CUDA GPUs, ``"auto"`` does not fall back to the pure-XLA
reference where the CUDA path cannot run (the extension is not built or does not load, the driver
is too old, the mesh axis has no communicator): the op raises :class:`CudaPathUnavailableError`
naming the reason and the fix (:func:`refuse_reference`), unless the user asked for the reference
(``method="xla"``, ``JAX_UB_DISABLE=1``) or allowed it (``JAX_UB_ALLOW_REFERENCE=1``). On CPU and
TPU meshes the reference is the normal path.
"""

from __future__ import annotations

import logging
from typing import Any

from jax_ub import _ext, _usage, _validate, choice, comm, config, methods

_log = logging.getLogger("jax_ub")


class CudaPathUnavailableError(RuntimeError):
    """A jax_ub op on a mesh of CUDA GPUs whose CUDA path cannot run, where the reference path was
    neither asked for nor allowed (see :func:`refuse_reference`)."""


def on_cuda_mesh() -> bool:
    """Whether the op being traced runs on CUDA GPUs: the enclosing mesh's devices (inside
    ``shard_map``), else jax's default backend; and jax has a CUDA backend (not ROCm)."""
    platform = _validate.mesh_platform() or _ext.default_backend()
    return str(platform).lower() in ("gpu", "cuda") and _ext.cuda_backend() is not None


_REBUILD_FIX = (
    "run `python -m jax_ub.doctor`, which says what this machine lacks, then reinstall jax_ub with "
    "`JAX_UB_REQUIRE_CUDA=1 pip install --no-cache-dir --force-reinstall --no-deps .` in its "
    "checkout (the build then fails naming the cause instead of installing without the extension)"
)


def _fix_for(why: str) -> str:
    """The fix for an unavailable CUDA path, where its reason does not say one already."""
    low = why.lower()
    return "" if ("rebuild" in low or "pip install" in low) else f"Fix: {_REBUILD_FIX}. "


def refuse_reference(fn: str | None, why: str, fix: str) -> None:
    """On a mesh of CUDA GPUs, raises :class:`CudaPathUnavailableError` (``why``, then ``fix``)
    instead of letting ``"auto"`` run the reference path, unless ``JAX_UB_ALLOW_REFERENCE=1``
    (then the op is counted in :func:`jax_ub.summary`). Elsewhere it does nothing."""
    if not on_cuda_mesh():
        return
    if config.get().allow_reference:
        _log.debug("jax_ub: %s runs the reference on a CUDA GPU mesh (JAX_UB_ALLOW_REFERENCE=1): %s", fn, why)
        _usage.record_gpu_reference()
        return
    msg = (
        (f"{fn}: " if fn else "")
        + f"this mesh's devices are CUDA GPUs, but jax_ub's CUDA path cannot run here: {why}. {fix}"
        + "jax_ub does not fall back to the pure-XLA reference path on GPUs unasked (it runs at "
        "XLA's speed, without overlap). To run it on purpose, pass method='xla' to the op, or set "
        "JAX_UB_ALLOW_REFERENCE=1 (jax_ub.config.override(allow_reference=True))."
    )
    _usage.record_failure(msg)
    raise CudaPathUnavailableError(msg)


def _no_communicator_why(axis_name: Any) -> tuple[str, str]:
    """(why the axis has no communicator, the fix)."""
    if _validate.one_axis(axis_name) is None:
        return (
            f"axis_name {axis_name!r} names several mesh axes, and a jax_ub communicator spans one",
            "Fix: build the mesh with one axis for the TP group and pass that axis. ",
        )
    return (
        f"mesh axis {axis_name!r} has no jax_ub communicator",
        f"Fix: call jax_ub.initialize(mesh, axis={axis_name!r}) before the function is traced. ",
    )


def record_use(op: str, method: str) -> None:
    """Counts one traced call of ``op`` that resolved to ``method`` for :func:`jax_ub.summary`."""
    _usage.record(op, method)


def cuda_status() -> tuple[bool, str]:
    """(whether the CUDA path can run here, why not)."""
    return _ext.cuda_path_available()


def cuda_unavailable_reason() -> str:
    return cuda_status()[1] or "the CUDA path is available"


def requested(method: str | None, fn: str | None = None, *, warn: bool = True, stacklevel: int = 4) -> str:
    """``method`` (``None``: the configured one), checked against :data:`jax_ub.methods.METHODS`
    (any case, as ``JAX_UB_METHOD`` is); ``fn`` names the caller in the error. With ``warn``, the
    deprecated ``"nccl"`` warns (``DeprecationWarning``, at the frame ``stacklevel`` up from
    :func:`jax_ub.methods.canonical`: the default is the public op's caller)."""
    configured = method is None
    return methods.canonical(
        config.get().method if configured else method,
        f"{fn}: " if fn else "",
        configured=configured,
        warn=warn,
        stacklevel=stacklevel,
    )


def method_name(method: str | None, fn: str | None = None, *, warn: bool = True) -> str:
    """The method to run for ``method`` (``None``: the configured one); ``fn`` names the caller
    in the error.

    ``JAX_UB_DISABLE=1`` (``config.disable``) and ``"xla"`` give ``"xla"``; ``"auto"`` gives
    ``"auto"`` (which picks a CUDA algorithm per shape, or the reference when the mesh axis has no
    communicator: :func:`auto`) when the CUDA path can run, else ``"xla"``; the CUDA algorithms
    need it (on a mesh of CUDA GPUs, ``"auto"`` without the CUDA path raises instead:
    :func:`refuse_reference`). ``warn``: warn of a deprecated configured name (an explicit one
    was checked, and warned of, by the caller's :func:`requested`).
    """
    cfg = config.get()
    name = requested(method, fn, warn=warn and method is None, stacklevel=6)
    if cfg.disable or name == methods.XLA:
        _log.debug(
            "jax_ub: method %r -> 'xla' (the pure-XLA reference): %s",
            name,
            "JAX_UB_DISABLE=1" if cfg.disable else "requested",
        )
        return methods.XLA
    ok, why = cuda_status()
    if name == methods.AUTO:
        _log.debug(
            "jax_ub: method 'auto' -> %s",
            "'auto' (the CUDA path is available: a CUDA algorithm "
            "per shape where the mesh axis has a communicator, else the reference)"
            if ok
            else f"'xla' (the pure-XLA reference): {why}",
        )
        if not ok:
            refuse_reference(fn, why, _fix_for(why))
        return methods.AUTO if ok else methods.XLA
    if not ok:
        if method is None:  # the configured method: JAX_UB_METHOD (or config.override)
            asked, fix = (
                f"JAX_UB_METHOD={name}",
                "Unset JAX_UB_METHOD or set it to 'auto' or 'xla' (the pure-XLA path)",
            )
        else:
            asked, fix = f"method={name!r}", "Use method='auto' or 'xla' (the pure-XLA path)"
        raise ValueError(
            (f"{fn}: " if fn else "") + f"{asked} needs the CUDA overlap extension, which is not available: "
            f"{why}. {fix}, or set JAX_UB_DISABLE=1 to force that path everywhere"
        )
    _log.debug("jax_ub: method %r: requested (the CUDA path is available)", name)
    return name


def for_size(method: str | None, tp: int, *operands: Any, fn: str | None = None) -> str:
    """:func:`method_name` for an axis of ``tp`` devices. An axis of size 1 has nothing to gather or
    scatter: every method runs the reference there (a plain dot, exactly XLA's), and
    :func:`jax_ub.initialize` creates no communicator for it. Nor is there anything to overlap
    where an operand has a zero-size dimension: the reference runs there too (an empty gather or
    a dot over an empty sum, whose zeros XLA writes)."""
    # the name checked first (a deprecated configured one warned of; an explicit one the caller's
    # requested() checked), whatever runs
    name = requested(method, fn, warn=method is None, stacklevel=5)
    if tp == 1:
        _log.debug("jax_ub: method %r -> 'xla': the mesh axis has size 1 (nothing to communicate)", name)
        return methods.XLA
    empty = [_validate.shape_str(a.shape) for a in operands if 0 in a.shape]
    if empty:
        _log.debug(
            "jax_ub: method %r -> 'xla': zero-size operand %s (nothing to overlap)", name, ", ".join(empty)
        )
        return methods.XLA
    return method_name(method, fn, warn=False)


# ------------------------------------------------------------------------------------------------
# auto, per call

_NCCL_WHY = (
    "the NCCL schedule runs: axis {axis!r} has transport nccl (not every GPU pair of a group "
    "can map each other's memory, or transport='nccl' was asked for), on which every method "
    "runs it; no measurement compares it with xla"
)
# What auto reports on an axis with transport nccl: the NCCL schedule, whatever the method.
NCCL_SCHEDULE = "nccl"


def auto(
    op: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], dtype: Any, axis_name: Any
) -> choice.Choice | None:
    """What ``method="auto"`` runs for one call of ``op`` (AG or RS) on the axis's communicator:
    the NCCL schedule on transport nccl, else the measured choice; None without a communicator."""
    s = comm.get(axis_name)
    if s is None:
        return None
    if s.transport == "nccl":  # the NCCL schedule runs whatever algorithm is named
        return choice.Choice(NCCL_SCHEDULE, _NCCL_WHY.format(axis=axis_name))
    import jax.numpy as jnp

    tp = max(s.world, 1)
    M, K, N = choice.global_shape(op, tp, x_shape, w_shape)
    return choice.choose(op, tp, jnp.dtype(dtype).name, M, K, N, config.get().tuning_file)


def choose(op: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], dtype: Any, axis_name: Any) -> str:
    """The algorithm ``method="auto"`` uses for one call: a CUDA one (``"nccl"`` on an axis with
    transport nccl), or ``"xla"`` when the axis has no communicator. See :func:`explain` and
    :mod:`jax_ub.choice`."""
    c = auto(op, x_shape, w_shape, dtype, axis_name)
    return methods.XLA if c is None else c.method


def auto_method(op: str, x: Any, w: Any, axis_name: Any) -> str:
    """The method ``"auto"`` runs for this traced call: XLA's where the axis is a ``jax.vmap``
    (or pmap) axis or has no communicator (with a warning), else :func:`auto`'s (``"nccl"`` on
    transport nccl: any CUDA method runs the NCCL schedule there)."""
    if not _validate.bound_by_shard_map(axis_name):
        # A jax.vmap (or pmap) axis of that name: XLA's collective over it, no CUDA path.
        _log.debug("auto %s: axis_name %r is a vmap/pmap axis here: xla", op, axis_name)
        _usage.record_auto(op, methods.XLA)
        return methods.XLA
    c = auto(op, tuple(x.shape), tuple(w.shape), x.dtype, axis_name)
    if c is None:
        refuse_reference(methods.PUBLIC_NAME[op], *_no_communicator_why(axis_name))
        comm.warn_no_communicator(methods.PUBLIC_NAME[op], axis_name)
    _log.debug(
        "auto %s %s @ %s: %s",
        op,
        tuple(x.shape),
        tuple(w.shape),
        "xla (no communicator)" if c is None else f"{c.method}: {c.why}",
    )
    chosen = methods.XLA if c is None else methods.DEFAULT[op] if c.method == NCCL_SCHEDULE else c.method
    _usage.record_auto(op, chosen)  # the NCCL schedule: the axis's transport runs it for any CUDA method
    return chosen


def bulk_auto(what: str, axis_name: Any) -> str:
    """What ``"auto"`` runs for a bulk op: the ring schedule where the axis has a communicator
    and is bound by ``shard_map``, else XLA's collective (with a warning)."""
    bound = _validate.bound_by_shard_map(axis_name)
    ok = comm.get(axis_name) is not None and bound
    m = methods.BULK_DEFAULT if ok else methods.XLA
    if not ok:
        if bound:  # a vmap/pmap axis has no CUDA path to miss
            refuse_reference(what, *_no_communicator_why(axis_name))
        comm.warn_no_communicator(what, axis_name)
    _log.debug(
        "jax_ub: %s method 'auto' -> %r (%s)",
        what,
        m,
        "the mesh axis has a communicator" if ok else f"no jax_ub communicator for mesh axis {axis_name!r}",
    )
    return m


# ------------------------------------------------------------------------------------------------
# explain

_LAYOUTS = {methods.AG: ("[..., m, k]", "[k, n_local]"), methods.RS: ("[..., M, k_local]", "[k_local, n]")}


def explain(
    op: str, x: Any, w: Any, axis_name: Any = "tp", *, axis: int = 0, method: str | None = None
) -> str:
    """Says what a call of ``op`` ("ag": :func:`jax_ub.all_gather_matmul`, "rs":
    :func:`jax_ub.matmul_reduce_scatter`) on these operands runs, and why: ``"<what runs>: <why>;
    global MxKxN, tp=T (call x ... @ w ...)"``.

    ``x`` and ``w`` are one device's shards, as the op sees them inside ``shard_map`` (arrays or
    ``jax.ShapeDtypeStruct``): AG x `[..., m, k]` @ w `[k, n_local]`, RS x `[..., M, k_local]` @ w
    `[k_local, n]`; ``axis`` is the op's ``gather_axis``/``scatter_axis``. ``method`` is the call's
    (``None``: ``JAX_UB_METHOD``, as a call without ``method=`` does). ``axis_name``: the op's mesh
    axis. It checks the operands as the op does and raises the op's error where the call would
    fail, as far as it can know the axis: the global shape, tp and the divisibility of an RS input
    need a communicator for ``axis_name`` (``jax_ub.initialize``); without one (the reference path)
    the answer names the local shapes only.
    """
    if op not in methods.DUAL:
        raise ValueError(
            f"explain: op must be {methods.AG!r} (all_gather_matmul) or {methods.RS!r} "
            f"(matmul_reduce_scatter); got {op!r}"
        )
    fn = f"explain({op!r})"
    _validate.check_operands(fn, x, w, *_LAYOUTS[op], abstract_ok=True)
    kw, coll = ("gather_axis", "all-gather") if op == methods.AG else ("scatter_axis", "reduce-scatter")
    axis = _validate.normalize_axis(fn, kw, axis, tuple(x.shape))
    _validate.check_nonempty_axis(fn, kw, axis, tuple(x.shape), coll)
    name = requested(method, fn)
    asked = f"method={method!r}" if method is not None else f"JAX_UB_METHOD={name}"
    _validate.check_axis_name(fn, axis_name)  # as the op checks it
    axis_name = _validate.one_axis(axis_name) or axis_name  # ("tp",) is "tp"
    s = comm.get(axis_name)
    call = f"(call x {_validate.shape_str(tuple(x.shape))} @ w {_validate.shape_str(tuple(w.shape))})"
    if s is not None:
        tp = max(s.world, 1)
        if op == methods.RS:
            _validate.check_divisible(fn, kw, axis, tuple(x.shape), axis_name, tp)
        M, K, N = choice.global_shape(op, tp, tuple(x.shape), tuple(w.shape))
        call = f"; global {M}x{K}x{N}, tp={tp} {call}"
    else:
        call = " " + call
    empty = [_validate.shape_str(tuple(a.shape)) for a in (x, w) if 0 in a.shape]
    if empty:
        return f"xla: zero-size operand {', '.join(empty)} (nothing to overlap: the reference runs){call}"
    runs = method_name(method, fn, warn=False)  # raises as the op does (a CUDA method without the CUDA path)
    if runs == methods.XLA:
        why = (
            "JAX_UB_DISABLE=1 forces the pure-XLA reference path"
            if config.get().disable
            else f"requested ({asked})"
            if name == methods.XLA
            else cuda_status()[1]
        )
        return f"xla: {why}{call}"
    if s is None:
        if _validate.one_axis(axis_name) is None:
            why = f"axis_name {axis_name!r} names several mesh axes, and a jax_ub communicator spans one"
        else:
            why = (
                f"no jax_ub communicator for axis {axis_name!r} (call jax_ub.initialize(mesh, "
                f"axis={axis_name!r}); an axis of size 1 gets none: nothing to communicate)"
            )
        if runs == methods.AUTO:
            refuse_reference(fn, *_no_communicator_why(axis_name))  # as the op would, on a GPU mesh
            return f"xla: {why}{call}"
        raise ValueError(f"{fn}: {asked} needs a jax_ub communicator, and the call would fail: {why}")
    c = auto(op, tuple(x.shape), tuple(w.shape), x.dtype, axis_name)
    assert c is not None  # the axis has a communicator
    if runs == methods.AUTO:
        return f"{c.method}: {c.why}{call}"
    if runs == methods.NCCL and s.transport != "nccl":
        raise ValueError(
            f"{fn}: {asked} needs jax_ub.initialize(mesh, axis={axis_name!r}, "
            f"transport='nccl'); this axis was initialized with transport {s.transport!r}"
        )
    if s.transport == "nccl":
        return f"nccl: requested {runs} ({asked}), but {_NCCL_WHY.format(axis=axis_name)}{call}"
    sched = methods.runs(op, runs)
    return f"{sched}: requested ({asked}){methods.alias_note(op, runs)}; auto would run {c.method}{call}"
