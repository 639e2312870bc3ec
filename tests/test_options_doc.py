"""Every option of every component is in the docs as the code defines it: the tables between
`<!-- options: NAME -->` markers are what tools/options.py generates from the settings classes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_option_tables_are_what_the_code_defines():
    done = subprocess.run([sys.executable, "tools/options.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_stale_table_is_found(tmp_path):
    """The check fails on a table that lacks an option (here the frontend's without --wire-dtype)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("options_tool", ROOT / "tools" / "options.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    good = tool.table("frontend")
    assert "`--wire-dtype`" in good and "`--https`" in good
    stale = "<!-- options: frontend -->\n" + "\n".join(
        line for line in good.splitlines() if "--wire-dtype" not in line) + "\n<!-- /options -->"
    assert tool.render(stale) != stale
