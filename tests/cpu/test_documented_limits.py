"""CPU tier: limits the documentation states, held to the code: the options a layer does not take,
multicast, and forward-mode differentiation. The statements are looked for in README.md and
docs/*.md together, so that they may move between those pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from flax import nnx

import jax_ub
from jax_ub import nn as ubnn

REPO = Path(__file__).resolve().parents[2]


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _text() -> str:
    return " ".join(" ".join(p.read_text().split()) for p in _pages())


def test_row_parallel_dense_docstring_says_no_recompute_gathered():
    doc = ubnn.RowParallelDense.__doc__
    assert "except ``recompute_gathered``, which this layer does not" in doc, doc
    with pytest.raises(TypeError, match="recompute_gathered"):
        ubnn.RowParallelDense(8, 4, recompute_gathered=True, rngs=nnx.Rngs(0))


def test_the_multicast_setting_is_documented_as_doing_nothing():
    rows = [
        ln for p in _pages() for ln in p.read_text().splitlines() if ln.startswith("| `JAX_UB_MULTICAST`")
    ]
    assert rows, "no page has a JAX_UB_MULTICAST row"
    assert all(re.search(r"does nothing|ignored", row) for row in rows), rows


def test_forward_mode_is_documented_as_reference_path_only():
    text = _text()
    assert "forward mode (`jax.jvp`, `jax.jacfwd`, `jax.hessian`) works only on the reference path" in text
    assert "the CUDA path is a `jax.custom_vjp`, reverse mode only" in text
    doc = " ".join(jax_ub.all_gather_matmul.__doc__.split())
    assert "forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) only on the reference path" in doc
