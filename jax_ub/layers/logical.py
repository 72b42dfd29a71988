"""Logical axis names on the parameters of the TP/SP layers (:mod:`jax_ub.layers.params`).

A user's initializer may name a parameter's dims with *logical* names (``"embed"``, ``"mlp"``) that
rules translate to mesh axes, the way each framework does it:

* **linen** — ``nn.with_logical_partitioning(init, names)`` (a ``LogicallyPartitioned`` box);
  rules: the box's ``rules``, else ``nn.logical_axis_rules(...)`` in context; translated by
  ``nn.logical_to_mesh_axes`` (rules in priority order, each mesh axis used once per array). The box
  keeps the logical names, so ``nn.logical_to_mesh_sharding(nn.get_partition_spec(v), mesh, rules)``
  is how the user gets the mesh shardings.
* **NNX** — ``nnx.with_partitioning(init, names, sharding_rules=...)`` and/or
  ``nnx.logical_axis_rules(...)`` in context: ``sharding_rules`` composed with the context's, each
  name looked up, a name without a rule passing through as a mesh axis (``flax.core.spmd``).

The layer splits one dim of each parameter over its TP axis itself; whatever the rules, that dim
must come out as the TP axis and every other dim must not. On the TP dim the user may give a
logical name that the rules map to the TP axis, or ``None``, which the layer fills: NNX with the TP
axis itself (it passes through), linen with the first name the rules map to the TP axis (linen
leaves a name without a rule unsharded, so the axis itself would not do). A name that no rule
covers is refused (and, in NNX, one that is not a mesh axis either), as is a rule that puts the TP
axis on another dim, or a mesh axis that the mesh lacks; each error names the parameter, the dim,
what was expected and what was received.

A rule may map a name to several mesh axes (MaxText's ``("mlp", ("fsdp_transpose", "tensor"))``).
The mesh axes of size 1 in it are ignored; on the dims the layer keeps whole the others stay (FSDP
there is the user's); on the TP dim the TP axis must be among them and every other axis of size 1,
else the rule is refused with those axes' sizes (the layer's collectives run over the TP axis
alone). A linen layer that fills its TP dim picks a name the rules map to the TP axis alone, else
one they map to it and axes of size 1.

In linen a tree mixing mesh names with logical ones breaks: ``nn.logical_to_mesh_sharding`` reads
every name as logical, and ``nn.scan``'s ``"layers"`` name lands in the mesh names. So under
``nn.logical_axis_rules`` the layer boxes the parameters it names itself (a norm's, a plain
initializer's) logically too, where the rules give it a name for the TP axis. NNX has no such
split: a name without a rule is a mesh axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

Rules = tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A parameter's partitioning: ``names`` for its box (logical or mesh names, as the user wrote
    them), ``mesh_names`` the mesh axes they come to, ``rules`` the box's own rules (kept in the
    box), ``logical`` whether ``names`` went through rules."""

    names: tuple[Any, ...]
    mesh_names: tuple[Any, ...]
    rules: Rules | None = None
    logical: bool = False


def context_rules() -> Rules:
    """The rules of ``nn.logical_axis_rules`` / ``nnx.logical_axis_rules`` (one context in Flax)."""
    from flax.core import spmd  # here: the ops do not need flax, only its layers do

    return cast(Rules, tuple(tuple(r) for r in spmd.get_logical_axis_rules() or ()))


def axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one partitioning entry (``None``, an axis, or a tuple of axes)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _keys(rules: Rules) -> list[str]:
    return list(dict.fromkeys(k for k, _ in rules))


def _fmt_rules(rules: Rules) -> str:
    return ", ".join(f"({k!r}, {v!r})" for k, v in rules) or "none"


