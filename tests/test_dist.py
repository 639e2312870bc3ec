"""The release artifacts, as an operator gets them: `make dist`'s sdist and wheel pass the standard
metadata checker and the expected manifest, and the wheel, installed with the extras a graph needs
into a fresh virtualenv in a temporary directory (no checkout on `sys.path`), runs the package's
main job there: `mm-encoder serve epd` answers the README's request and stops cleanly.

Network: building resolves hatchling and installing resolves the wheel's dependencies through
pip's configured indexes (the same as `make` does); torch is pinned to the CPU build as in the
Makefile, everything else by `constraints.txt`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mm_encoder
from harness.serve_fixtures import MODEL, Served, chat
from harness.topology import free_port
from mm_encoder import cli

ROOT = Path(__file__).resolve().parents[1]
VERSION = mm_encoder.__version__
EXTRAS = "dynamo,frontend,engine"  # what the EPD graph runs: Dynamo, the chat frontend, the engines

pytestmark = pytest.mark.slow


def _run(argv: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _check_dist():
    spec = importlib.util.spec_from_file_location("check_dist", ROOT / "tools" / "check_dist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """What `make dist` builds: the standard front end, isolated build environment."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], timeout=600)
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A fresh virtualenv outside the checkout with the wheel and its extras; the environment to run it in."""
    home = tmp_path_factory.mktemp("operator")
    # Python's defaults, as on an operator's machine: bytecode is written as modules are first imported
    # (so pip need not compile every file of torch and transformers first: --no-compile below)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")}
    _run([sys.executable, "-m", "venv", str(home / "venv")], timeout=120, cwd=home, env=env)
    bin_ = home / "venv" / "bin"
    env["PATH"] = f"{bin_}{os.pathsep}{env.get('PATH', '')}"
    pip = [str(bin_ / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    _run([*pip, "torch==2.13.0"], timeout=900, cwd=home, env=env)  # the CPU build, as the Makefile pins it
    wheel = dist / f"mm_encoder-{VERSION}-py3-none-any.whl"
    _run([*pip, "-c", str(ROOT / "constraints.txt"), f"{wheel}[{EXTRAS}]"], timeout=900, cwd=home, env=env)
    return home, env


def test_the_artifacts_pass_the_metadata_checker_and_the_manifest(dist):
    names = sorted(p.name for p in dist.iterdir())
    assert names == [f"mm_encoder-{VERSION}-py3-none-any.whl", f"mm_encoder-{VERSION}.tar.gz"]
    _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())], timeout=120)
    checker = _check_dist()
    assert checker.version() == VERSION
    assert checker.check_wheel(dist / names[0], VERSION) == []
    assert checker.check_sdist(dist / names[1], VERSION) == []
    with zipfile.ZipFile(dist / names[0]) as z:
        files = z.namelist()
    assert {f"mm_encoder/_graphs/{p.name}" for p in (ROOT / "graphs").glob("*.yaml")} <= set(files)
    assert "mm_encoder/dashboards/encoder-fleet.json" in files  # render-k8s's Grafana dashboard
    assert not [f for f in files if f.startswith(("tests/", "bench/", "docs/")) or "__pycache__" in f]
    # the docker images COPY exactly this file (tests/test_docker.py checks the Dockerfiles' side)
    assert names[0] == f"mm_encoder-{VERSION}-py3-none-any.whl"


def test_the_manifest_check_names_what_is_missing_or_extra(dist, tmp_path):
    """A wheel that lost a graph and gained a test is refused, naming both."""
    wheel = dist / f"mm_encoder-{VERSION}-py3-none-any.whl"
    bad = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            if item.filename != "mm_encoder/_graphs/epd.yaml":
                dst.writestr(item, src.read(item))
        dst.writestr("tests/test_x.py", "")
    assert _check_dist().check_wheel(bad, VERSION) == [
        "wheel lacks mm_encoder/_graphs/epd.yaml",
        "wheel holds tests/test_x.py, which is not in the manifest",
    ]


def test_the_installed_wheel_runs_without_the_repository(venv, capsys):
    home, env = venv
    bin_ = home / "venv" / "bin"
    run = lambda *argv: _run([*argv], timeout=300, cwd=home, env=env).stdout  # noqa: E731
    where = run(str(bin_ / "python"), "-c", "import mm_encoder; print(mm_encoder.__file__)").strip()
    assert where.startswith(str(home / "venv")) and str(ROOT) not in where
    assert run(str(bin_ / "mm-encoder"), "--version").strip() == VERSION
    assert "kimi-k2.5-vision" in run(str(bin_ / "mm-encoder"), "models")
    graphs = run(str(bin_ / "mm-encoder"), "graphs")
    assert [line.split()[0] for line in graphs.splitlines()[:8]] == ["agg", "encoder-site", "epd", "epd-autoscale",
                                                                  "epd-etcd", "epd-stock", "epd-vllm",
                                                                  "model-cluster"]
    assert str(home / "venv") in graphs.splitlines()[-1]  # read from the install, not the checkout
    rendered = run(str(bin_ / "mm-encoder"), "render-k8s", "epd")  # with the dashboard the wheel ships
    assert "kind: ConfigMap" in rendered and "grafana_dashboard: '1'" in rendered
    assert "mm-encoder-fleet.json" in rendered
    # `mm-encoder encode` on the bundled sample gives what the checkout's package gives
    sample = Path(where).parent / "samples" / "sample.jpg"
    installed = json.loads(run(str(bin_ / "mm-encoder"), "encode", str(sample), "--json", "--dtype", "fp32"))
    assert cli.main(["encode", str(ROOT / "mm_encoder" / "samples" / "sample.jpg"), "--json", "--dtype", "fp32"]) == 0
    here = json.loads(capsys.readouterr().out)
    facts = [(r["modality"], r["mm_hash"], r["grid_thw"], r["tokens"]) for r in installed["results"]]
    assert facts == [(r["modality"], r["mm_hash"], r["grid_thw"], r["tokens"]) for r in here["results"]]
    assert facts[0][3] == 1196  # the sample photo: 52 x 92 patches
    # the entry points Dynamo's frontend and vLLM load resolve in the install
    probe = ("from importlib.metadata import entry_points as ep; "
             "p = ep(group='dynamo.frontend.chat_processors')['mm-encoder'].load(); "
             "g = ep(group='vllm.general_plugins')['mm_encoder_glm'].load(); "
             "k = ep(group='vllm.general_plugins')['mm_encoder_kimi'].load(); "
             "print(p.__module__, g.__module__, k.__module__, callable(p), callable(g), callable(k))")
    assert run(str(bin_ / "python"), "-c", probe).split() == [
        "mm_encoder.frontend.provider", "mm_encoder.engines.vllm_glm", "mm_encoder.engines.vllm_kimi",
        "True", "True", "True"]


def test_the_installed_wheel_serves_the_epd_graph_by_name(venv):
    """The package's main job from the install: `mm-encoder serve epd` (the shipped graph, a
    generated checkpoint, the nginx tiers) answers the README's request; SIGTERM stops everything."""
    home, env = venv
    served = Served("epd", home / "run", free_port(), command=[str(home / "venv" / "bin" / "mm-encoder")],
                    cwd=home, env=env)
    try:
        text = served.wait_for("ready: OpenAI base URL", 300)
        assert f"{home / 'venv'}" in text.splitlines()[0]  # the graph file came from the install
        answer = chat(served.port)
        assert answer["model"] == MODEL and answer["usage"]["completion_tokens"] == 5
        assert answer["usage"]["prompt_tokens"] == 1223  # the README's figure for this request
    finally:
        served.stop()
