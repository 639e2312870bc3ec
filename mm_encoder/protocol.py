"""The encode request, shared by both transports (HTTP JSON/msgpack bodies and Dynamo RPC dicts).

The response is wire format v1 (`mm_encoder.wire`, docs/wire-format.md); errors are
`{"error": {"code", "message"}}` with the error's HTTP status.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import MMEncoderError
from .spec import PreprocessConfig


class ProcessorOverrides(BaseModel):
    """Per-request processor settings. Each may only lower the model's own value: a client can ask
    for fewer pixels (cheaper), never for more work than the operator configured. Part of mm_hash.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    in_patch_limit: int | None = Field(None, ge=4)
    patch_limit_on_one_side: int | None = Field(None, ge=2)
    in_patch_limit_each_frame: int | None = Field(None, ge=4)
    video_fps: float | None = Field(None, gt=0)

    def apply(self, base: PreprocessConfig) -> PreprocessConfig:
        update = self.model_dump(exclude_none=True)
        for key, value in update.items():
            limit = getattr(base, key)
            if value > limit:
                raise BadRequest(f"processor.{key}={value} is above this model's {limit}; it may only be lowered")
        return base.model_copy(update=update) if update else base


class EncodeRequest(BaseModel):
    """One media item to encode: exactly one of `url` (http, https or data:) and `data` (raw bytes,
    msgpack bodies and Dynamo only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=512)
    url: str | None = Field(None, min_length=1)  # bounded by the body cap; fetch.py caps http(s) URLs
    data: bytes | None = None
    modality: Literal["image", "video"] | None = None  # None: sniffed from the bytes
    processor: ProcessorOverrides | None = None
    scope: str = Field("", max_length=256, description="tenant: URL aliases never answer across scopes")

    @model_validator(mode="after")
    def _one_source(self) -> EncodeRequest:
        if (self.url is None) == (self.data is None):
            raise ValueError("give exactly one of `url` and `data`")
        return self

    @classmethod
    def parse(cls, obj: object) -> EncodeRequest:
        """Validate a decoded body; pydantic's errors become one 400 that lists them all."""
        try:
            return cls.model_validate(obj)
        except ValidationError as e:
            raise BadRequest(_describe(e)) from None

    @classmethod
    def parse_json(cls, body: bytes) -> EncodeRequest:
        try:
            return cls.model_validate_json(body)
        except ValidationError as e:
            raise BadRequest(_describe(e)) from None


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False, include_input=False):
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "invalid encode request: " + "; ".join(parts)


class BadRequest(MMEncoderError):
    code = "bad_request"
    http_status = 400


class Overloaded(MMEncoderError):
    """The bounded queue is full: retry later (or elsewhere) instead of growing memory."""

    code = "overloaded"
    http_status = 503


class Draining(MMEncoderError):
    code = "draining"
    http_status = 503
