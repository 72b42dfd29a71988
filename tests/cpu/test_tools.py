"""CPU tier: tools/README.md lists every file in tools/, and the tools set no ``JAX_UB_*`` variable
that jax_ub does not know."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def test_tools_readme_lists_every_tool():
    text = (TOOLS / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", text, re.M))
    present = {p.name for p in TOOLS.iterdir() if p.is_file() and p.name != "README.md"}
    assert present - listed == set(), f"tools/README.md does not list {sorted(present - listed)}"
    assert listed - present == set(), f"tools/README.md lists missing files {sorted(listed - present)}"


def test_tools_and_examples_set_no_jax_ub_variable_that_jax_ub_calls_unknown():
    """A ``JAX_UB_*`` variable that jax_ub does not read is named 'not a jax_ub setting' by the
    configuration's warning and by the doctor: a tool's own switch needs another name."""
    from jax_ub import config

    # Set or read in code (os.environ[...], env dicts), or in a shell line or usage (NAME=value).
    pattern = re.compile(
        r"""environ(?:\[|\.get\(|\.setdefault\(|\.pop\()\s*["'](JAX_UB_\w+)["']"""
        r"""|["'](JAX_UB_\w+)["']\s*:|\b(JAX_UB_\w+)="""
    )
    used: dict[str, set[str]] = {}
    for folder in ("tools", "examples"):
        for path in sorted(p for ext in ("*.py", "*.sh") for p in (ROOT / folder).rglob(ext)):
            for groups in pattern.findall(path.read_text()):
                used.setdefault("".join(groups), set()).add(str(path.relative_to(ROOT)))
    assert used, "no JAX_UB_* environment use found: the pattern is stale"
    unknown = {n: sorted(used[n]) for n in config.unknown_variables(dict.fromkeys(used, ""))}
    assert unknown == {}, f"variables jax_ub calls unknown, and the files that set them: {unknown}"
