"""Graphs shipped inside the package: `mm-encoder serve epd` and `mm-encoder render-k8s epd` without a
checkout (`graphs/` is `mm_encoder/_graphs/` in a wheel), `mm-encoder graphs` to list them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mm_encoder.cli import main as cli_main
from mm_encoder.core.errors import GraphError
from mm_encoder.graph import shipped as graph_mod
from mm_encoder.graph.schema import load_graph
from mm_encoder.graph.shipped import find_graph, graphs_dir, shipped_graphs
from mm_encoder.k8s import render as k8s
from mm_encoder.serve import cli as local

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT / "graphs"
NAMES = ["agg", "encoder-site", "epd", "epd-autoscale", "epd-etcd", "epd-stock", "epd-vllm", "model-cluster"]
LISTED = "agg, encoder-site, epd, epd-autoscale, epd-etcd, epd-stock, epd-vllm, model-cluster"


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    """Away from the checkout (no graphs/ in the working directory) and without the override."""
    monkeypatch.delenv("MM_ENCODER_GRAPHS", raising=False)
    monkeypatch.chdir(tmp_path)


def test_graphs_dir_is_the_source_trees_without_a_wheel_copy():
    assert not (ROOT / "mm_encoder" / "_graphs").exists()
    assert graphs_dir() == GRAPHS


def test_find_graph_by_name_and_by_file_name():
    assert find_graph("epd") == GRAPHS / "epd.yaml"
    assert find_graph("epd.yaml") == GRAPHS / "epd.yaml"
    assert find_graph("epd-stock") == GRAPHS / "epd-stock.yaml"
    # the default run directory, /tmp/mm-encoder-<graph's name>, is the same either way
    assert load_graph(find_graph("epd")).name == load_graph(GRAPHS / "epd.yaml").name == "epd"


def test_find_graph_by_path_uses_the_file_as_given(tmp_path):
    copy = tmp_path / "sub" / "mine.yaml"
    copy.parent.mkdir()
    shutil.copy(GRAPHS / "epd.yaml", copy)
    assert find_graph(str(copy)) == copy
    assert find_graph(copy) == copy
    assert find_graph("sub/mine.yaml") == Path("sub/mine.yaml")
    # a file in the working directory wins over the shipped graph of the same name
    shutil.copy(GRAPHS / "agg.yaml", tmp_path / "epd.yaml")
    assert find_graph("epd.yaml") == Path("epd.yaml")
    assert load_graph(find_graph("epd.yaml")).name == "agg"
    assert find_graph("epd") == GRAPHS / "epd.yaml"  # no file named `epd` here


def test_unknown_name_or_missing_file_is_a_graph_error_listing_the_names(tmp_path):
    with pytest.raises(GraphError) as e:
        find_graph("nope")
    assert e.value.message == ("nope: no such graph file, nor a shipped graph's name "
                               f"(shipped graphs, by name: {LISTED}; mm-encoder graphs lists them)")
    missing = tmp_path / "missing.yaml"
    with pytest.raises(GraphError) as e:
        find_graph(str(missing))
    assert e.value.message == (f"{missing}: no such graph file "
                               f"(shipped graphs, by name: {LISTED}; mm-encoder graphs lists them)")
    with pytest.raises(GraphError) as e:  # a directory part: not a name
        find_graph("sub/epd")
    assert e.value.message == ("sub/epd: no such graph file "
                               f"(shipped graphs, by name: {LISTED}; mm-encoder graphs lists them)")


def test_shipped_graphs_are_exactly_the_files_of_graphs_with_their_first_comment_line():
    shipped = shipped_graphs()
    assert list(shipped) == NAMES
    assert sorted(p.stem for p in GRAPHS.glob("*.yaml")) == NAMES
    for name, description in shipped.items():
        first = (GRAPHS / f"{name}.yaml").read_text().splitlines()[0]
        assert first == f"# {description}"
    assert shipped["agg"] == ("The aggregated baseline: each engine runs the whole model, vision tower included "
                              "(no encoder).")
    assert all(len(d) <= 100 and d.endswith((".", ")")) for d in shipped.values())  # one whole sentence each


def test_env_var_names_another_directory(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "small.yaml").write_text("# A small graph for this test.\n#\n# more\n"
                                     + (GRAPHS / "epd.yaml").read_text())
    (mine / "bare.yaml").write_text("name: bare\n")
    (mine / "notes.txt").write_text("# not a graph\n")
    monkeypatch.setenv("MM_ENCODER_GRAPHS", str(mine))
    assert graphs_dir() == mine
    assert shipped_graphs() == {"bare": "", "small": "A small graph for this test."}
    assert find_graph("small") == mine / "small.yaml"
    assert load_graph(find_graph("small.yaml")).name == "epd"
    with pytest.raises(GraphError) as e:
        find_graph("epd")
    assert e.value.message == ("epd: no such graph file, nor a shipped graph's name "
                               "(shipped graphs, by name: bare, small; mm-encoder graphs lists them)")
    monkeypatch.setenv("MM_ENCODER_GRAPHS", str(tmp_path / "absent"))  # not a directory: the next place
    assert graphs_dir() == GRAPHS


def test_a_wheels_copy_comes_before_the_source_tree(tmp_path, monkeypatch):
    """The wheel's layout: <site-packages>/mm_encoder/_graphs/*.yaml."""
    pkg = tmp_path / "site" / "mm_encoder"
    (pkg / "_graphs").mkdir(parents=True)
    shutil.copy(GRAPHS / "agg.yaml", pkg / "_graphs" / "agg.yaml")
    (tmp_path / "site" / "graphs").mkdir()
    monkeypatch.setattr(graph_mod, "_PKG", pkg)
    assert graphs_dir() == pkg / "_graphs"
    assert list(shipped_graphs()) == ["agg"]
    assert find_graph("agg") == pkg / "_graphs" / "agg.yaml"
    (pkg / "_graphs" / "agg.yaml").unlink()
    (pkg / "_graphs").rmdir()
    assert graphs_dir() == tmp_path / "site" / "graphs"  # no wheel copy: the source tree's
    (tmp_path / "site" / "graphs").rmdir()
    with pytest.raises(GraphError) as e:
        graphs_dir()
    assert e.value.message == "no shipped graphs found (set MM_ENCODER_GRAPHS to a graphs/ directory)"
    with pytest.raises(GraphError) as e:
        find_graph("epd")
    assert e.value.message == ("epd: no such graph file, and no shipped graphs found "
                               "(set MM_ENCODER_GRAPHS to a graphs/ directory)")


