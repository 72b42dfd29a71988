"""The extension's source fingerprint: CMake (cmake/source_hash.cmake) records a hash of csrc/ in
the extension's build_info(); jax_ub/_ext.py hashes a source checkout's csrc/ the same way and warns
when the loaded extension was built from other sources (an installed wheel has no csrc/: no check)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jax_ub import _ext

REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path) -> Path:
    csrc = root / "csrc"
    for rel, text in {
        "module.cc": "int a;\n",
        "b.cu": "// b\n",
        "comm/z.h": "#pragma once\n",
        "comm/A.cuh": "x\n",
        "comm/deep/k.cpp": "int k;\n",
        "x.hpp": "",
        "notes.txt": "not a source\n",
        "_jax_ub_build.py.in": "X = 1\n",
    }.items():
        (csrc / rel).parent.mkdir(parents=True, exist_ok=True)
        (csrc / rel).write_text(text)
    return csrc


def _cmake_hash(csrc: Path) -> str:
    r = subprocess.run(
        ["cmake", f"-DJAX_UB_HASH_DIR={csrc}", "-P", str(REPO / "cmake" / "source_hash.cmake")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return r.stderr.strip()  # message() prints on stderr


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_python_and_cmake_compute_the_same_hash(tmp_path):
    csrc = _tree(tmp_path)
    h = _ext.source_hash(str(csrc))
    assert len(h) == 64 and h == _cmake_hash(csrc)
    (csrc / "notes.txt").write_text("changed\n")  # not a source: same hash
    (csrc / "_jax_ub_build.py.in").write_text("X = 2\n")
    assert _ext.source_hash(str(csrc)) == h
    (csrc / "comm" / "z.h").write_text("#pragma once\n// an edit\n")
    h2 = _ext.source_hash(str(csrc))
    assert h2 != h and h2 == _cmake_hash(csrc)
    (csrc / "comm" / "z.h").rename(csrc / "comm" / "y.h")  # a rename changes it too
    assert _ext.source_hash(str(csrc)) not in (h, h2) and _ext.source_hash(str(csrc)) == _cmake_hash(csrc)
    assert _ext.source_hash(str(REPO / "csrc")) == _cmake_hash(REPO / "csrc")


def test_the_installed_extension_was_built_from_this_checkout():
    """pip install . records csrc/'s hash in the extension and in _jax_ub_build; a fresh build of
    this checkout (CI's) matches it. Fails where csrc/ was edited after the last build: rebuild."""
    mod = _ext.extension()
    if mod is None:
        pytest.skip(f"the CUDA extension is not loaded: {_ext._load()[1]}")
    csrc = _ext.checkout_csrc()
    if csrc is None:
        pytest.skip("jax_ub does not run from a source checkout")
    want = _ext.source_hash(csrc)
    assert mod.build_info()["source_hash"] == want, _ext.source_mismatch(mod)
    assert _ext._build_facts()["source_hash"] == want
    assert _ext.source_mismatch(mod) is None
    assert "extension_stale" not in _ext.build_info()


def test_checkout_csrc_only_in_a_checkout(tmp_path):
    assert _ext.checkout_csrc() == str(REPO / "csrc")  # these tests run from the checkout
    site = tmp_path / "site-packages"
    (site / "jax_ub").mkdir(parents=True)
    (site / "csrc").mkdir()  # some other package's csrc/: not jax_ub's
    assert _ext.checkout_csrc(str(site / "jax_ub")) is None
    co = tmp_path / "co"
    (co / "jax_ub").mkdir(parents=True)
    _tree(co)
    assert _ext.checkout_csrc(str(co / "jax_ub")) == str(co / "csrc")


class _Fake:
    __file__ = "/site/_jax_ub_cuda.so"

    def __init__(self, info):
        self.info = info
        self.candidates = {}

    def build_info(self):
        if isinstance(self.info, Exception):
            raise self.info
        return self.info

    def set_library_candidates(self, lib, paths):
        self.candidates[lib] = paths

    def runtime_info(self):
        return {"driver_version": 0, "device_count": 0, "error": "stand-in"}

    def cublaslt_description(self):
        return "stand-in"


@pytest.fixture
def fake_extension(monkeypatch):
    """``install(build_info, csrc)``: _ext._load() finds a fake extension; the real one afterwards."""

    def install(info, csrc):
        monkeypatch.setattr(_ext, "_build_facts", lambda: {"cuda_built": True, "reason": ""})
        monkeypatch.setattr(_ext, "checkout_csrc", lambda *a: csrc)
        monkeypatch.setitem(sys.modules, "_jax_ub_cuda", _Fake(info))
        _ext._load.cache_clear()

    yield install
    _ext._load.cache_clear()


def test_other_sources_warn_at_load(fake_extension, tmp_path, caplog):
    csrc = str(_tree(tmp_path))
    fake_extension({"source_hash": "f" * 64}, csrc)
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        mod, reason = _ext._load()
        _ext._load()  # cached: warned once
    assert mod is not None and reason == ""
    msgs = [r.getMessage() for r in caplog.records if r.name == "jax_ub"]
    assert len(msgs) == 1, msgs
    want = _ext.source_hash(csrc)
    assert msgs[0] == (
        f"jax_ub: the CUDA extension /site/_jax_ub_cuda.so was not built from this checkout's "
        f"{csrc} (expected sources {want[:12]}; built from sources ffffffffffff): the Python "
        "side may call kernels, functions or FFI attributes it lacks. Rebuild it: `pip install "
        f".` in {tmp_path} (an editable install: `pip install --no-build-isolation -e .`)"
    )


def test_an_extension_without_a_hash_predates_the_check(fake_extension, tmp_path, caplog):
    fake_extension({"cuda_runtime_version": 12080}, str(_tree(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        _ext._load()
    assert "it records no source hash: it was built before jax_ub recorded one" in caplog.text


def test_matching_sources_and_wheels_do_not_warn(fake_extension, tmp_path, caplog):
    csrc = str(_tree(tmp_path))
    fake_extension({"source_hash": _ext.source_hash(csrc)}, csrc)
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        assert _ext._load()[0] is not None
    fake_extension({"source_hash": "f" * 64}, None)  # an installed wheel: no csrc/ to compare with
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        assert _ext._load()[0] is not None
    assert [r for r in caplog.records if r.name == "jax_ub"] == []


def test_build_info_reports_the_mismatch(fake_extension, tmp_path):
    fake_extension({"source_hash": "f" * 64}, str(_tree(tmp_path)))
    info = _ext.build_info()
    assert info["ext_source_hash"] == "f" * 64
    assert info["extension_stale"].startswith("the CUDA extension /site/_jax_ub_cuda.so was not built from")
