"""Check what `make dist` built: `python tools/check_dist.py DIST_DIR`.

`twine check --strict` (run by `make dist` before this) checks that the metadata is valid and the
long description renders. This checks what it cannot know:
- the artifacts' names carry the package's one version (`mm_encoder/_version.py`);
- the metadata states what an operator pins against: Requires-Python, the license and its file,
  classifiers, the extras, the entry points Dynamo and vLLM load;
- the wheel holds exactly the expected manifest: every module of `mm_encoder/`, every file the
  package reads at run time (model configs, nginx templates, Kubernetes manifests, the Grafana
  dashboard, graphs, samples), and nothing else (no tests, no benchmarks or their data, no docs);
- the sdist holds what the wheel is built from, and no tests or benchmark data.
Prints the wheel's listing; exit status 1 with every difference named.
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"dev", "dynamo", "frontend", "engine", "stock", "otel", "vllm"}
ENTRY_POINTS = {
    ("console_scripts", "mm-encoder", "mm_encoder.cli:main"),
    ("dynamo.frontend.chat_processors", "mm-encoder", "mm_encoder.frontend.provider:chat_processor"),
    ("vllm.general_plugins", "mm_encoder_glm", "mm_encoder.engines.vllm_glm:register"),
    ("vllm.general_plugins", "mm_encoder_kimi", "mm_encoder.engines.vllm_kimi:register"),
}
SDIST_TOP = {"mm_encoder", "configs", "graphs", "docs", "README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml",
             "constraints.txt", "PKG-INFO", ".gitignore"}


def version() -> str:
    text = (ROOT / "mm_encoder" / "_version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    if match is None:
        raise SystemExit("mm_encoder/_version.py has no __version__ line")
    return match.group(1)


def expected_wheel(v: str) -> set[str]:
    """The package's files as the wheel must hold them (where it reads them at run time)."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mm_encoder").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    files |= {"mm_encoder/_configs/" + p.relative_to(ROOT / "configs").as_posix()
              for p in (ROOT / "configs").rglob("*") if p.is_file()}
    files |= {f"mm_encoder/_graphs/{p.name}" for p in (ROOT / "graphs").glob("*.yaml")}
    info = f"mm_encoder-{v}.dist-info"
    return files | {f"{info}/{n}" for n in ("METADATA", "WHEEL", "entry_points.txt", "RECORD", "licenses/LICENSE")}


def check_wheel(path: Path, v: str) -> list[str]:
    problems = []
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        info = f"mm_encoder-{v}.dist-info"
        meta = Parser().parsestr(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    want = expected_wheel(v)
    problems += [f"wheel lacks {n}" for n in sorted(want - names)]
    problems += [f"wheel holds {n}, which is not in the manifest" for n in sorted(names - want)]
    if meta["Version"] != v:
        problems.append(f"METADATA Version is {meta['Version']}, not {v}")
    for field, value in (("Requires-Python", ">=3.10"), ("License-Expression", "Apache-2.0"),
                         ("License-File", "LICENSE"), ("Description-Content-Type", "text/markdown")):
        if meta[field] != value:
            problems.append(f"METADATA {field} is {meta[field]!r}, not {value!r}")
    if not meta.get_all("Classifier"):
        problems.append("METADATA has no classifiers")
    if set(meta.get_all("Provides-Extra") or []) != EXTRAS:
        problems.append(f"METADATA extras are {sorted(meta.get_all('Provides-Extra') or [])}, not {sorted(EXTRAS)}")
    groups, group = set(), None
    for line in entry_points.splitlines():
        if line.startswith("["):
            group = line.strip("[]")
        elif "=" in line:
            name, target = (s.strip() for s in line.split("=", 1))
            groups.add((group, name, target))
    problems += [f"entry point {g}: {n} = {t} is missing" for g, n, t in sorted(ENTRY_POINTS - groups)]
    return problems


def check_sdist(path: Path, v: str) -> list[str]:
    with tarfile.open(path) as t:
        names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]
    top = {n.split("/")[0] for n in names}
    problems = [f"sdist holds {n}/, which it should not" for n in sorted(top - SDIST_TOP)]
    problems += [f"sdist lacks {n}" for n in sorted(SDIST_TOP - top - {".gitignore"})]
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    dist, v = Path(argv[0]), version()
    wheel, sdist = dist / f"mm_encoder-{v}-py3-none-any.whl", dist / f"mm_encoder-{v}.tar.gz"
    missing = [p.name for p in (wheel, sdist) if not p.is_file()]
    if missing:
        print(f"error: {dist} has no {', '.join(missing)} (version {v}; run make dist)", file=sys.stderr)
        return 1
    problems = check_wheel(wheel, v) + check_sdist(sdist, v)
    with zipfile.ZipFile(wheel) as z:
        for item in sorted(z.infolist(), key=lambda i: i.filename):
            print(f"{item.file_size:>10}  {item.filename}")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    print(f"{wheel.name}, {sdist.name}: " + (f"{len(problems)} problems" if problems else "as expected"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
