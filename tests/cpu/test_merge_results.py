"""CPU tier: ``tools/merge_results.py`` (a fresh bench JSON into the committed one), run as a
subprocess on small made-up files: cases replaced whole, provenance kept per record, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "merge_results.py"
IMPLS = ("gemm_alone", "comm_jax_ub", "xla_plain", "jax_ub")


def _doc(date: str, shapes: dict, *, op: str = "ag_gemm", chain: int | None = None, **header) -> dict:
    """A bench file: ``shapes`` maps (M, K, N) to {impl: ms} (tp 4, bf16)."""
    records = [
        {"op": op, "M": M, "K": K, "N": N, "tp": 4, "dtype": "bfloat16", "impl": impl, "ms": ms}
        for (M, K, N), impls in shapes.items()
        for impl, ms in impls.items()
    ]
    doc = {
        "machine": "4xGPU",
        "date": date,
        "jax": "0.1",
        "jax_ub": "0.1.0",
        "device_kind": "GPU",
        **({"chain": chain} if chain else {}),
        **header,
        "records": records,
    }
    return doc


def _merge(tmp_path: Path, fresh: dict | None, old: dict | None, *args: str) -> subprocess.CompletedProcess:
    paths = []
    for name, doc in (("fresh.json", fresh), ("committed.json", old)):
        if doc is not None:
            (tmp_path / name).write_text(json.dumps(doc))
            paths.append(str(tmp_path / name))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *(args or paths)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _by_case(doc: dict) -> dict:
    out: dict = {}
    for r in doc["records"]:
        out.setdefault((r["M"], r["K"], r["N"]), {})[r["impl"]] = r
    return out


def test_cases_are_replaced_whole_and_keep_their_runs_provenance(tmp_path):
    """A fresh case without xla_plain (it failed there) drops the committed xla_plain of that case
    too; each record carries its own run's date and chain, and the header states only what holds
    for every record."""
    a, b = (8192, 8192, 8192), (2048, 8192, 28672)
    old = _doc(
        "20261122",
        {a: dict.fromkeys(IMPLS, 1.0), b: dict.fromkeys(IMPLS, 2.0)},
        chain=8,
        timelines=[
            {"M": 8192, "K": 8192, "N": 8192, "tp": 4, "dtype": "bfloat16", "impl": "jax_ub", "records": []},
            {"M": 8192, "K": 8192, "N": 8192, "tp": 4, "dtype": "float16", "impl": "jax_ub", "records": []},
        ],
    )
    fresh = _doc(
        "20261125",
        {a: {"gemm_alone": 0.5, "comm_jax_ub": 0.4, "jax_ub": 0.6}},
        timelines=[
            {"M": 8192, "K": 8192, "N": 8192, "tp": 4, "dtype": "bfloat16", "impl": "jax_ub", "records": [1]}
        ],
        failures=[
            {
                "op": "ag_gemm",
                "M": 8192,
                "K": 8192,
                "N": 8192,
                "tp": 4,
                "dtype": "bfloat16",
                "impl": "xla_plain",
                "error": "RuntimeError: out of memory",
            }
        ],
    )
    for r in fresh["records"]:
        r["chain"] = 1
    proc = _merge(tmp_path, fresh, old)
    assert proc.returncode == 0, proc.stderr
    assert "committed.json: 7 records (3 fresh), 2 timelines" in proc.stdout
    doc = json.loads((tmp_path / "committed.json").read_text())
    cases = _by_case(doc)
    assert set(cases[a]) == {"gemm_alone", "comm_jax_ub", "jax_ub"}  # no xla_plain of the old run
    assert all(r["date"] == "20261125" and r["chain"] == 1 for r in cases[a].values())
    assert all(r["date"] == "20261122" and r["chain"] == 8 for r in cases[b].values())
    assert all(
        r["jax_ub"] == "0.1.0" and r["device_kind"] == "GPU" for c in cases.values() for r in c.values()
    )
    # the header: no chain of one run over both; the date (which the record format requires) is
    # the latest run's; what every record agrees on stays
    assert "chain" not in doc and doc["date"] == "20261125"
    assert doc["machine"] == "4xGPU" and doc["jax_ub"] == "0.1.0" and doc["device_kind"] == "GPU"
    assert doc["complete"] is True
    assert [f["impl"] for f in doc["failures"]] == ["xla_plain"] and doc["failures"][0]["date"] == "20261125"
    # timelines per (op, tp, shape, dtype, method): the bf16 one replaced, the float16 one kept
    tls = {t["dtype"]: t for t in doc["timelines"]}
    assert tls["bfloat16"]["records"] == [1] and tls["bfloat16"]["date"] == "20261125"
    assert tls["float16"]["date"] == "20261122"
    assert not list(tmp_path.glob("*.tmp"))


def test_a_merged_file_merged_again_keeps_each_records_own_provenance(tmp_path):
    """Records that carry their date already are not restamped by a later merge's header."""
    a, b = (8192, 8192, 8192), (2048, 8192, 28672)
    old = _doc("20261122", {b: dict.fromkeys(IMPLS, 2.0)})
    old["records"][0]["date"] = "20261101"  # from an earlier merge
    proc = _merge(tmp_path, _doc("20261125", {a: dict.fromkeys(IMPLS, 1.0)}), old)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "committed.json").read_text())
    dates = [r["date"] for r in doc["records"] if (r["M"], r["N"]) == (2048, 28672)]
    assert dates == ["20261101", "20261122", "20261122", "20261122"]
    assert all(r["chain"] == 1 for r in doc["records"]) and doc["chain"] == 1  # every record agrees


