"""CPU tier: ``python -m jax_ub.bench summary`` (bench records as a table, with the thresholds the
caller gives) and README's performance table, which is that command's output over the committed records."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jax_ub.bench import summary

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, op: str, cases: dict, tp: int = 4) -> str:
    records = [
        {"op": op, "M": M, "K": K, "N": N, "tp": tp, "dtype": "bfloat16", "impl": impl, "ms": ms}
        for (M, K, N), impls in cases.items()
        for impl, ms in impls.items()
    ]
    path.write_text(json.dumps({"machine": "test", "date": "20261123", "records": records}))
    return str(path)


def _impls(xla, ub, gemm, comm):
    return {"xla_plain": xla, "jax_ub": ub, "gemm_alone": gemm, "comm_jax_ub": comm, "comm_nccl": 9.0}


def test_rows_and_verdicts(tmp_path):
    ag = _write(
        tmp_path / "ag.json",
        "ag_gemm",
        {
            (8192, 8192, 8192): _impls(2.0, 1.0, 0.95, 0.5),  # 2.00x, T/T_ideal 1.05
            (2048, 8192, 8192): _impls(0.9, 1.0, 0.5, 0.8),  # slower than XLA, 1.25
        },
    )
    rs = _write(tmp_path / "rs.json", "gemm_rs", {(8192, 8192, 8192): _impls(3.0, 2.0, 1.0, 1.9)})
    out = summary.markdown(summary.load([ag, rs]))
    assert "| ag_gemm | 4 | 2048,8192,8192 | 0.900 | 1.000 | 0.90x | 1.25 | - |" in out
    assert "| ag_gemm | 4 | 8192,8192,8192 | 2.000 | 1.000 | 2.00x | 1.05 | - |" in out
    assert "| gemm_rs | 4 | 8192,8192,8192 | 3.000 | 2.000 | 1.50x | 1.05 | - |" in out
    # no threshold given: the lines say what the rows add up to and judge nothing
    assert (
        "- AG->GEMM (`all_gather_matmul`), tp=4: faster than XLA plain at 1 of 2 shapes; geometric "
        "mean speedup 1.34x; T/T_ideal 1.05 to 1.25.\n"
    ) in out, out
    assert (
        "- GEMM->RS (`matmul_reduce_scatter`), tp=4: faster than XLA plain at 1 of 1 shapes; geometric "
        "mean speedup 1.50x; T/T_ideal 1.05.\n"
    ) in out, out
    for word in ("target", "meets", "below", "within", "exceeds"):
        assert word not in out, (word, out)
    # AG rows come before RS rows
    assert out.index("| ag_gemm") < out.index("| gemm_rs")
    # geometric mean of 2.0 and 0.9 is 1.34: it meets 1.30 and is 3.5% below 1.39; RS 1.50 meets 1.50
    out = summary.markdown(summary.load([ag, rs]), targets={"ag_gemm": 1.30, "gemm_rs": 1.50})
    assert "geometric mean speedup 1.34x (target 1.30x: meets); T/T_ideal 1.05 to 1.25." in out, out
    assert "geometric mean speedup 1.50x (target 1.50x: meets); T/T_ideal 1.05." in out, out
    out = summary.markdown(summary.load([ag, rs]), targets={"ag_gemm": 1.39})
    assert "geometric mean speedup 1.34x (target 1.39x: below by 3.5%); T/T_ideal 1.05 to 1.25." in out, out
    assert "geometric mean speedup 1.50x; T/T_ideal 1.05." in out, out  # no target for RS
    out = summary.markdown(summary.load([ag, rs]), ideal_max=1.10)
    assert "T/T_ideal 1.05 to 1.25; within 1.10x of T_ideal at 1 of 2." in out, out
    assert "T/T_ideal 1.05; within 1.10x of T_ideal at 1 of 1." in out, out


def test_split_floor_where_the_run_timed_the_chunk_gemms(tmp_path):
    ag = _write(
        tmp_path / "ag.json",
        "ag_gemm",
        {
            # chunks 1.19x the whole GEMM, which binds: floor 1.19, above 1.10
            (2048, 8192, 28672): {**_impls(0.47, 0.45, 0.36, 0.26), "gemm_chunks": 0.4284},
            # chunks 1.02x a GEMM shorter than the collective: floor 1.00 (the collective binds)
            (8192, 8192, 8192): {**_impls(0.8, 0.5, 0.3, 0.4), "gemm_chunks": 0.306},
            (16384, 12288, 12288): _impls(2.6, 1.8, 1.7, 0.9),  # not timed: "-"
        },
    )
    out = summary.markdown(summary.load([ag]))
    assert "| ag_gemm | 4 | 2048,8192,28672 | 0.470 | 0.450 | 1.04x | 1.25 | 1.19 |" in out
    assert "| ag_gemm | 4 | 8192,8192,8192 | 0.800 | 0.500 | 1.60x | 1.25 | 1.00 |" in out
    assert "| ag_gemm | 4 | 16384,12288,12288 | 2.600 | 1.800 | 1.44x | 1.06 | - |" in out
    assert "split floor exceeds" not in out  # a floor is judged only against a given --ideal-max
    out = summary.markdown(summary.load([ag]), ideal_max=1.10)
    assert "within 1.10x of T_ideal at 1 of 3; the split floor exceeds 1.10 at 2048,8192,28672.\n" in out, out
    out = summary.markdown(summary.load([ag]), ideal_max=1.20)
    assert "within 1.20x of T_ideal at 1 of 3.\n" in out, out


def test_missed_target_and_filters(tmp_path):
    rs = _write(tmp_path / "rs.json", "gemm_rs", {(8192, 8192, 8192): _impls(1.4, 1.0, 0.8, 0.7)})
    rs2 = _write(tmp_path / "rs2.json", "gemm_rs", {(8192, 8192, 8192): _impls(1.4, 1.0, 0.8, 0.7)}, tp=2)
    out = summary.markdown(summary.load([rs, rs2]), tps=[4], targets={"gemm_rs": 1.45}, ideal_max=1.10)
    assert (
        "geometric mean speedup 1.40x (target 1.45x: below by 3.4%); T/T_ideal 1.25; "
        "within 1.10x of T_ideal at 0 of 1."
    ) in out, out
    assert "tp=2" not in out and "| gemm_rs | 2 |" not in out
    assert "no float16 case" in summary.markdown(summary.load([rs]), dtype="float16")


def test_a_later_file_replaces_the_whole_case(tmp_path):
    """A case comes whole from the last file that has it: never one impl from one run and another
    from the next (a later file with only jax_ub at a shape leaves that shape without a row)."""
    old = _write(
        tmp_path / "old.json",
        "ag_gemm",
        {(8192, 8192, 8192): _impls(2.0, 1.0, 0.95, 0.5), (2048, 8192, 28672): _impls(0.5, 0.4, 0.35, 0.3)},
    )
    new = _write(
        tmp_path / "new.json",
        "ag_gemm",
        {(8192, 8192, 8192): _impls(1.6, 0.8, 0.76, 0.4), (2048, 8192, 28672): {"jax_ub": 0.2}},
    )
    out = summary.markdown(summary.load([old, new]))
    assert "| ag_gemm | 4 | 8192,8192,8192 | 1.600 | 0.800 | 2.00x | 1.05 | - |" in out
    assert "| ag_gemm | 4 | 2048,8192,28672 |" not in out
    assert "no row at 2048,8192,28672: no xla_plain, gemm_alone, comm_jax_ub records" in out


def test_a_case_without_every_impl_is_left_out(tmp_path):
    cpu_like = _write(tmp_path / "ag.json", "ag_gemm", {(64, 64, 64): {"xla_plain": 1.0, "jax_ub": 1.0}})
    assert summary.markdown(summary.load([cpu_like])).startswith("no bfloat16 case with")


def test_cli_and_its_errors(tmp_path):
    ag = _write(tmp_path / "ag.json", "ag_gemm", {(8192, 8192, 8192): _impls(2.0, 1.0, 0.95, 0.5)})
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text("[1, 2]")

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "jax_ub.bench", "summary", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )

    ok = run(ag, "--tp", "4")
    assert ok.returncode == 0, ok.stderr
    assert "| ag_gemm | 4 | 8192,8192,8192 |" in ok.stdout
    r = run(str(bad))  # errors go to stderr, nothing to stdout
    assert r.returncode == 2 and f"error: {bad}: not JSON" in r.stderr and r.stdout == ""
    r = run(str(wrong))
    assert r.returncode == 2 and "not a bench result file" in r.stderr and r.stdout == ""
    r = run(str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing.json" in r.stderr and r.stdout == ""
    r = run(ag, "--tp", "3")
    assert r.returncode == 2 and f"error: no records with tp=3 in {ag}; the file has tp 4" in r.stderr
    assert r.stdout == ""


def _cli(capsys, *args):
    from jax_ub.bench import __main__ as cli

    rc = cli.main(["summary", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_selection_that_leaves_nothing_says_so_and_fails(tmp_path, capsys):
    """--tp / --dtype that no record has: an error naming the filter, the files and what they do
    have (stderr, exit 2), not the claim that no case had every impl."""
    ag = _write(tmp_path / "ag.json", "ag_gemm", {(8192, 8192, 8192): _impls(2.0, 1.0, 0.95, 0.5)})
    rs = _write(tmp_path / "rs.json", "gemm_rs", {(8192, 8192, 8192): _impls(3.0, 2.0, 1.0, 1.9)}, tp=2)
    rc, out, err = _cli(capsys, "--tp", "3", ag, rs)
    assert rc == 2 and out == ""
    assert err.strip() == f"error: no records with tp=3 in {ag}, {rs}; the files have tp 2, 4"
    rc, out, err = _cli(capsys, "--tp", "3", "--tp", "5", ag)
    assert rc == 2 and f"error: no records with tp=3 or 5 in {ag}; the file has tp 4" in err
    rc, out, err = _cli(capsys, "--dtype", "float16", ag)
    assert rc == 2 and out == ""
    assert f"error: no float16 records in {ag}; the file has dtype bfloat16 (--dtype chooses)" in err
    rc, out, err = _cli(capsys, "--tp", "2", "--dtype", "float16", ag, rs)
    assert f"error: no float16 records with tp=2 in {ag}, {rs}; the files have dtype bfloat16 there" in err
    rc, out, _ = _cli(capsys, "--tp", "2", ag, rs)  # a selection with something in it
    assert rc == 0 and "| gemm_rs | 2 | 8192,8192,8192 |" in out and "| ag_gemm" not in out


def test_a_file_without_ag_rs_records_says_so_and_fails(tmp_path, capsys):
    """An mlp record file (or one with no records at all) given to summary: said plainly, exit 2."""
    mlp = tmp_path / "mlp.json"
    mlp.write_text(
        json.dumps(
            {
                "machine": "m",
                "date": "d",
                "records": [
                    {"op": "mlp", "tp": 4, "dtype": "bfloat16", "impl": "jax_ub", "ms": 1.0},
                    {"op": "swiglu", "tp": 4, "dtype": "bfloat16", "impl": "jax_ub", "ms": 1.0},
                ],
            }
        )
    )
    ag = _write(tmp_path / "ag.json", "ag_gemm", {(8192, 8192, 8192): _impls(2.0, 1.0, 0.95, 0.5)})
    rc, out, err = _cli(capsys, ag, str(mlp))
    assert rc == 2 and out == ""
    assert err.strip() == (
        f"error: {mlp}: no ag_gemm, gemm_rs, bulk_ag or bulk_rs records (expected a "
        f"file of python -m jax_ub.bench ag|rs|bulk; got records of mlp, swiglu)"
    )
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"records": []}))
    rc, _, err = _cli(capsys, str(empty))
    assert rc == 2 and "got no records)" in err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"records": [{"op": "ag_gemm", "tp": 4}]}))
    rc, _, err = _cli(capsys, str(broken))
    assert rc == 2 and f"error: {broken}: record 0 (ag_gemm) is not a bench record" in err, err


def test_a_cpu_run_has_no_row_and_fails(tmp_path, capsys):
    """Records without comm_jax_ub (a run off the CUDA path): no row can be made; said, exit 2."""
    cpu_like = _write(
        tmp_path / "ag.json", "ag_gemm", {(64, 64, 64): {"xla_plain": 1.0, "jax_ub": 1.0, "gemm_alone": 0.5}}
    )
    rc, out, err = _cli(capsys, cpu_like)
    assert rc == 2 and out == ""
    assert (
        f"error: no bfloat16 case in {cpu_like} has the xla_plain, jax_ub, gemm_alone, comm_jax_ub "
        f"records a row needs (e.g. ag_gemm tp=4 64,64,64 has no comm_jax_ub; a run off the CUDA "
        f"path times no comm_jax_ub)"
    ) in err, err


def test_readme_performance_table_is_the_summary_of_the_committed_records(monkeypatch, capsys):
    """The table between README's summary markers is exactly what the command above it prints, run
    from the repository root."""
    readme = (REPO / "README.md").read_text()
    m = re.search(
        r"```\n(python -m jax_ub\.bench summary [^`]*?)\n```\n\n<!-- summary:[^\n]*-->\n(.*?)"
        r"<!-- /summary -->",
        readme,
        re.S,
    )
    assert m, "README's performance table (between <!-- summary: ... --> and <!-- /summary -->) is missing"
    argv = shlex.split(m.group(1).replace("\\\n", " "))
    assert argv[:4] == ["python", "-m", "jax_ub.bench", "summary"]
    files = [a for a in argv[4:] if a.endswith(".json")]
    assert files and all((REPO / f).is_file() for f in files), files
    monkeypatch.chdir(REPO)
    rc, out, err = _cli(capsys, *argv[4:])
    assert rc == 0, err
    assert m.group(2) == out, (
        "README's performance table differs from the command's output: run "
        "the command above it and paste its output between the markers"
    )


SHAPES = [(8192, 8192, 28672), (8192, 8192, 8192), (16384, 12288, 12288), (2048, 8192, 28672)]


def test_a_case_without_a_needed_record_is_a_named_miss(tmp_path):
    """A shape of the selection whose jax_ub failed: no row, but counted (4 shapes, not 3) and
    named; the geometric mean says over how many shapes it is, and a target is not met without it."""
    cases = {s: _impls(2.0, 1.0, 0.95, 0.5) for s in SHAPES}
    out = summary.markdown(
        summary.load([_write(tmp_path / "all.json", "ag_gemm", cases)]), targets={"ag_gemm": 1.30}
    )
    assert "geometric mean speedup 2.00x (target 1.30x: meets)" in out, out
    cases[(2048, 8192, 28672)] = {k: v for k, v in _impls(2.0, 1.0, 0.95, 0.5).items() if k != "jax_ub"}
    out = summary.markdown(
        summary.load([_write(tmp_path / "ag.json", "ag_gemm", cases)]),
        targets={"ag_gemm": 1.30},
        ideal_max=1.10,
    )
    assert "| ag_gemm | 4 | 2048,8192,28672 |" not in out
    assert (
        "- AG->GEMM (`all_gather_matmul`), tp=4: faster than XLA plain at 3 of 4 shapes; geometric mean "
        "speedup 2.00x over 3 of 4 shapes (target 1.30x: below); T/T_ideal 1.05; within 1.10x of "
        "T_ideal at 3 of 4; no row at 2048,8192,28672: no jax_ub record."
    ) in out, out


def test_records_of_different_chains_make_no_row(tmp_path):
    """xla_plain chained 8 and jax_ub timed one op per dispatch: no speedup is made of them."""
    path = tmp_path / "ag.json"
    records = [
        {
            "op": "ag_gemm",
            "M": 8192,
            "K": 8192,
            "N": 8192,
            "tp": 2,
            "dtype": "bfloat16",
            "impl": impl,
            "ms": ms,
            **({"chain": 1} if impl == "jax_ub" else {}),
        }
        for impl, ms in _impls(2.0, 1.0, 0.95, 0.5).items()
    ]
    path.write_text(json.dumps({"machine": "m", "date": "d", "chain": 8, "records": records}))
    out = summary.markdown(summary.load([str(path)]))
    assert out.startswith("no bfloat16 case with"), out
    extra = _write(tmp_path / "ok.json", "ag_gemm", {(4096, 4096, 4096): _impls(2.0, 1.0, 0.95, 0.5)}, tp=2)
    out = summary.markdown(summary.load([str(path), extra]))
    assert (
        "no row at 8192,8192,8192: records of different chains (xla_plain 8, jax_ub 1, "
        "gemm_alone 8, comm_jax_ub 8)"
    ) in out, out


def test_targets_on_the_command_line_and_their_errors(tmp_path, capsys):
    """--target OP=SPEEDUP (repeatable) and --ideal-max R reach the lines; a malformed one is
    argparse's error (exit 2) before any file is read."""
    ag = _write(tmp_path / "ag.json", "ag_gemm", {(8192, 8192, 8192): _impls(2.0, 1.0, 0.95, 0.5)})
    rs = _write(tmp_path / "rs.json", "gemm_rs", {(8192, 8192, 8192): _impls(3.0, 2.0, 1.0, 1.9)})
    rc, out, _ = _cli(
        capsys, ag, rs, "--target", "ag_gemm=1.9", "--target", "gemm_rs=1.6", "--ideal-max", "1.01"
    )
    assert rc == 0
    assert (
        "geometric mean speedup 2.00x (target 1.90x: meets); T/T_ideal 1.05; within 1.01x of T_ideal at 0"
        in out
    )
    assert "geometric mean speedup 1.50x (target 1.60x: below by 6.2%); T/T_ideal 1.05; within 1.01x" in out
    rc, out, _ = _cli(capsys, ag, rs)
    assert rc == 0 and "target" not in out and "within" not in out
    for bad, says in (
        (["--target", "ag=1.3"], "expected OP=SPEEDUP with OP one of ag_gemm, gemm_rs"),
        (["--target", "ag_gemm"], "expected OP=SPEEDUP"),
        (["--target", "ag_gemm=0"], "expected a positive number; got '0'"),
        (["--target", "gemm_rs=x"], "expected a positive number; got 'x'"),
        (["--ideal-max", "-1"], "expected a positive number; got '-1'"),
        (["--ideal-max", "inf"], "expected a positive number; got 'inf'"),
    ):
        with pytest.raises(SystemExit) as e:
            _cli(capsys, ag, *bad)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err, (bad, err)


