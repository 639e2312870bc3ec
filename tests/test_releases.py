"""releases.toml names each release's commit (tools/releases.py reads it): the commit's own
`mm_encoder/_version.py` says that version, CHANGELOG.md has its `[X.Y.Z] - date` section, and the
releases come oldest first, each older than the version in this tree."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.version import Version

import mm_encoder

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("releases_tool", ROOT / "tools" / "releases.py")
assert _spec is not None and _spec.loader is not None
releases_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(releases_tool)
RELEASES = releases_tool.releases()


def test_releases_are_ordered_and_in_the_changelog() -> None:
    versions = [Version(r.version) for r in RELEASES]
    assert versions == sorted(set(versions)), "releases.toml: one entry per release, oldest first"
    assert versions[-1] <= Version(mm_encoder.__version__)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for r in RELEASES:
        assert re.fullmatch(r"[0-9a-f]{40}", r.commit), f"{r.version}: the full 40-hex commit sha"
        assert f"## [{r.version}] - {r.date}\n" in changelog, f"{r.version}: no CHANGELOG section of that date"
    # tools/venv.sh reads the newest entry without Python: `version = "..."` and `commit = "<sha>"` lines
    text = (ROOT / "releases.toml").read_text()
    assert re.findall(r'^version = "(.+)"$', text, re.M) == [r.version for r in RELEASES]
    assert re.findall(r'^commit = "([0-9a-f]{40})"$', text, re.M) == [r.commit for r in RELEASES]


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.parametrize("release", RELEASES, ids=[r.version for r in RELEASES])
def test_the_commit_has_its_version(release) -> None:
    """Where the history is here (CI's clean clone): the recorded commit's `_version.py` says that version."""
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist, or no git): the release commits cannot be read")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: the release commits are not in its history")
    out = _git("show", f"{release.commit}:mm_encoder/_version.py")
    assert out.returncode == 0, f"release {release.version}: {release.commit} is not in this history: {out.stderr}"
    assert re.search(rf'^__version__ = "{re.escape(release.version)}"$', out.stdout, re.M), out.stdout
