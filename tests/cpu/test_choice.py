"""method="auto": the choice comes from bench records (shipped, or JAX_UB_TUNING_FILE), not from
hand-written thresholds."""

from __future__ import annotations

import json
import logging
import random
import re
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
        p.write_text(json.dumps(doc))  # read again by choose: no cache to clear
        return str(p)

    yield write
    choice._forget_agreed()


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
    f = tuning(_doc([("gemm_rs", 4, 8192, 8192, 28672, {"ring": 1.70, "pipeline": 1.75, "columns": 1.45}),
                     ("gemm_rs", 4, 8192, 8192, 8192, {"ring": 0.59, "pipeline": 0.50, "columns": 0.55})]))
    assert choice.choose("rs", 4, "bfloat16", 8192, 8192, 28672, f).method == "columns"
    assert choice.choose("rs", 4, "bfloat16", 8192, 8192, 8192, f).method == "pipeline"
    # Nearest shape in log distance: 7000x8192x26000 is near the first.
    c = choice.choose("rs", 4, "bfloat16", 7000, 8192, 26000, f)
    assert c.method == "columns" and "8192x8192x28672" in c.why and "your tuning file" in c.why


def test_near_ties_go_to_the_first_method_in_order(tuning):
    f = tuning(_doc([("gemm_rs", 4, 4096, 4096, 4096, {"columns": 1.000, "ring": 1.015, "pipeline": 1.2})]))
    c = choice.choose("rs", 4, "bfloat16", 4096, 4096, 4096, f)
    assert c.method == "ring", c  # columns is faster by 1.5%: within the 2% tie
    f = tuning(_doc([("gemm_rs", 4, 4096, 4096, 4096, {"columns": 1.000, "ring": 1.05, "pipeline": 1.2})]))
    assert choice.choose("rs", 4, "bfloat16", 4096, 4096, 4096, f).method == "columns"


def test_nearest_group_size_first(tuning):
    f = tuning(_doc([("gemm_rs", 2, 8192, 8192, 28672, {"ring": 1.0, "pipeline": 2.0}),
                     ("gemm_rs", 4, 1024, 1024, 1024, {"ring": 2.0, "pipeline": 1.0})]))
    # tp 4: only the tp-4 record counts, however far its shape.
    assert choice.choose("rs", 4, "bfloat16", 8192, 8192, 28672, f).method == "pipeline"
    assert choice.choose("rs", 2, "bfloat16", 1024, 1024, 1024, f).method == "ring"
    # tp 3: the group size nearest in ratio is 4 (4/3 < 3/2), though the tp-2 shape is the same.
    c = choice.choose("rs", 3, "bfloat16", 1024, 1024, 1024, f)
    assert c.method == "pipeline" and "tp4" in c.why, c


def test_own_file_first_then_shipped(tuning):
    f = tuning(_doc([("gemm_rs", 4, 8192, 8192, 28672, {"ring": 2.0, "columns": 1.0})]))
    assert choice.choose("rs", 4, "bfloat16", 8192, 8192, 28672, f).method == "columns"
    # The file has no AG records: the shipped ones decide.
    c = choice.choose("ag", 4, "bfloat16", 8192, 8192, 28672, f)
    shipped = choice.choose("ag", 4, "bfloat16", 8192, 8192, 28672)
    assert (c.method, c.why) == (shipped.method, shipped.why) and "jax_ub's measurements" in c.why


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
                     ("gemm_rs", 4, 8192, 8192, 28672, {"ring": 2.0, "columns": 1.0}),
                     ("gemm_rs", 4, 512, 512, 512, {"ring": 1.0, "columns": 2.0})]))
    monkeypatch.setattr(comm, "get", lambda axis: types.SimpleNamespace(world=4, transport="ipc"))
    with config.override(tuning_file=f):
        assert overlap.choose(ops.AG, (2048, 8192), (8192, 7168), "bfloat16", "tp") == "ring"
        assert overlap.choose(ops.AG, (2, 1024, 8192), (8192, 7168), "bfloat16", "tp") == "ring"
        assert overlap.choose(ops.RS, (8192, 2048), (2048, 28672), "bfloat16", "tp") == "columns"
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
    with pytest.raises(ValueError, match=r"record 0 \(gemm_rs jax_ub_ring\): M must be a positive integer; got 'big'"):
        choice.choose("rs", 4, "bfloat16", 1024, 1024, 1024, f)


