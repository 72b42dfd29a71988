"""The bench records ``method="auto"`` chooses from, shipped as package data:
``jax_ub/data/measured.json``, generated from ``benchmarks/records`` by
``python tools/measured_table.py`` (edit the records, not the table).

``DOCS``: one ``{"machine", "date", "records": [...]}`` document per bench file, as
:func:`jax_ub.choice.shapes_from_bench` reads them.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

FILE = "data/measured.json"


def load() -> list[dict[str, Any]]:
    """The documents of the shipped table, read from the installed package."""
    text = resources.files("jax_ub").joinpath(FILE).read_text(encoding="utf-8")
    return list(json.loads(text)["docs"])


DOCS: list[dict[str, Any]] = load()