def test_refusals_and_usage(tmp_path):
    """Another op, machine or GPU model, a file without records, wrong arguments: exit 2 with the
    reason and the usage, and the committed file untouched."""
    a = (8192, 8192, 8192)
    old = _doc("20261122", {a: dict.fromkeys(IMPLS, 1.0)})
    cases = [
        (
            _doc("20261125", {a: dict.fromkeys(IMPLS, 1.0)}, op="gemm_rs"),
            "is a bench rs file and",
            "a bench ag file",
        ),
        (_doc("20261125", {a: dict.fromkeys(IMPLS, 1.0)}, op="bulk_ag"), "is a bench bulk file", ""),
        (
            {**_doc("20261125", {a: dict.fromkeys(IMPLS, 1.0)}), "machine": "2xGPU"},
            "was measured on machine '2xGPU'",
            "merge only runs of one machine",
        ),
        (
            {**_doc("20261125", {a: dict.fromkeys(IMPLS, 1.0)}), "device_kind": "Other GPU"},
            "device_kind 'Other GPU'",
            "",
        ),
        ({**_doc("20261125", {}), "records": []}, "fresh.json: no records", ""),
        ({"records": [{"op": "mlp", "impl": "jax_ub", "ms": 1.0}]}, "records of mlp: not one bench", ""),
    ]
    for fresh, want, also in cases:
        proc = _merge(tmp_path, fresh, old)
        assert proc.returncode == 2, (want, proc.stdout, proc.stderr)
        assert want in proc.stderr and also in proc.stderr and "nothing written" in proc.stderr, proc.stderr
        assert "usage: python tools/merge_results.py FRESH.json COMMITTED.json" in proc.stderr
        assert json.loads((tmp_path / "committed.json").read_text()) == old
    for args in ((), ("only-one.json",), ("-h",), ("a.json", "b.json", "c.json")):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert proc.returncode == 2 and f"got {list(args)!r}" in proc.stderr, (args, proc.stderr)
        assert "usage: " in proc.stderr, (args, proc.stderr)
    proc = _merge(tmp_path, None, None, str(tmp_path / "missing.json"), str(tmp_path / "committed.json"))
    assert proc.returncode == 2 and "missing.json: cannot read a bench JSON" in proc.stderr


def test_bulk_files_merge_both_ops(tmp_path):
    """A bulk file (bulk_ag and bulk_rs records) merges per case of each op."""
    a = (8192, 8192, 8192)
    old = _doc("20261122", {a: dict.fromkeys(IMPLS, 1.0)}, op="bulk_ag")
    old["records"] += _doc("20261122", {a: dict.fromkeys(IMPLS, 1.0)}, op="bulk_rs")["records"]
    fresh = _doc("20261125", {a: dict.fromkeys(IMPLS, 0.5)}, op="bulk_rs")
    proc = _merge(tmp_path, fresh, old)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "committed.json").read_text())
    assert {(r["op"], r["ms"], r["date"]) for r in doc["records"]} == {
        ("bulk_ag", 1.0, "20261122"),
        ("bulk_rs", 0.5, "20261125"),
    }
