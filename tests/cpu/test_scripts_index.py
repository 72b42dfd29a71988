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
