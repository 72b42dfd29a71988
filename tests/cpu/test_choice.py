"""method="auto": the choice comes from bench records (shipped, or JAX_UB_TUNING_FILE), not from
hand-written thresholds."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from jax_ub import _measured, choice, comm, config, ops, overlap

ROOT = Path(__file__).resolve().parents[2]


def _doc(rows, machine="4xTest_GPU"):
    """A bench JSON document: rows of (op, tp, M, K, N, {method: ms})."""
    recs = []
    for op, tp, M, K, N, times in rows:
        times = {**times, "xla": times.get("xla", 9.0)}  # xla_plain: slow unless a row says otherwise
        for m, ms in times.items():
            recs.append({"op": op, "tp": tp, "dtype": "bfloat16", "M": M, "K": K, "N": N,
                         "impl": "xla_plain" if m == "xla" else f"jax_ub_{m}", "ms": ms})
    return {"machine": machine, "date": "20261122", "records": recs}


@pytest.fixture
def tuning(tmp_path):
    def write(doc):
        p = tmp_path / "mine-rs.json"
        p.write_text(json.dumps(doc))
        choice._tables.cache_clear()
        return str(p)

    yield write
    choice._tables.cache_clear()


def test_shipped_table_is_generated_from_the_committed_results():
    """jax_ub/_measured.py is exactly what scripts/measured_table.py makes of benchmarks/results:
    a new bench record that is not regenerated into the table fails here."""
    files = sorted((ROOT / "benchmarks" / "results").glob("*-ag.json"))
    files += sorted((ROOT / "benchmarks" / "results").glob("*-rs.json"))
    assert files, "no bench results committed"
    docs = [json.loads(p.read_text()) for p in sorted(files, key=str)]
    assert (ROOT / "jax_ub" / "_measured.py").read_text() == choice.render(docs)
    assert _measured.DOCS, "the shipped table is empty"


def test_fastest_method_at_the_measured_shape(tuning):
    f = tuning(_doc([("gemm_rs", 4, 8192, 8192, 28672, {"ring": 1.70, "pipeline": 1.75, "chain": 1.45}),
                     ("gemm_rs", 4, 8192, 8192, 8192, {"ring": 0.59, "pipeline": 0.50, "chain": 0.55})]))
    assert choice.choose("rs", 4, "bfloat16", 8192, 8192, 28672, f).method == "chain"
    assert choice.choose("rs", 4, "bfloat16", 8192, 8192, 8192, f).method == "pipeline"
    # Nearest shape in log distance: 7000x8192x26000 is near the first.
    c = choice.choose("rs", 4, "bfloat16", 7000, 8192, 26000, f)
    assert c.method == "chain" and "8192x8192x28672" in c.why and "your tuning file" in c.why


def test_near_ties_go_to_the_first_method_in_order(tuning):
    f = tuning(_doc([("gemm_rs", 4, 4096, 4096, 4096, {"chain": 1.000, "ring": 1.015, "pipeline": 1.2})]))
    c = choice.choose("rs", 4, "bfloat16", 4096, 4096, 4096, f)
    assert c.method == "ring", c  # chain is faster by 1.5%: within the 2% tie
    f = tuning(_doc([("gemm_rs", 4, 4096, 4096, 4096, {"chain": 1.000, "ring": 1.05, "pipeline": 1.2})]))
    assert choice.choose("rs", 4, "bfloat16", 4096, 4096, 4096, f).method == "chain"


def test_nearest_group_size_first(tuning):
    f = tuning(_doc([("gemm_rs", 2, 8192, 8192, 28672, {"ring": 1.0, "pipeline": 2.0}),
                     ("gemm_rs", 4, 1024, 1024, 1024, {"ring": 2.0, "pipeline": 1.0})]))
    # tp 4: only the tp-4 record counts, however far its shape.
    assert choice.choose("rs", 4, "bfloat16", 8192, 8192, 28672, f).method == "pipeline"
    assert choice.choose("rs", 2, "bfloat16", 1024, 1024, 1024, f).method == "ring"
    assert choice.choose("rs", 3, "bfloat16", 1024, 1024, 1024, f).method in ("ring", "pipeline")


def test_own_file_first_then_shipped(tuning):
    f = tuning(_doc([("gemm_rs", 4, 8192, 8192, 28672, {"ring": 2.0, "chain": 1.0})]))
    assert choice.choose("rs", 4, "bfloat16", 8192, 8192, 28672, f).method == "chain"
    # The file has no AG records: the shipped ones decide.
    c = choice.choose("ag", 4, "bfloat16", 8192, 8192, 28672, f)
    assert c.method in choice.METHODS["ag"] and "jax_ub's measurements" in c.why


def test_bad_tuning_file_says_what_is_wrong(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"JAX_UB_TUNING_FILE .*cannot read a bench JSON"):
        choice.load_bench_file(str(bad))
    one = {"op": "gemm_rs", "tp": 2, "dtype": "bfloat16", "M": 64, "K": 64, "N": 64, "ms": 1.0}
    bad.write_text(json.dumps({"records": [{**one, "impl": "xla_plain"}, {**one, "impl": "jax_ub"},
                                           {**one, "impl": "xla_windowed"}]}))
    with pytest.raises(ValueError, match="no ag_gemm/gemm_rs records with two or more methods"):
        choice.load_bench_file(str(bad))


def test_xla_only_where_it_measured_faster_than_every_algorithm(tuning):
    """xla_plain records are a candidate too ("xla"): auto runs XLA's own path where it measured
    faster than every CUDA algorithm by more than the tie, and an algorithm otherwise."""
    f = tuning(_doc([("gemm_rs", 2, 16384, 1024, 1024, {"ring": 0.148, "chain": 0.152, "xla": 0.139}),
                     ("gemm_rs", 2, 8192, 8192, 8192, {"ring": 0.90, "chain": 0.95, "xla": 0.89})]))
    c = choice.choose("rs", 2, "bfloat16", 16384, 1024, 1024, f)
    assert c.method == "xla" and "xla 0.139" in c.why, c
    assert choice.choose("rs", 2, "bfloat16", 8192, 8192, 8192, f).method == "ring"  # within 2%


def test_global_shape_of_a_call(monkeypatch, tuning):
    """auto names a call by the bench's global (M, K, N): AG x[M/tp, K] @ w[K, N/tp], RS
    x[M, K/tp] @ w[K/tp, N] (leading batch dims fold into M)."""
    f = tuning(_doc([("ag_gemm", 4, 8192, 8192, 28672, {"push": 2.0, "ring": 1.0}),
                     ("ag_gemm", 4, 512, 512, 512, {"push": 1.0, "ring": 2.0}),
                     ("gemm_rs", 4, 8192, 8192, 28672, {"ring": 2.0, "chain": 1.0}),
                     ("gemm_rs", 4, 512, 512, 512, {"ring": 1.0, "chain": 2.0})]))
    monkeypatch.setattr(comm, "get", lambda axis: types.SimpleNamespace(world=4))
    with config.override(tuning_file=f):
        assert overlap.choose(ops.AG, (2048, 8192), (8192, 7168), "bfloat16", "tp") == "ring"
        assert overlap.choose(ops.AG, (2, 1024, 8192), (8192, 7168), "bfloat16", "tp") == "ring"
        assert overlap.choose(ops.RS, (8192, 2048), (2048, 28672), "bfloat16", "tp") == "chain"
        assert overlap.choose(ops.RS, (512, 128), (128, 512), "bfloat16", "tp") == "ring"
    monkeypatch.setattr(comm, "get", lambda axis: None)
    assert overlap.choose(ops.RS, (512, 128), (128, 512), "bfloat16", "tp") == "xla"


def test_same_shape_on_two_machines_prefers_the_wider_comparison(tmp_path):
    a = _doc([("gemm_rs", 2, 4096, 4096, 4096, {"ring": 1.0, "pipeline": 1.1})], machine="0xOld")
    b = _doc([("gemm_rs", 2, 4096, 4096, 4096, {"ring": 1.0, "pipeline": 1.1, "chain": 0.8})],
             machine="9xNew")
    shapes = choice.shapes_from_bench(a) + choice.shapes_from_bench(b)
    s = choice.pick(shapes, "rs", 2, "bfloat16", 4096, 4096, 4096)
    assert s is not None and s.source.startswith("9xNew") and s.ms[0] == ("chain", 0.8)


@pytest.mark.parametrize("key", ["tp", "dtype", "M", "K", "N", "ms"])
def test_tuning_file_record_without_a_field_names_file_record_and_key(key, tuning):
    doc = _doc([("ag_gemm", 4, 1024, 1024, 1024, {"push": 1.0, "ring": 1.1})])
    del doc["records"][1][key]  # record 1: jax_ub_ring
    f = tuning(doc)
    with pytest.raises(ValueError) as info:
        choice.choose("ag", 4, "bfloat16", 1024, 1024, 1024, f)
    msg = str(info.value)
    assert msg.startswith(f"JAX_UB_TUNING_FILE {f!r}: record 1 (ag_gemm jax_ub_ring) has no {key!r}"), msg


def test_tuning_file_record_with_a_non_integer_shape(tuning):
    doc = _doc([("gemm_rs", 4, 1024, 1024, 1024, {"ring": 1.0, "chain": 1.1})])
    doc["records"][0]["M"] = "big"
    f = tuning(doc)
    with pytest.raises(ValueError, match=r"record 0 \(gemm_rs jax_ub_ring\): tp, M, K, N must be integers"):
        choice.choose("rs", 4, "bfloat16", 1024, 1024, 1024, f)