# ------------------------------------------------------------------------------------------------
# Your tuning file counts where it measured the call's tp and dtype; elsewhere the shipped table's
# exact match, then the nearest of both (review finding 1).


def test_a_file_of_another_tp_or_dtype_does_not_override_the_shipped_exact_match(tuning):
    shipped_ag = choice.choose("ag", 4, "bfloat16", 8192, 8192, 8192).method
    slow = {m: 9.0 for m in choice.METHODS["ag"] if m not in ("xla", shipped_ag)}
    # The file says another method is fastest, measured at tp=2 only.
    f = tuning(_doc([("ag_gemm", 2, 8192, 8192, 8192, {**slow, shipped_ag: 20.0})], machine="2xOther"))
    c = choice.choose("ag", 4, "bfloat16", 8192, 8192, 8192, f)
    assert c.method == shipped_ag and "jax_ub's measurements" in c.why, c
    assert "your tuning file has no ag tp4 bfloat16 measurement" in c.why, c
    # At the file's own tp it decides, however far the shape (and says how far).
    c = choice.choose("ag", 2, "bfloat16", 512, 1024, 1024, f)
    assert c.method != shipped_ag and "your tuning file" in c.why, c
    assert "the nearest measurement is far from this call (M 16x)" in c.why, c


def test_a_float32_file_does_not_decide_bfloat16_calls(tuning):
    doc = _doc([("gemm_rs", 4, 8192, 8192, 8192, {"ring": 2.0, "pipeline": 2.0, "xla": 1.0})])
    for r in doc["records"]:
        r["dtype"] = "float32"
    f = tuning(doc)
    assert choice.choose("rs", 4, "float32", 8192, 8192, 8192, f).method == "xla"
    c = choice.choose("rs", 4, "bfloat16", 8192, 8192, 8192, f)
    assert c.method == choice.choose("rs", 4, "bfloat16", 8192, 8192, 8192).method != "xla", c
    assert "your tuning file has no rs tp4 bfloat16 measurement" in c.why, c


def test_without_an_exact_measurement_the_nearest_of_both_tables_and_why_says_so(tuning):
    f = tuning(_doc([("ag_gemm", 8, 8192, 8192, 8192, {"push": 2.0, "all_peer": 1.0})]))
    c = choice.choose("ag", 16, "bfloat16", 8192, 8192, 8192, f)  # tp 8 (the file) is nearest to 16
    assert c.method == "all_peer" and "your tuning file" in c.why, c
    assert "no ag tp16 bfloat16 measurement in the tables: the nearest tp8" in c.why, c
    c = choice.choose("ag", 3, "bfloat16", 8192, 8192, 8192, f)  # tp 2 and 4 (shipped) are nearer
    assert "jax_ub's measurements" in c.why and "no ag tp3 bfloat16 measurement" in c.why, c


def test_one_shape_measured_twice_goes_to_the_newest_measurement(tmp_path):
    """Not to the machine name that sorts first (review finding 14)."""
    old = _doc([("gemm_rs", 2, 4096, 4096, 4096, {"ring": 1.0, "pipeline": 1.1})], machine="0xOld")
    new = _doc([("gemm_rs", 2, 4096, 4096, 4096, {"ring": 1.1, "pipeline": 1.0})], machine="9xNew")
    new["date"] = "20270101"
    for docs in ([old, new], [new, old]):
        shapes = [s for d in docs for s in choice.shapes_from_bench(d)]
        s = choice.pick(shapes, "rs", 2, "bfloat16", 4096, 4096, 4096)
        assert s is not None and s.source == "9xNew 20270101" and s.ms[0] == ("pipeline", 1.0), s


# ------------------------------------------------------------------------------------------------
# chain sums partials in the op's dtype: not auto's at tp >= 3 in bf16/f16 unless asked (finding 19)


