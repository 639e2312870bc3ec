"""The package's architecture, kept true: which room may import which, what stays torch-free, and
how long a module may grow (README "Layout", docs/architecture.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mm_encoder"
ARCHITECTURE = PKG.parent / "docs" / "architecture.md"


def _allowed() -> dict[str, set[str]]:
    """room -> the rooms (or room.modules) it may import: docs/architecture.md's table, the one statement
    of the rule (entry points at the top, cli.py and worker.py, may import any)."""
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (.+) \|$", ARCHITECTURE.read_text(), re.M)
    return {room: set(re.findall(r"`([a-z0-9_.]+)`", imports)) for room, imports in rows}


ALLOWED = _allowed()
TORCH_FREE = ["mm_encoder", "mm_encoder.cli", "mm_encoder.core.wire", "mm_encoder.core.prompt",
              "mm_encoder.core.revision", "mm_encoder.core.requests", "mm_encoder.runtime.dynamo",
              "mm_encoder.frontend",
              "mm_encoder.frontend.__main__", "mm_encoder.routing", "mm_encoder.client", "mm_encoder.fetch",
              "mm_encoder.engines.model_dir", "mm_encoder.families", "mm_encoder.families.model_card",
              "mm_encoder.serve.cli", "mm_encoder.k8s.render", "mm_encoder.cache_tiers.cli",
              "mm_encoder.serve.status", "mm_encoder.graph.plan", "mm_encoder.dashboards.grafana",
              "mm_encoder.planner", "mm_encoder.planner.__main__",
              "mm_encoder.security", "mm_encoder.security.pki"]
MAX_LINES = 450


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "_configs" not in p.parts)


def _imports(path: Path) -> set[str]:
    """The mm_encoder modules `path` imports, anywhere in the file (lazy imports count too)."""
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    package = parts if path.name == "__init__.py" else parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            mod = ".".join([*base, *(node.module.split(".") if node.module else ())])
            found = [f"{mod}.{a.name}" for a in node.names] if node.module is None else [mod]
        elif isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        else:
            continue
        out.update(m for m in found if m.startswith("mm_encoder"))
    return out


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()) else None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_rooms_import_only_what_they_may(path):
    room = _room(".".join(path.relative_to(PKG.parent).with_suffix("").parts))
    if room is None:  # cli.py, worker.py, __init__.py: the entry points and the facade
        return
    allowed = ALLOWED[room] | {room}
    for imported in _imports(path):
        if imported in ("mm_encoder", "mm_encoder.__version__"):  # the facade's version, for any room
            continue
        parts = imported.split(".")
        target = _room(imported) or parts[1]
        qualified = ".".join(parts[1:3])
        assert target in allowed or qualified in allowed, f"{path.relative_to(PKG)} imports {imported}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_over_the_limit(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_frontend_deploy_and_cli_import_no_torch():
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in TORCH_FREE) + (
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'numpy' not in sys.modules, 'numpy was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


DYNAMO_SEAM = {"runtime/dynamo.py", "routing/__init__.py"}  # the runtime and its calls; its block hash function


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_only_the_seam_imports_dynamo(path):
    """Dynamo's API is reached through `runtime.dynamo` (typed, checked by mypy against Dynamo's stubs)
    and `routing.block_hashes`: a change in Dynamo is met in one place."""
    if str(path.relative_to(PKG)) in DYNAMO_SEAM:
        return
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        assert not any(n == "dynamo" or n.startswith("dynamo.") for n in names), \
            f"{path.relative_to(PKG)} imports Dynamo; go through runtime/dynamo.py"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_loggers_are_named_by_module(path):
    """`logging.getLogger(__name__)` in every module: a log line names the module that wrote it, and
    the loggers' tree is the package's (setting `mm_encoder.planner`'s level reaches all of the room)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "getLogger":
            assert [ast.dump(a) for a in node.args] == [ast.dump(ast.Name("__name__", ast.Load()))] \
                and not node.keywords, f"{path.relative_to(PKG)}:{node.lineno} names its logger otherwise"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if path.name == "__init__.py" else parts)


def test_no_import_circle():
    """No two modules of the package import each other, however indirectly (lazy imports and
    TYPE_CHECKING ones count): each room reads top to bottom, and a change has one direction to go."""
    names = {_module_name(p): p for p in _modules()}

    def resolve(imported: str) -> str | None:  # `from .x import Y` names x.Y: the longest module prefix
        parts = imported.split(".")
        return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in names), None)

    edges = {m: {t for i in _imports(p) if (t := resolve(i)) not in (None, m)} for m, p in names.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in edges[m]:
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                t = stack.pop()
                component.append(t)
                if t == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(names):
        if m not in index:
            visit(m)
    assert circles == []


MAX_FUNCTION_LINES = 60


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_function_over_the_limit(path):
    """A function that does one thing fits on a screen: at most 60 lines, docstring included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{path.relative_to(PKG)}:{node.lineno} {node.name}: {length} lines"


def _readme_layout() -> list[str]:
    """The paths README's "Layout" names: each line's first word, a room's under mm_encoder/."""
    text = (PKG.parent / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    names = []
    for line in block.splitlines():
        if not line.strip() or line.startswith(" " * 4):
            continue  # a continuation of the line above
        word = line.split()[0]
        names.append(f"mm_encoder/{word}" if line.startswith("  ") else word)
    return names


def test_the_readme_layout_names_every_room_and_nothing_else():
    """README's Layout names each room of the package, each top-level folder and each tool, and only
    what is there: the map a newcomer reads first is the tree."""
    named = _readme_layout()
    root = PKG.parent
    rooms = {f"mm_encoder/{p.name}/" for p in PKG.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    top = {f"{path.split('/')[0]}/" for path in tracked
           if "/" in path and not path.startswith(("mm_encoder/", "tools/"))}
    tools = {path for path in tracked if path.startswith("tools/")}
    missing = sorted((rooms | top | tools) - {n.rstrip("*") for n in named} - {".ci/"})
    assert missing == [], f"README's Layout does not name: {missing}"
    for name in named:
        if name == "constraints*.txt":
            continue
        assert (root / name).exists(), f"README's Layout names {name}, which is not in the tree"


def test_the_architecture_table_names_every_room():
    """docs/architecture.md's import table has a row for each room of the package, and no other."""
    rooms = {p.name for p in PKG.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert set(ALLOWED) == rooms
    assert all(imported.split(".")[0] in rooms for imports in ALLOWED.values() for imported in imports)
