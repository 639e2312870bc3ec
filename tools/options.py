"""Every component's option table in the docs, generated from the settings classes themselves, so a
new option is documented the moment it exists (tests/test_options_doc.py runs `--check`):

    python tools/options.py            # rewrites the tables between their markers in README.md and docs/
    python tools/options.py --check    # exit 1 naming each table that differs from what the code says

A table stands between `<!-- options: NAME -->` and `<!-- /options -->`; NAME is a key of TABLES.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
# table name -> (module, settings class or argparse parser factory)
TABLES = {
    "encode-worker": ("mm_encoder.encode_worker.settings", "WorkerSettings"),
    "frontend": ("mm_encoder.frontend.settings", "FrontendSettings"),
    "engine": ("mm_encoder.engines.process", "EngineSettings"),
    "cache-tier": ("mm_encoder.cache_tiers.config", "TierConfig"),
    "planner": ("mm_encoder.planner.settings", "PlannerSettings"),
    "serve": ("mm_encoder.serve.cli", "parser"),
}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(<!-- options: ([a-z-]+) -->\n)(.*?)(<!-- /options -->)", re.S)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "(required)"
    value = info.default if info.default_factory is None else info.default_factory()  # type: ignore[call-arg]
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) if value else "none"
    return str(value) if value != "" else "none"  # an empty code span would not show


def _settings_rows(cls: Any) -> list[tuple[str, str, str, str]]:
    prefix = cls.model_config.get("env_prefix", "")
    rows = []
    for name, info in cls.model_fields.items():
        flag = "--" + (info.alias or name).replace("_", "-")
        rows.append((flag, f"{prefix}{(info.alias or name).upper()}", _default(info), info.description or ""))
    return rows


def _parser_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = ", ".join(action.option_strings) or action.dest.upper()
        default = "(required)" if action.required or not action.option_strings else \
            "false" if action.default is False else "unset" if action.default is None else str(action.default)
        rows.append((flag, "", default, action.help or ""))
    return rows


def table(name: str) -> str:
    """The markdown table of one component's options."""
    module, attr = TABLES[name]
    obj = getattr(importlib.import_module(module), attr)
    if isinstance(obj, type):
        rows = _settings_rows(obj)
        head = "| option | environment | default | what |\n|---|---|---|---|\n"
        return head + "".join(f"| `{f}` | `{e}` | `{d}` | {w} |\n" for f, e, d, w in rows)
    rows = _parser_rows(obj())
    head = "| option | default | what |\n|---|---|---|\n"
    return head + "".join(f"| `{f}` | `{d}` | {w} |\n" for f, _, d, w in rows)


def render(text: str) -> str:
    return _BLOCK.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    stale, found = [], set()
    for doc in DOCS:
        text = doc.read_text()
        found |= {m.group(2) for m in _BLOCK.finditer(text)}
        new = render(text)
        if new != text:
            stale.append(str(doc.relative_to(ROOT)))
            if not args.check:
                doc.write_text(new)
    missing = sorted(set(TABLES) - found)
    if missing:
        print(f"no table for: {', '.join(missing)} (add <!-- options: NAME --><!-- /options --> to a doc)")
        return 1
    if stale and args.check:
        print(f"option tables differ from the code in: {', '.join(stale)} (run python tools/options.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