def test_auto_runs_chain_at_tp3_and_more_in_bf16_only_when_asked(tuning):
    f = tuning(_doc([("gemm_rs", 4, 8192, 8192, 8192, {"ring": 1.00, "pipeline": 1.10, "chain": 0.80}),
                     ("gemm_rs", 2, 8192, 8192, 8192, {"ring": 1.00, "pipeline": 1.10, "chain": 0.80})]))
    c = choice.choose("rs", 4, "bfloat16", 8192, 8192, 8192, f)
    assert c.method == "ring", c
    assert "not chain: it sums the partials in bfloat16 at tp=4" in c.why and "JAX_UB_AUTO_CHAIN=1" in c.why, c
    assert choice.choose("rs", 8, "bfloat16", 8192, 8192, 8192, f).method == "ring"  # judged by tp 4
    assert choice.choose("rs", 2, "bfloat16", 8192, 8192, 8192, f).method == "chain"  # one hop
    with config.override(auto_chain=True):
        c = choice.choose("rs", 4, "bfloat16", 8192, 8192, 8192, f)
    assert c.method == "chain" and "chain sums the partials in bfloat16 at tp=4" in c.why, c
    # In float32 the partial sums lose nothing to the fp32 sum of the others: chain like any method.
    doc = _doc([("gemm_rs", 4, 8192, 8192, 8192, {"ring": 1.00, "chain": 0.80})])
    for r in doc["records"]:
        r["dtype"] = "float32"
    c = choice.choose("rs", 4, "float32", 8192, 8192, 8192, tuning(doc))
    assert c.method == "chain" and "sums the partials" not in c.why, c


# ------------------------------------------------------------------------------------------------
# What every process agrees on, and what auto reads afterwards (finding 3)


def _ring_faster(times: float):
    """The shipped table as another checkout of the same version might have it: the ag ring times
    divided by ``times``."""
    docs = []
    for d in _measured.DOCS:
        recs = [dict(r, ms=r["ms"] / times) if (r["op"], r["impl"]) == ("ag_gemm", "jax_ub_ring") else r
                for r in d["records"]]
        docs.append(dict(d, records=recs))
    return docs


def test_the_agreement_covers_the_shipped_table(monkeypatch):
    before = choice.agreement("", False)
    try:
        monkeypatch.setattr(_measured, "DOCS", _ring_faster(3))
        choice._shipped.cache_clear()
        after = choice.agreement("", False)
        assert choice.choose("ag", 2, "bfloat16", 8192, 8192, 8192).method == "ring"
    finally:
        monkeypatch.undo()
        choice._shipped.cache_clear()
        choice._forget_agreed()
    assert before != after, (before, after)
    assert choice.choose("ag", 2, "bfloat16", 8192, 8192, 8192).method != "ring"


def test_the_agreement_is_on_what_a_tuning_file_says_not_its_bytes_or_name(tmp_path):
    doc = _doc([("gemm_rs", 4, 4096, 4096, 4096, {"ring": 1.0, "columns": 0.5})])
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(doc))
    b.write_text(json.dumps(doc, indent=4))  # another rank's copy, formatted otherwise
    c.write_text(json.dumps(_doc([("gemm_rs", 4, 4096, 4096, 4096, {"ring": 0.5, "columns": 1.0})])))
    try:
        fields = {p.name: choice.agreement(str(p), False) for p in (a, b, c)}
        assert fields["a.json"] == fields["b.json"] != fields["c.json"], fields
        assert choice.agreement(str(a), True) != fields["a.json"]
    finally:
        choice._forget_agreed()


def test_auto_reads_the_tables_agreed_at_initialize_and_says_when_the_file_changed(tmp_path, caplog):
    f = tmp_path / "t.json"
    f.write_text(json.dumps(_doc([("gemm_rs", 4, 4096, 4096, 4096, {"ring": 1.0, "columns": 0.5})])))
    try:
        choice.agreement(str(f), False)  # what initialize agrees on
        f.write_text(json.dumps(_doc([("gemm_rs", 4, 4096, 4096, 4096, {"ring": 0.5, "columns": 1.0})])))
        with caplog.at_level(logging.WARNING, logger="jax_ub"):
            for _ in range(2):
                assert choice.choose("rs", 4, "bfloat16", 4096, 4096, 4096, str(f)).method == "columns"
        (rec,) = [r for r in caplog.records if "changed since jax_ub.initialize" in r.getMessage()]
        assert str(f) in rec.getMessage()
        # Without an agreement (one process), the file is read as it is now.
        choice._forget_agreed()
        assert choice.choose("rs", 4, "bfloat16", 4096, 4096, 4096, str(f)).method == "ring"
    finally:
        choice._forget_agreed()