class _Check:
    """The checks shared by both frameworks, for one parameter."""

    def __init__(
        self,
        where: str,
        param: str,
        layer_names: Sequence[Any],
        axis_name: str,
        mesh_axes: Sequence[str] | None,
        rules: Rules,
        mesh_sizes: Mapping[str, int] | None = None,
    ):
        self.where, self.param = where, param
        self.layer_names = tuple(layer_names)
        self.axis_name = axis_name
        self.mesh_axes = None if mesh_axes is None else tuple(mesh_axes)
        self.sizes = dict(mesh_sizes or {})
        self.rules = rules
        self.tp_dims = [d for d, n in enumerate(self.layer_names) if n == axis_name]

    def head(self, dim: int) -> str:
        role = (
            f"splits over {self.axis_name!r}"
            if dim in self.tp_dims
            else f"keeps whole over {self.axis_name!r}"
        )
        return (
            f"{self.where}: `{self.param}` dim {dim} (which the layer {role}; it names "
            f"`{self.param}` {self.layer_names})"
        )

    def entries(self, user: tuple[Any, ...]) -> tuple[Any, ...]:
        n = len(self.layer_names)
        if len(user) > n:
            raise ValueError(
                f"{self.where}: {self.param}_init's partitioning {user} has {len(user)} entries, "
                f"but `{self.param}` has {n} dims (the layer names it {self.layer_names})."
            )
        return user + (None,) * (n - len(user))

    def mapped(self, dim: int, name: Any, got: Any) -> Any:
        """``name`` (the user's, or the layer's) on ``dim`` came to the mesh entry ``got``: checked,
        and returned as the layer places it. An entry of several mesh axes (MaxText's ``("mlp",
        ("fsdp_transpose", "tensor"))``) is taken where its axes of size 1 are dropped: on the TP
        dim what remains must be the TP axis alone; on the other dims, any axes but the TP one."""
        ax = self.axis_name
        axes = axes_of(got)
        if self.mesh_axes is not None:
            missing = [a for a in axes if a not in self.mesh_axes]
            if missing:
                raise ValueError(
                    f"{self.head(dim)}: {self.param}_init names it {name!r}, which maps to {got!r}, "
                    f"but the mesh has no axis {missing[0]!r} (its axes: {self.mesh_axes}; rules: "
                    f"{_fmt_rules(self.rules)})."
                )
        ones = [a for a in axes if a != ax and self.sizes.get(a) == 1]
        others = [a for a in axes if a != ax and a not in ones]
        if dim in self.tp_dims and ax not in axes:
            raise ValueError(
                f"{self.head(dim)}: expected a logical name that the rules map to {ax!r} (or None, "
                f"which the layer fills); {self.param}_init names it {name!r}, which maps to "
                f"{got!r} (rules: {_fmt_rules(self.rules)})."
            )
        if dim in self.tp_dims and others:
            sizes = ", ".join(f"{a!r}: {self.sizes.get(a, 'unknown (no mesh)')}" for a in others)
            raise ValueError(
                f"{self.head(dim)}: {self.param}_init names it {name!r}, which maps to {got!r}: "
                f"besides {ax!r} that splits the dim over {tuple(others)} (sizes {sizes}), but the "
                f"layer splits it over {ax!r} alone (its all-gather and reduce-scatter run over "
                f"that axis). Axes of size 1 there are ignored. Expected rules that map {name!r} to "
                f"{ax!r} and axes of size 1 only (rules: {_fmt_rules(self.rules)})."
            )
        if dim not in self.tp_dims and ax in axes:
            raise ValueError(
                f"{self.head(dim)}: expected a logical name that the rules map to mesh axes other "
                f"than {ax!r} (e.g. FSDP's) or to None; {self.param}_init names it {name!r}, which "
                f"maps to {got!r} (rules: {_fmt_rules(self.rules)}). The layer places {ax!r} "
                f"itself."
            )
        if not ones:
            return got  # as the rules give it
        if dim in self.tp_dims:
            return ax
        return None if not others else others[0] if len(others) == 1 else tuple(others)

    def unknown(self, dim: int, name: str, extra: str = "") -> None:
        raise ValueError(
            f"{self.head(dim)}: {self.param}_init names it with the logical name {name!r}, which no "
            f"logical axis rule maps{extra} (rules: {_fmt_rules(self.rules)}). Expected one of "
            f"{_keys(self.rules)}; to keep the dim whole, add the rule ({name!r}, None) or give "
            f"None."
        )


def resolve_nnx(
    where: str,
    param: str,
    layer_names: Sequence[Any],
    user: Sequence[Any],
    box_rules: Rules | None,
    axis_name: str,
    mesh_axes: Sequence[str] | None,
    merge: Callable[[tuple[Any, ...]], tuple[Any, ...]],
    mesh_sizes: Mapping[str, int] | None = None,
) -> Resolved:
    """NNX: ``user`` names translated with the box's ``sharding_rules`` composed with the context's.

    Names that are no rule's pass through as mesh axes; with no name a rule's, ``merge`` (the mesh
    name merge of :mod:`jax_ub.layers.params`, with its own messages) decides the names.
    """
    from flax.core import spmd

    local = tuple(tuple(r) for r in box_rules or ())
    try:
        rules = tuple(spmd.composite_rules(context_rules(), local))
    except ValueError as e:
        raise ValueError(
            f"{where}: {param}_init's sharding_rules disagree with the context's "
            f"`nnx.logical_axis_rules`: {e}."
        ) from e
    check = _Check(where, param, layer_names, axis_name, mesh_axes, rules, mesh_sizes)
    user = check.entries(tuple(user))
    keys = set(_keys(rules))
    logical = bool(local) or any(isinstance(n, str) and n in keys for n in user)
    if not logical:
        names = merge(user)
    else:
        for dim, name in enumerate(user):
            if (
                isinstance(name, str)
                and name not in keys
                and check.mesh_axes is not None
                and name not in check.mesh_axes
            ):
                check.unknown(dim, name, f" and which is not a mesh axis {check.mesh_axes}")
        names = tuple(axis_name if d in check.tp_dims and n is None else n for d, n in enumerate(user))
    got = tuple(spmd.from_sharding_rules(names, rules)) if rules else names
    mesh_names = tuple(check.mapped(d, n, g) for d, (n, g) in enumerate(zip(names, got, strict=True)))
    return Resolved(names, mesh_names, local or None, logical)