def test_noise_line_from_auto_and_the_method_it_ran(tmp_path):
    """jax_ub's record names the method auto ran; that method's own record is the same program
    timed apart in the same run: their difference is the run's noise, which a miss of the target
    can be set against. A case without the method, or whose twin ran another chain, adds nothing."""

    def records(shape, ub, twin_impl, twin_ms, method, chain=1):
        M, K, N = shape
        base = {"op": "ag_gemm", "M": M, "K": K, "N": N, "tp": 4, "dtype": "bfloat16", "chain": 1}
        out = [{**base, "impl": i, "ms": ms} for i, ms in _impls(1.3 * ub, ub, 0.9 * ub, 0.5 * ub).items()]
        for r in out:
            if r["impl"] == "jax_ub" and method is not None:
                r["method"] = method
        return [*out, {**base, "impl": twin_impl, "ms": twin_ms, "chain": chain}]

    recs = (
        records((8192, 8192, 8192), 1.00, "jax_ub_push", 1.02, "push")  # 2.0% apart
        + records((8192, 8192, 28672), 2.00, "jax_ub_ring", 2.01, "ring")  # 0.5%
        + records((16384, 12288, 12288), 3.00, "xla_plain", 3.9, "xla")  # |3/3.9 - 1| = 23.1%
        + records((2048, 8192, 28672), 0.50, "jax_ub_push", 0.40, None)
    )  # no method: none
    path = tmp_path / "ag.json"
    path.write_text(json.dumps({"machine": "t", "date": "20261124", "records": recs}))
    out = summary.markdown(summary.load([str(path)]))
    assert (
        "; noise (auto and the method it ran, timed apart in one run): median 2.0%, max 23.1% over 3 shapes."
    ) in out, out
    # the twin timed with another chain is no twin: no noise line from one shape of two
    recs = records((8192, 8192, 8192), 1.00, "jax_ub_push", 1.02, "push", chain=8) + records(
        (8192, 8192, 28672), 2.00, "jax_ub_ring", 2.01, "ring"
    )
    path.write_text(json.dumps({"machine": "t", "date": "20261124", "records": recs}))
    out = summary.markdown(summary.load([str(path)]))
    assert "median 0.5%, max 0.5% over 1 shape." in out, out