def test_a_rewritten_tuning_file_is_read_again(tmp_path):
    """Same path, same size, rewritten at once (as bench tune rewrites its output): not a cached
    old content (finding 4)."""
    f = tmp_path / "t.json"
    for fast in ("push", "all_peer", "ring"):
        times = {m: (0.3 if m == fast else 0.5) for m in ("push", "ring", "all_peer")}
        f.write_text(json.dumps(_doc([("ag_gemm", 2, 8192, 8192, 8192, times)])))
        assert choice.choose("ag", 2, "bfloat16", 8192, 8192, 8192, str(f)).method == fast


# ------------------------------------------------------------------------------------------------
# A malformed tuning file: a ValueError naming the file, the record and the field (finding 5)


def _one(**change):
    doc = _doc([("ag_gemm", 2, 1024, 1024, 1024, {"push": 1.0, "ring": 1.1})])
    doc["records"][1].update(change)  # record 1: jax_ub_ring
    return doc


@pytest.mark.parametrize("doc, message", [
    ([1, 2], 'a bench JSON must be an object {"machine", "date", "records": [...]}; got a JSON array'),
    ({"machine": "m", "records": None}, "'records' must be a list of bench records; got a JSON null"),
    ({"machine": "m", "records": {"a": 1}}, "'records' must be a list of bench records; got a JSON object"),
    ({"machine": "m"}, "'records' must be a list of bench records; got no 'records'"),
    ({"records": [[1, 2, 3]]}, "record 0 must be an object; got [1, 2, 3]"),
    (_one(tp=0), "record 1 (ag_gemm jax_ub_ring): tp must be a positive integer; got 0"),
    (_one(M=-8), "record 1 (ag_gemm jax_ub_ring): M must be a positive integer; got -8"),
    (_one(K=1024.5), "record 1 (ag_gemm jax_ub_ring): K must be a positive integer; got 1024.5"),
    (_one(N=True), "record 1 (ag_gemm jax_ub_ring): N must be a positive integer; got True"),
    (_one(dtype="bf16"), "record 1 (ag_gemm jax_ub_ring): dtype must be one of bfloat16, float16, float32; "
                         "got 'bf16'"),
    (_one(dtype="int8"), "dtype must be one of bfloat16, float16, float32; got 'int8'"),
    (_one(ms="0.5"), "record 1 (ag_gemm jax_ub_ring): ms must be a number (median milliseconds); got '0.5'"),
    ({"jax_ub_shapes": 1, "shapes": []}, "is a shapes file (the shapes a program ran, jax_ub.tuning), not "
                                         "measurements: measure them with `python -m jax_ub.bench tune"),
], ids=["list", "records-null", "records-object", "no-records", "record-list", "tp0", "M<0", "K-fraction",
        "N-bool", "dtype-alias", "dtype-int8", "ms-string", "shapes-file"])
def test_a_malformed_tuning_file_names_file_record_field_and_value(doc, message, tuning):
    f = tuning(doc)
    with pytest.raises(ValueError) as info:
        choice.choose("ag", 2, "bfloat16", 1024, 1024, 1024, f)
    msg = str(info.value)
    assert msg.startswith(f"JAX_UB_TUNING_FILE {f!r}") and message in msg, msg


# ------------------------------------------------------------------------------------------------
# Where a tuning file comes from (finding 6)


