"""The encode planner's options: every one from the command line or `MM_PLANNER_<OPTION>` (the
command line wins). A graph's `kind: planner` component passes them as its `args`; `mm-encoder
serve` and `render-k8s` parse them before anything starts, so a bad bound is refused by name."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict, SettingsError

from ..runtime.dynamo import DynamoOptions

REPLICA_LIMIT = 64  # the most encoders any planner may ask for (--max-replicas' own bound)


class PlannerSettings(DynamoOptions):
    """The encode planner: keeps the encoder fleet's demanded patches per second at a target
    utilization of its measured capacity and the p95 queue wait under an SLA, between bounds."""

    model_config = SettingsConfigDict(env_prefix="MM_PLANNER_", cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_prog_name="python -m mm_encoder.planner", extra="forbid", frozen=True,
                                      cli_exit_on_error=False)

    component: str = Field("encoder", min_length=1, description="the graph's encoder component this planner scales")
    min_replicas: int = Field(1, ge=1, description="never fewer encoders (missing or stale data holds, never drops)")
    max_replicas: int = Field(4, ge=1, le=REPLICA_LIMIT, description="never more encoders")
    target_utilization: float = Field(0.7, gt=0, le=1, description="the fleet's demanded patches per second as a "
                                      "share of its measured capacity, in (0, 1]")
    queue_wait_sla_s: float | None = Field(2.0, gt=0, description="p95 wait of admitted items for the device; above "
                                           "it, one more encoder (unset: utilization only)")
    scale_down_margin: float = Field(0.8, gt=0, lt=1, description="hysteresis: scale down only when the smaller "
                                     "fleet would sit below this share of the target")
    interval_s: float = Field(2.0, gt=0, le=300, description="seconds between decisions")
    window_s: float = Field(10.0, gt=0, le=3600, description="rates are taken over this many seconds")
    scale_up_cooldown_s: float = Field(10.0, ge=0, description="after a change, no scale-up for this long")
    scale_down_cooldown_s: float = Field(60.0, ge=0, description="after a change, no scale-down for this long; "
                                         "demand must also have stayed low this long")
    settle_timeout_s: float = Field(120.0, gt=0, description="waiting longer than this for the fleet to reach the "
                                    "count asked for, take the running count as the fleet's (a worker that failed "
                                    "to start, or died)")
    stale_after_s: float = Field(15.0, gt=0, description="a worker unheard from this long is silent: left out of "
                                 "the signals and counted as not running; with every worker silent, the fleet holds")
    min_capacity_pps: float = Field(10.0, ge=0, description="a measured capacity under this many patches per second "
                                    "(about one 448x448 image in 100 s) is taken as unmeasured: a broken measurement "
                                    "must not drive the fleet to --max-replicas; 0: no floor")
    connector: Literal["virtual", "kubernetes"] = Field(
        "virtual", description="how decisions are carried out: Dynamo's VirtualConnector (mm-encoder serve "
                               "executes them) or its KubernetesConnector (the DGD's encoder component)")
    model_name: str = Field("mm-encoder", min_length=1, description="the served model, as Dynamo's connectors "
                            "report it")
    http_host: str = Field("127.0.0.1")
    http_port: int = Field(8010, ge=0, le=65535, description="GET /status (JSON) and /metrics; 0: a free port")
    dry_run: bool = Field(False, description="decide and report, change nothing")

    @model_validator(mode="after")
    def _bounds(self) -> PlannerSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"--min-replicas ({self.min_replicas}) is above --max-replicas ({self.max_replicas})")
        return self


def check_args(args: list[str] | tuple[str, ...]) -> PlannerSettings:
    """A graph's planner `args` as the planner will read them, or a ValueError naming the option:
    what `serve` and `render-k8s` check before anything starts."""
    try:
        return PlannerSettings(_cli_parse_args=list(args))
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False, include_input=False):
            name = str(err["loc"][0]).replace("_", "-") if err["loc"] else ""
            problems.append(f"{'--' + name if name else 'the planner'}: {err['msg'].removeprefix('Value error, ')}")
        raise ValueError("; ".join(problems)) from None
    except SettingsError as e:
        raise ValueError(str(e)) from None
