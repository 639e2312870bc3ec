"""The releases file (`releases.toml` at the repository root): each release's version, date and commit.

    python tools/releases.py                 every release: version date commit, one a line
    python tools/releases.py latest          the newest release's line
    python tools/releases.py latest commit   one field of it (version, date or commit)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

FILE = Path(__file__).resolve().parents[1] / "releases.toml"


class Release(NamedTuple):
    version: str
    date: str
    commit: str


def releases(path: Path = FILE) -> list[Release]:
    """The releases in the file's order (oldest first)."""
    with path.open("rb") as f:
        return [Release(r["version"], r["date"], r["commit"]) for r in tomllib.load(f)["release"]]


def main(argv: list[str]) -> int:
    rows = releases()
    if argv[:1] == ["latest"]:
        rows = rows[-1:]
    elif argv:
        print(__doc__, file=sys.stderr)
        return 2
    for r in rows:
        print(getattr(r, argv[1]) if len(argv) > 1 else " ".join(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