def test_a_tuning_file_from_other_gpus_or_another_version_is_named_in_warnings(tuning, monkeypatch, caplog):
    doc = _doc([("ag_gemm", 4, 1024, 1024, 1024, {"push": 1.0, "ring": 1.1, "bidir": 0.9})],
               machine="4xNVIDIA_H100_80GB_HBM3")
    doc["records"][2]["impl"] = "jax_ub_bidir"  # a method of another jax_ub
    doc["jax_ub"] = "0.0.1"
    f = tuning(doc)
    monkeypatch.setattr(choice, "_local_device_kind", lambda: "NVIDIA_H200")
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        for _ in range(3):  # once per content, not per traced op
            assert choice.choose("ag", 4, "bfloat16", 1024, 1024, 1024, f).method == "push"
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 3, msgs
    assert any("measured on NVIDIA_H100_80GB_HBM3 GPUs, and this process runs on NVIDIA_H200" in m for m in msgs)
    assert any(f"written by jax_ub 0.0.1, and this is jax_ub {jax_ub_version()}" in m for m in msgs)
    assert any("records of methods this jax_ub does not know are ignored: ag bidir" in m for m in msgs)
    assert all(m.startswith(f"jax_ub: JAX_UB_TUNING_FILE {f!r}: ") for m in msgs)
    # The same GPUs and version: nothing to say (device_kind as the bench now writes it).
    doc = _doc([("ag_gemm", 4, 1024, 1024, 1024, {"push": 1.0, "ring": 1.1})], machine="box")
    doc.update(device_kind="NVIDIA H200", jax_ub=jax_ub_version())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        choice.load_bench_file(tuning(doc))
    assert not caplog.records


def jax_ub_version() -> str:
    import jax_ub

    return jax_ub.__version__


@pytest.mark.parametrize("how", ["rewritten", "deleted"])
def test_a_file_broken_after_an_agreement_is_not_read_from_the_old_tables(tmp_path, how):
    """A later initialize that finds the file broken drops the tables agreed before: the next
    choice raises the file's error instead of choosing from what the file said then."""
    rng = random.Random(len(how))
    f = tmp_path / "t.json"
    times = {m: rng.uniform(0.2, 2.0) for m in ("ring", "pipeline", "columns")}
    f.write_text(json.dumps(_doc([("gemm_rs", 4, 4096, 4096, 4096, times)])))
    fastest = min(times, key=times.get)
    try:
        first = choice.agreement(str(f), False)
        assert re.fullmatch(r"[0-9a-f]{16}", first), first
        assert choice.choose("rs", 4, "bfloat16", 4096, 4096, 4096, str(f)).method == fastest
        if how == "rewritten":
            f.write_text("{broken")
            value, error = choice.agreement(str(f), False), "cannot read a bench JSON: Expecting"
            assert value.startswith("unusable file, sha256 "), value
        else:
            f.unlink()
            value, error = choice.agreement(str(f), False), "cannot read a bench JSON: [Errno 2]"
            assert value == "unreadable file", value
        with pytest.raises(ValueError) as info:
            choice.choose("rs", 4, "bfloat16", 4096, 4096, 4096, str(f))
        assert str(info.value).startswith(f"JAX_UB_TUNING_FILE {str(f)!r}: {error}"), info.value
    finally:
        choice._forget_agreed()


def test_the_agreement_note_names_the_file_and_why_it_cannot_be_used(tmp_path):
    f = tmp_path / "mine.json"
    n = random.Random(5).randint(2, 6)
    f.write_text(json.dumps(_doc([("gemm_rs", 4, 1024 * (i + 1), 4096, 4096, {"ring": 1.0, "columns": 0.5})
                                  for i in range(n)])))
    good = choice.propose(str(f), False)
    assert good.note.startswith(f"JAX_UB_TUNING_FILE {str(f)!r} ({n} measured shapes, file sha256 "), good.note
    assert "jax_ub/_measured.py (" in good.note
    bad = choice.propose(str(tmp_path / "none.json"), False)
    assert bad.value == "unreadable file" and bad.tables is None
    assert bad.note.startswith(f"JAX_UB_TUNING_FILE {str(tmp_path / 'none.json')!r}: cannot read a "
                               "bench JSON: [Errno 2] No such file or directory"), bad.note
    f.write_text(json.dumps({"machine": "m", "records": [{"op": "gemm_rs", "impl": "jax_ub_ring"}]}))
    bad = choice.propose(str(f), False)
    assert bad.value.startswith("unusable file, sha256 ") and bad.tables is None
    assert bad.note.startswith(f"JAX_UB_TUNING_FILE {str(f)!r}: record 0 (gemm_rs jax_ub_ring) has no 'tp'"), bad.note
    assert choice.propose("", False).note.startswith("no JAX_UB_TUNING_FILE; jax_ub/_measured.py (")


