"""Writes jax_ub/_measured.py (what method="auto" chooses from) from bench JSON files:

    python scripts/measured_table.py benchmarks/results/*-ag.json benchmarks/results/*-rs.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jax_ub import choice

OUT = Path(__file__).resolve().parents[1] / "jax_ub" / "_measured.py"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    docs = [json.loads(Path(p).read_text()) for p in sorted(argv)]
    OUT.write_text(choice.render(docs))
    print(f"wrote {OUT} from {len(docs)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
