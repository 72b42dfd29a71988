"""``python -m jax_ub.bench breakdown``: the split of a traced step's op time into GEMM, waits and
copies, on traces made by :func:`jax_ub.bench.timeline.chrome_trace` from records whose answer is
known, and on the committed 4xH200 trace."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from jax_ub.bench import __main__ as cli
from jax_ub.bench import breakdown, timeline

REPO = Path(__file__).resolve().parents[2]


def _rec(dev, epoch, op, name, chunk, stream, start_ms, end_ms):
    return {
        "device": dev, "epoch": epoch, "op": op, "rank": dev, "name": name, "chunk": chunk,
        "stream": stream, "op_start_ms": 5.0, "start_ms": start_ms, "end_ms": end_ms,
    }  # fmt: skip


def _trace(tmp_path, records):
    path = tmp_path / "t-trace.json"
    path.write_text(json.dumps(timeline.chrome_trace(records, title="t")))
    return str(path)


def test_union_of_intervals_against_a_grid():
    """_union equals the count of covered points of a fine grid, for random intervals."""
    rng = random.Random(3)
    for _ in range(50):
        spans = [(a, a + rng.randint(1, 30)) for a in (rng.randint(0, 100) for _ in range(rng.randint(1, 8)))]
        covered = sum(any(s <= t < e for s, e in spans) for t in range(0, 200))
        assert breakdown._union([(float(s), float(e)) for s, e in spans]) == covered


def test_op_split_into_gemm_wait_and_copy(tmp_path):
    # device 0: an AG op 0..0.2 ms: GEMMs 0-50 and 80-200 us (overlapping a third GEMM 90-120),
    # copies 10-70 and 60-100; an RS op 1.0..1.1 ms on another epoch: GEMM 1000-1060, a reduce
    # 1060-1100. Device 1: one op, all GEMM.
    recs = [
        _rec(0, 7, "all_gather_matmul", "gemm", 0, "compute", 0.0, 0.05),
        _rec(0, 7, "all_gather_matmul", "gemm", 1, "compute", 0.08, 0.2),
        _rec(0, 7, "all_gather_matmul", "gemm", 2, "side", 0.09, 0.12),
        _rec(0, 7, "all_gather_matmul", "copy", 1, "copy", 0.01, 0.07),
        _rec(0, 7, "all_gather_matmul", "copy", 2, "copy", 0.06, 0.1),
        _rec(0, 8, "matmul_reduce_scatter", "gemm", 1, "compute", 1.0, 1.06),
        _rec(0, 8, "matmul_reduce_scatter", "reduce", -1, "compute", 1.06, 1.1),
        _rec(1, 7, "all_gather_matmul", "gemm", 0, "compute", 0.0, 0.3),
    ]
    rows = breakdown.ops(breakdown.load(_trace(tmp_path, recs)))
    d0, d1 = rows[timeline.PID_BASE], rows[timeline.PID_BASE + 1]
    ag, rs = d0
    assert ag["op"] == "all_gather_matmul" and ag["steps"] == 5
    assert ag["op_us"] == pytest.approx(200) and ag["gemm_us"] == pytest.approx(170)
    assert ag["wait_us"] == pytest.approx(30) and ag["copy_us"] == pytest.approx(90)
    assert rs["op_us"] == pytest.approx(100) and rs["gemm_us"] == pytest.approx(60)
    assert rs["wait_us"] == pytest.approx(40) and rs["copy_us"] == pytest.approx(40)
    assert breakdown.totals(d0)["wait_us"] == pytest.approx(70)
    assert d1[0]["wait_us"] == pytest.approx(0)
    text = breakdown.report(breakdown.load(_trace(tmp_path, recs)))
    assert "device 0: 2 ops" in text and "device 1: 1 ops" in text


def test_gap_to_the_floor_split_with_the_records(tmp_path, capsys):
    recs = [
        _rec(0, 1, "all_gather_matmul", "gemm", 0, "compute", 0.0, 0.1),
        _rec(0, 1, "all_gather_matmul", "copy", 1, "copy", 0.0, 0.15),
        _rec(0, 1, "all_gather_matmul", "gemm", 1, "compute", 0.15, 0.25),
    ]  # wait 50 us
    layer = {"records": [
        {"op": "layer", "remat": "none", "impl": "xla", "ms": 2.0},
        {"op": "layer", "remat": "none", "impl": "jax_ub", "ms": 1.8, "E": 0.4},
        {"op": "layer", "remat": "none", "impl": "no_comm", "ms": 1.5},
    ]}  # fmt: skip
    rec_path = tmp_path / "l.json"
    rec_path.write_text(json.dumps(layer))
    assert cli.main(["breakdown", _trace(tmp_path, recs), "--records", str(rec_path)]) == 0
    out = capsys.readouterr().out
    assert "remat=none: jax_ub - no_comm = 300 us (XLA's step exposes 500 us; E 0.4)" in out
    assert "waits inside the ops 50 us (mean over devices), the rest 250 us" in out


def test_committed_layer_trace_reads(capsys):
    """The 4xH200 trace of the 8b layer: 4 devices, 8 ops each, every op's GEMM time within its
    span, and the waits the docs quote."""
    trace = REPO / "benchmarks/records/4xNVIDIA_H200-20261129-layer-8b-trace.json"
    rows = breakdown.ops(breakdown.load(str(trace)))
    assert len(rows) == 4 and all(len(r) == 8 for r in rows.values())
    assert all(0 < r["gemm_us"] <= r["op_us"] + 1e-6 for dev in rows.values() for r in dev)
    assert round(breakdown.totals(rows[timeline.PID_BASE])["wait_us"]) == 390
    assert cli.main(["breakdown", str(trace)]) == 0
    assert "device 3: 8 ops" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, why",
    [
        ("not json", "cannot read a trace JSON"),
        ('{"traceEvents": 3}', "expected a Chrome trace"),
    ],
)
def test_bad_trace_file_is_refused(tmp_path, capsys, content, why):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert cli.main(["breakdown", str(path)]) == 2
    assert why in capsys.readouterr().err


def test_records_that_are_not_a_layer_run_are_refused(tmp_path, capsys):
    trace = _trace(tmp_path, [_rec(0, 1, "all_gather_matmul", "gemm", 0, "compute", 0.0, 0.1)])
    rec = tmp_path / "ag.json"
    rec.write_text(json.dumps({"records": [{"op": "ag_gemm", "impl": "jax_ub", "ms": 1.0}]}))
    assert cli.main(["breakdown", trace, "--records", str(rec)]) == 2
    assert "expected a bench layer JSON" in capsys.readouterr().err


def test_no_op_spans_says_why(tmp_path, capsys):
    assert cli.main(["breakdown", _trace(tmp_path, [])]) == 0
    assert "no jax_ub op spans" in capsys.readouterr().out
