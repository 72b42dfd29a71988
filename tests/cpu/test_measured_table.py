"""CPU tier: the table ``method="auto"`` chooses from, shipped as package data
(``jax_ub/data/measured.json``, read by ``jax_ub._measured``).

``data/auto_choices.json`` holds, for every shape the shipped table records (op, tp, dtype, M, K,
N), the method ``auto`` resolved to (``method``; ``auto_chain``: with ``JAX_UB_AUTO_CHAIN=1``). It
was produced from the generated Python table (``jax_ub/_measured.py`` as it was before the table
became package data) and is a regression oracle for the move: the package-data table must choose
exactly as that table did. It is not a statement of which method is best: a new bench record that
changes a choice regenerates ``measured.json`` (``python tools/measured_table.py``) and this
fixture with it, in the same commit.
"""

from __future__ import annotations

import importlib.util
import json
from importlib import resources
from pathlib import Path

import pytest

from jax_ub import _measured, choice

ROOT = Path(__file__).resolve().parents[2]
ORACLE = json.loads((Path(__file__).parent / "data" / "auto_choices.json").read_text())


def _tool():
    spec = importlib.util.spec_from_file_location("measured_table", ROOT / "tools" / "measured_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _id(row: dict) -> str:
    return f"{row['op']}-tp{row['tp']}-{row['dtype']}-{row['M']}x{row['K']}x{row['N']}"


def test_the_oracle_covers_every_shape_the_table_records():
    ops = {v: k for k, v in choice.BENCH_OP.items()}
    recorded = {
        (ops[r["op"]], r["tp"], r["dtype"], r["M"], r["K"], r["N"])
        for d in _measured.DOCS
        for r in d["records"]
    }
    oracle = {(r["op"], r["tp"], r["dtype"], r["M"], r["K"], r["N"]) for r in ORACLE}
    assert recorded == oracle


@pytest.mark.parametrize("row", ORACLE, ids=_id)
def test_auto_chooses_as_the_generated_table_did(row):
    shape = (row["op"], row["tp"], row["dtype"], row["M"], row["K"], row["N"])
    assert choice.choose(*shape, "", auto_chain=False).method == row["method"]
    assert choice.choose(*shape, "", auto_chain=True).method == row["auto_chain"]


def test_the_loader_reads_the_package_data():
    data = json.loads(resources.files("jax_ub").joinpath("data/measured.json").read_text())
    docs = data["docs"]
    assert docs == _measured.DOCS and docs == _measured.load()
    assert all(choice.shapes_from_bench(d) for d in _measured.DOCS), "a document with no usable shape"


def test_measured_json_is_generated_from_the_committed_records():
    """``jax_ub/data/measured.json`` is exactly what ``tools/measured_table.py`` makes of
    ``benchmarks/records``: a new record that is not regenerated into the table fails here."""
    tool = _tool()
    sources = tool.default_sources()
    assert sources, "no bench records committed"
    assert (ROOT / "jax_ub" / "data" / "measured.json").read_text() == tool.render(sources)
    assert tool.main(["--check"]) == 0
