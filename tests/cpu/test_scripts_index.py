"""CPU tier: scripts/README.md lists every file in scripts/, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_scripts_readme_lists_every_script():
    text = (SCRIPTS / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", text, re.M))
    present = {p.name for p in SCRIPTS.iterdir() if p.is_file() and p.name != "README.md"}
    assert present - listed == set(), f"scripts/README.md does not list {sorted(present - listed)}"
    assert listed - present == set(), f"scripts/README.md lists missing files {sorted(listed - present)}"


def test_scripts_set_no_jax_ub_variable_that_jax_ub_calls_unknown():
    """A JAX_UB_* variable that jax_ub does not read is named 'not a jax_ub setting' by the
    configuration's warning and by the doctor: a script's own switch needs another name."""
    from jax_ub import config

    root = SCRIPTS.parent
    # Set or read in code (os.environ[...], env dicts), or in a usage line (NAME=value).
    pattern = re.compile(r"""environ(?:\[|\.get\(|\.setdefault\(|\.pop\()\s*["'](JAX_UB_\w+)["']"""
                         r"""|["'](JAX_UB_\w+)["']\s*:|\b(JAX_UB_\w+)=""")
    used: dict[str, set[str]] = {}
    for folder in ("scripts", "examples", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            for groups in pattern.findall(path.read_text()):
                name = "".join(groups)
                used.setdefault(name, set()).add(str(path.relative_to(root)))
    assert used, "no JAX_UB_* environment use found: the pattern is stale"
    unknown = {n: sorted(used[n]) for n in config.unknown_variables(dict.fromkeys(used, ""))}
    assert unknown == {}, f"variables jax_ub calls unknown, and the scripts that set them: {unknown}"


def test_readme_layout_names_every_module():
    """README's Layout names each module of jax_ub/ and jax_ub/bench/, and each folder of csrc/:
    a new file that it leaves out is a map with a hole."""
    root = SCRIPTS.parent
    text = (root / "README.md").read_text()
    layout = text[text.index("## Layout"):text.index("## Status")]
    names = {p.name for folder in ("jax_ub", "jax_ub/bench") for p in (root / folder).glob("*.py")
             if p.name != "__init__.py"}
    names |= {p.name + "/" for p in (root / "csrc").iterdir() if p.is_dir()}
    names |= {p.name for p in (root / "csrc").glob("*.cc")}
    missing = sorted(n for n in names if not re.search(r"(?<![\w/])" + re.escape(n), layout))
    assert not missing, f"README.md's Layout does not name {missing}"
