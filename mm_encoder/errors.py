"""Typed errors with stable codes: the service layer maps them to HTTP 4xx without guessing."""

from __future__ import annotations


class MMEncoderError(Exception):
    """Base class: `code` is stable and machine-readable, the message says what to change."""

    code = "error"
    http_status = 400  # what the HTTP transport answers; subclasses refine it per code

    def __init__(self, message: str, code: str | None = None, http_status: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if http_status is not None:
            self.http_status = http_status

    @property
    def message(self) -> str:
        return str(self.args[0])

    def __str__(self) -> str:
        return f"[{self.code}] {self.args[0]}"


MEDIA_ERROR_CODES = frozenset(
    {
        "empty",  # zero bytes, or an image with a zero-size dimension
        "unsupported_format",  # not an image/video format we decode
        "corrupt",  # truncated or undecodable data
        "too_large",  # more bytes, seconds or frames than the limits allow
        "too_many_pixels",  # header says more pixels than max_pixels (refused before decoding)
        "bad_aspect_ratio",  # long side / short side above max_aspect_ratio
        "no_frames",  # a video without decodable frames
        "bad_input",  # an item of a type the encoder does not take
    }
)


class MediaError(MMEncoderError):
    """Bad media from the user. Never cached, never fatal to the process."""

    code = "corrupt"
    http_status = 422

    def __init__(self, code: str, message: str):
        if code not in MEDIA_ERROR_CODES:
            raise ValueError(f"unknown media error code {code!r}")
        super().__init__(message, code, 413 if code == "too_large" else 422)


class CheckpointError(MMEncoderError):
    """A checkpoint that does not match the model: lists every missing/unexpected/mis-shaped tensor."""

    code = "bad_checkpoint"
    http_status = 500


class UnknownModelError(MMEncoderError, KeyError):
    code = "unknown_model"
    http_status = 404

    def __init__(self, name: str, served: list[str]):
        super().__init__(f"unknown model {name!r}; served names: {', '.join(served)}")
        self.served = served