def _overflow_cases(rng):
    big = 10 ** rng.randint(320, 400)  # a JSON integer no float holds
    one = {"op": "ag_gemm", "tp": 2, "dtype": "bfloat16", "M": 1024, "K": 1024, "N": 1024}
    return [
        ({"records": [dict(one, impl="jax_ub_push", ms=big), dict(one, impl="jax_ub_ring", ms=1.0)]},
         "record 0 (ag_gemm jax_ub_push): ms must be a number of milliseconds a float can hold; got 1000"),
        ({"records": [dict(one, impl="jax_ub_push", ms=1.0, M=big), dict(one, impl="jax_ub_ring", ms=2.0, M=big)]},
         "record 0 (ag_gemm jax_ub_push): M must be at most 2**63 - 1; got 1000"),
        ("[" * rng.randint(200_000, 300_000), "cannot read a bench JSON: its arrays/objects nest deeper "
                                              "than Python's recursion limit"),
    ]


@pytest.mark.parametrize("case", range(3))
def test_a_file_no_float_or_stack_can_hold_is_a_value_error_naming_it(case, tmp_path):
    """Not an OverflowError or RecursionError: initialize agrees on it like any unusable file, the
    first op and the doctor say what is wrong where."""
    from jax_ub import doctor

    doc, message = _overflow_cases(random.Random(case))[case]
    f = tmp_path / "huge.json"
    f.write_text(doc if isinstance(doc, str) else json.dumps({"machine": "m", "date": "d", **doc}))
    try:
        a = choice.propose(str(f), False)
        assert a.value.startswith("unusable file, sha256 ") and message in a.note, a.note
        with pytest.raises(ValueError) as info:
            choice.choose("ag", 2, "bfloat16", 1024, 1024, 1024, str(f))
        assert str(info.value).startswith(f"JAX_UB_TUNING_FILE {str(f)!r}") and message in str(info.value)
        status = doctor.tuning_file_status(str(f))
        assert status["ok"] is False and message in status["error"], status
    finally:
        choice._forget_agreed()


def test_an_older_runs_variant_push_merge_is_method_push_merge(tuning):
    """Runs before push_merge was a method timed it as ``variant_push_merge`` (the same program at
    their shapes): read as push_merge, so auto may choose it from those records."""
    assert choice.method_of("variant_push_merge") == "push_merge"
    assert choice.method_of("jax_ub_push_merge") == "push_merge"
    doc = _doc([("ag_gemm", 4, 2048, 8192, 28672, {"push": 0.52, "ring": 0.57, "xla": 0.49})])
    doc["records"].append({**doc["records"][0], "impl": "variant_push_merge", "ms": 0.46})
    c = choice.choose("ag", 4, "bfloat16", 2048, 8192, 28672, tuning(doc))
    assert c.method == "push_merge" and "push_merge 0.460" in c.why, c
    # at tp=2 there is one peer chunk, nothing to merge: its records time push again and are skipped
    doc2 = _doc([("ag_gemm", 2, 2048, 8192, 28672, {"push": 0.52, "ring": 0.57, "push_merge": 0.40})])
    c = choice.choose("ag", 2, "bfloat16", 2048, 8192, 28672, tuning(doc2))
    assert c.method == "push" and "push_merge 0.4" not in c.why, c


def test_shipped_choice_at_the_ag_shape_where_push_merge_measured_fastest():
    """The committed 4xH200 run of 2026-11-28: push_merge 0.460 ms, XLA 0.485, push 0.521 at AG
    2048,8192,28672 tp=4; at 8192,8192,8192 push (0.613) beat push_merge (0.705)."""
    assert choice.choose("ag", 4, "bfloat16", 2048, 8192, 28672).method == "push_merge"
    assert choice.choose("ag", 4, "bfloat16", 8192, 8192, 8192).method == "push"
