"""`mm-encoder cache up|render` (`python -m mm_encoder.cache_tiers`): one nginx cache tier or the
shard router, every option a `TierConfig` field.

    mm-encoder cache up --tier cluster --listen 127.0.0.1:8081 --next 127.0.0.1:8082 --direct 127.0.0.1:8090
    mm-encoder cache up --tier router  --listen 127.0.0.1:8082 --shard 127.0.0.1:8083 --shard 127.0.0.1:8084
    mm-encoder cache up --tier shared  --listen 127.0.0.1:8083 --next 127.0.0.1:8090
    mm-encoder cache render ...        # the config on stdout (for a Kubernetes ConfigMap)

With --tls-cert, `up` runs nginx as its child and reloads it when the certificate files change
(`supervise.py`; --tls-watch-s sets how often they are read).
"""

from __future__ import annotations

import sys
from typing import Literal

from pydantic import Field, ValidationError
from pydantic_settings import CliPositionalArg, SettingsError

from ..core.errors import MMEncoderError
from .config import TierConfig
from .nginx import render, up
from .supervise import WATCH_S


class _Command(TierConfig):
    action: CliPositionalArg[Literal["up", "render"]] = Field(
        description="up: run nginx in the foreground; render: print the config")
    tls_watch_s: float = Field(WATCH_S, gt=0, description="with TLS, `up`: how often the certificate, key and CA "
                                                          "files are read; nginx reloads when they change")


def _parse(argv: list[str]) -> tuple[_Command, TierConfig]:
    cmd = _Command(_cli_parse_args=argv)
    return cmd, TierConfig.model_validate(cmd.model_dump(exclude={"action", "tls_watch_s"}))


def parse_args(argv: list[str]) -> tuple[str, TierConfig]:
    """`mm-encoder cache` arguments -> (action, config)."""
    cmd, cfg = _parse(argv)
    return cmd.action, cfg


def main(argv: list[str] | None = None) -> int:
    """`mm-encoder cache up|render`: an nginx cache tier or the shard router."""
    try:
        cmd, cfg = _parse(sys.argv[1:] if argv is None else argv)
        if cmd.action == "render":
            print(render(cfg))
            return 0
        return up(cfg, cmd.tls_watch_s)
    except (ValidationError, SettingsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MMEncoderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