def _tp_rule_name(
    rules: Rules, axis_name: str, taken: Sequence[Any] = (), sizes: Mapping[str, int] | None = None
) -> str | None:
    """The first name (not in ``taken``) that ``rules`` map to ``axis_name`` alone, else the first
    they map to ``axis_name`` and axes of size 1 (``sizes``; MaxText's ``("mlp",
    ("fsdp_transpose", "tensor"))`` with an ``fsdp_transpose`` of size 1), else the first they map
    to ``axis_name`` among others (:meth:`_Check.mapped` then says why that cannot be)."""
    free = [(k, axes_of(v)) for k, v in rules if k not in taken and axis_name in axes_of(v)]
    sizes = sizes or {}
    for ok in (
        lambda axes: axes == (axis_name,),
        lambda axes: all(a == axis_name or sizes.get(a) == 1 for a in axes),
        lambda axes: True,
    ):
        pick = next((k for k, axes in free if ok(axes)), None)
        if pick is not None:
            return pick
    return None


def linen_rules_cover(layer_names: Sequence[Any], axis_name: str) -> bool:
    """linen: whether the layer boxes a parameter it names itself with logical names: rules are
    in context and, if it has a TP dim, one of them maps a name to ``axis_name`` (alone or with
    other mesh axes)."""
    rules = context_rules()
    return bool(rules) and (axis_name not in layer_names or _tp_rule_name(rules, axis_name) is not None)


def resolve_linen(
    where: str,
    param: str,
    layer_names: Sequence[Any],
    user: Sequence[Any],
    box_rules: Rules | None,
    axis_name: str,
    mesh_axes: Sequence[str] | None,
    mesh_sizes: Mapping[str, int] | None = None,
) -> Resolved:
    """linen: logical ``user`` names translated as ``nn.logical_to_mesh_axes`` does, with the box's
    ``rules`` or else the context's; the TP dim left ``None`` takes the first name that the rules
    map to ``axis_name``."""
    import flax.linen as nn

    rules = tuple(tuple(r) for r in box_rules) if box_rules else context_rules()
    check = _Check(where, param, layer_names, axis_name, mesh_axes, rules, mesh_sizes)
    user = check.entries(tuple(user))
    if not rules:
        raise ValueError(
            f"{where}: {param}_init gives `{param}` the logical names {user}, but there are no "
            f"logical axis rules to map them to mesh axes: expected `nn.logical_axis_rules(rules)` "
            f"around `init` (or `rules=` on `nn.with_logical_partitioning`); received none."
        )
    keys = _keys(rules)
    for dim, name in enumerate(user):
        if isinstance(name, str) and name not in keys:
            check.unknown(dim, name)
    names = list(user)
    for dim in check.tp_dims:
        if names[dim] is None:
            pick = _tp_rule_name(rules, axis_name, names, mesh_sizes)
            if pick is None:
                raise ValueError(
                    f"{check.head(dim)}: {param}_init leaves it None, and no logical axis rule maps "
                    f"a name to {axis_name!r} for the layer to put there (rules: "
                    f"{_fmt_rules(rules)}). Expected a rule such as ('mlp', {axis_name!r}), or a "
                    f"logical name on that dim that maps to {axis_name!r}."
                )
            names[dim] = pick
    try:
        spec = nn.logical_to_mesh_axes(tuple(names), rules)  # a PartitionSpec: names are given
        got = tuple(cast(Any, spec))
    except ValueError as e:
        raise ValueError(f"{where}: {param}_init's logical names {tuple(names)}: {e}") from e
    mesh_names = tuple(check.mapped(d, n, g) for d, (n, g) in enumerate(zip(names, got, strict=True)))
    return Resolved(tuple(names), mesh_names, tuple(box_rules) if box_rules else None, True)