def test_graphs_command_lists_names_descriptions_and_the_directory(capsys):
    assert cli_main(["graphs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shipped = shipped_graphs()
    assert lines == [f"{name:13s}  {shipped[name]}" for name in NAMES] + [
        f"read from {GRAPHS} (MM_ENCODER_GRAPHS overrides); run one: mm-encoder serve NAME"]


def test_graphs_command_reports_a_missing_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(graph_mod, "_PKG", tmp_path / "site" / "mm_encoder")
    assert cli_main(["graphs"]) == 2
    assert capsys.readouterr().err == ("error: [bad_graph] no shipped graphs found "
                                       "(set MM_ENCODER_GRAPHS to a graphs/ directory)\n")


def test_graphs_command_starts_without_torch(tmp_path):
    code = ("import sys; from mm_encoder.cli import main; rc = main(['graphs']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("agg  ")


def test_render_k8s_by_name_is_the_same_yaml_as_by_path(tmp_path, capsys):
    by_path, by_name, by_file_name = tmp_path / "path.yaml", tmp_path / "name.yaml", tmp_path / "file-name.yaml"
    assert k8s.main([str(GRAPHS / "epd.yaml"), "-o", str(by_path)]) == 0
    assert k8s.main(["epd", "-o", str(by_name)]) == 0
    assert k8s.main(["epd.yaml", "-o", str(by_file_name)]) == 0
    assert capsys.readouterr().err == f"wrote {by_path}\nwrote {by_name}\nwrote {by_file_name}\n"
    assert by_name.read_text() == by_path.read_text() == by_file_name.read_text()
    assert "kind: DynamoGraphDeployment\n" in by_name.read_text()


def test_render_k8s_and_serve_refuse_an_unknown_name(capsys):
    message = f"nope: no such graph file, nor a shipped graph's name (shipped graphs, by name: {LISTED}; " \
              "mm-encoder graphs lists them)"
    assert k8s.main(["nope"]) == 2
    assert capsys.readouterr().err == f"error: [bad_graph] {message}\n"  # k8s.py's style: the code too
    assert local.main(["nope"]) == 2  # refused before anything starts
    assert capsys.readouterr().err == f"error: {message}\n"
