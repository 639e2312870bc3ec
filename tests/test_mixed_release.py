"""Mixed releases (docs/versioning.md): one EPD deployment whose components come from this tree and from the
previous release (its wheel, built from its commit in releases.toml, in `.venv-release`), as a rollout that
upgrades sites one by one runs them (`harness/mixed.py`).

In `make test`: the rollout's midpoint in the documented order (encoders and engines upgraded first; tiers
and frontend still the previous release's) answers the README's request token for token as the README says
this release does. In `make soak` (MM_ENCODER_SOAK=1): each release alone, each step of the upgrade order,
the halves of a deployment swapped both ways (with and without the workaround for each), and each role out
of order alone, compared with the all-main answer token for token or refused with its code."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from harness.mixed import (
    MAIN,
    MAIN_FRONTEND_NO_DTYPE,
    MAIN_TIERS_DROP_KEY,
    Install,
    Mixed,
    halves,
    previous_release,
    released,
    tokens,
)
from harness.topology import require_nginx
from harness.venvs import BuildFailed, wait_for_release_build

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
soak = pytest.mark.skipif(os.environ.get("MM_ENCODER_SOAK") != "1", reason="make soak runs it (MM_ENCODER_SOAK=1)")


def readme_content() -> str:
    """The answer README.md shows for its image request (what this release's EPD graph answers)."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith('{"id":"chatcmpl-'))
    return json.loads(line)["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def old() -> Install:
    require_nginx()
    version, commit = previous_release()
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                      capture_output=True).returncode != 0:
        pytest.skip(f"the previous release's commit {commit[:12]} is not in this checkout (a shallow clone?): "
                    "its wheel cannot be built")
    try:
        python = wait_for_release_build()
    except BuildFailed as e:
        pytest.fail(str(e), pytrace=False)
    if not python.exists():
        pytest.fail(f"{python} is missing: make release-venv builds it", pytrace=False)
    return released(version, python)


def serve(tmp_path: Path, checkpoint: Path, installs: dict[str, Install],
          served_from: dict[str, float] | None = None) -> tuple[int, dict]:
    """The README's request against that deployment, twice (a miss, then the tiers' hit): both answers
    must agree; the first one's (status, body). `served_from`: the encode worker's (this tree's) answers by
    level after both."""
    with Mixed(tmp_path / "run", checkpoint.resolve(), installs) as m:
        first, second = m.chat(), m.chat()
        assert outcome(*first) == outcome(*second), m.logs()
        if served_from is not None:
            assert m.served_from() == served_from, m.logs()
        return first


def outcome(status: int, answer: dict) -> tuple[int, object]:
    return status, tokens(answer) if status == 200 else answer.get("message")


def test_upgraded_encoders_and_engines_behind_previous_tiers_and_frontend(tmp_path, checkpoint, old) -> None:
    """The upgrade order's midpoint: the previous release's frontend and tiers, this tree's encoder and engine.
    The frontend asks the tiers by the previous key and the engine by the body's sha256: the encoder is asked
    twice and runs one forward pass (its own cache answers the second); the second request hits the tiers."""
    installs = {"encoder": MAIN, "tiers": old, "engine": MAIN, "frontend": old}
    status, answer = serve(tmp_path, checkpoint, installs, served_from={"forward": 1.0, "mm_hash": 1.0})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == readme_content()
    assert answer["usage"] == {"prompt_tokens": 1223, "completion_tokens": 20, "total_tokens": 1243}


def cases(old: Install) -> dict[str, tuple[dict[str, Install], int, str | None]]:
    """name -> (the install per role, the status, the refusal's `[code]`): docs/versioning.md's table, which is
    the previous release's (0.2.0): cutting a release rewrites both for the next one."""
    n, o, drop, no_dtype = MAIN, old, MAIN_TIERS_DROP_KEY, MAIN_FRONTEND_NO_DTYPE

    def mix(encoder: Install, tiers: Install, engine: Install, frontend: Install) -> dict[str, Install]:
        return {"encoder": encoder, "tiers": tiers, "engine": engine, "frontend": frontend}

    return {"main": (mix(n, n, n, n), 200, None), "previous": (mix(o, o, o, o), 200, None),
            # the upgrade order: encoders, engines, frontends, tiers (the midpoint is make test's case)
            "encoders upgraded": (mix(n, o, o, o), 200, None),
            "frontends upgraded": (mix(n, o, n, n), 200, None),
            # a deployment's halves swapped both ways, and what makes each answer
            "previous front, new back": (halves(n, o), 400, "bad_cache_key"),
            "previous front, new back, tiers --drop-client-key": (mix(n, drop, o, o), 200, None),
            "new front, previous back": (halves(o, n), 400, "bad_request"),
            "new front without --wire-dtype, previous back": (mix(o, o, n, no_dtype), 200, None),
            # one role out of order
            "previous frontend": (mix(n, n, n, o), 400, "bad_cache_key"),
            "previous engine": (mix(n, n, o, n), 500, None),
            "previous encoder": (mix(o, n, n, n), 400, "bad_request")}


@soak
def test_every_mix(tmp_path, checkpoint, old) -> None:
    """Each release alone answers the same tokens; every mix the upgrade order allows answers them too (and
    the halves swapped, with a workaround each); the others are refused with a stable code, never a wrong
    answer. A previous engine's refusal (`bad_handle`: a handle's `source.dtype`) is an HttpError(502) that
    Dynamo 1.6.1's HTTP service turns into a 500 without its message (docs/frontend.md)."""
    results = {name: (serve(tmp_path / re.sub(r"\W+", "-", name), checkpoint, installs), status, code)
               for name, (installs, status, code) in cases(old).items()}
    expected = tokens(results["main"][0][1])
    assert "".join(expected) == readme_content()
    for name, ((status, answer), want, code) in results.items():
        assert status == want, (name, answer)
        if status == 200:
            assert tokens(answer) == expected, name
        elif code:
            assert answer["message"].startswith(f"[{code}] "), (name, answer)
        else:
            assert answer.get("details", {}).get("backend_status") == 502, (name, answer)
