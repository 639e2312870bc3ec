"""Mixed releases (docs/versioning.md): one EPD deployment whose components come from this tree and from the
previous release (its wheel, built from its commit in releases.toml, in `.venv-release`), as a rollout that
upgrades sites one by one runs them (`harness/mixed.py`).

In `make test`: the rollout's midpoint in the documented order (encoders and engines upgraded first; tiers
and frontend still the previous release's) answers the README's request token for token as the README says
this release does. In `make soak` (MM_ENCODER_SOAK=1): every release, and the halves of a deployment
swapped both ways, each compared live with the all-main and all-previous answers, or refused with its code."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from harness.mixed import MAIN, Install, Mixed, halves, released, tokens
from harness.topology import require_nginx
from harness.venvs import BuildFailed, wait_for_release_build

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PREVIOUS = "0.2.0"
soak = pytest.mark.skipif(os.environ.get("MM_ENCODER_SOAK") != "1", reason="make soak runs it (MM_ENCODER_SOAK=1)")


def readme_content() -> str:
    """The answer README.md shows for its image request (what this release's EPD graph answers)."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith('{"id":"chatcmpl-'))
    return json.loads(line)["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def old() -> Install:
    require_nginx()
    try:
        python = wait_for_release_build()
    except BuildFailed as e:
        pytest.fail(str(e), pytrace=False)
    if not python.exists():
        pytest.fail(f"{python} is missing: make release-venv builds it", pytrace=False)
    return released(PREVIOUS, python)


def serve(tmp_path: Path, checkpoint: Path, installs: dict[str, Install]) -> tuple[int, dict]:
    """The README's request against that deployment, twice (a miss, then the tiers' hit): both answers
    must agree; the first one's (status, body)."""
    with Mixed(tmp_path / "run", checkpoint.resolve(), installs) as m:
        first, second = m.chat(), m.chat()
        assert outcome(*first) == outcome(*second), m.logs()
        assert first[0] in (200, 400), m.logs()
        return first


def outcome(status: int, answer: dict) -> tuple[int, object]:
    return status, tokens(answer) if status == 200 else answer.get("message")


def test_upgraded_encoders_and_engines_behind_previous_tiers_and_frontend(tmp_path, checkpoint, old) -> None:
    """The upgrade order's midpoint: the previous release's frontend and tiers, this tree's encoder and engine."""
    status, answer = serve(tmp_path, checkpoint, {"encoder": MAIN, "tiers": old, "engine": MAIN, "frontend": old})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == readme_content()
    assert answer["usage"] == {"prompt_tokens": 1223, "completion_tokens": 20, "total_tokens": 1243}


@soak
def test_every_mix(tmp_path, checkpoint, old) -> None:
    """Each release alone answers the same tokens; every mix the upgrade order allows answers them too; the
    two it forbids are refused with a stable code, never a wrong answer."""
    results = {}
    for name, installs in {"main": halves(MAIN, MAIN), "previous": halves(old, old),
                           "tiers last": {"encoder": MAIN, "tiers": old, "engine": MAIN, "frontend": MAIN},
                           "previous front, new back": halves(MAIN, old),
                           "new front, previous back": halves(old, MAIN)}.items():
        results[name] = serve(tmp_path / re.sub(r"\W+", "-", name), checkpoint, installs)
    expected = tokens(results["main"][1])
    assert "".join(expected) == readme_content()
    for name in ("previous", "tiers last"):
        assert results[name][0] == 200 and tokens(results[name][1]) == expected, (name, results[name])
    # The previous frontend's and engine's 0.2 cache key: this tree's tiers check keys against the body.
    assert results["previous front, new back"][0] == 400
    assert results["previous front, new back"][1]["message"].startswith("[bad_cache_key] ")
    # This tree's frontend names the rows' dtype in its encode requests: the previous encoder refuses the field.
    assert results["new front, previous back"][0] == 400
    assert results["new front, previous back"][1]["message"].startswith("[bad_request] invalid encode request: dtype")
