"""Jaxpr helpers shared by the CPU tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def dot_precisions(jaxpr: Any) -> Iterator[Any]:
    """The ``precision`` of every ``dot_general`` in ``jaxpr``, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn.params["precision"]
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from dot_precisions(inner)
