"""Per-request sampling settings, parsed once at the edge and carried to the engine.

Torch-free: the frontend parses and validates them, the engine (`engines.sampling.Sampler`) applies
them. A field this project cannot honour (several choices, prompt logprobs, tools, guided
decoding) is refused with code `unsupported_field` rather than silently ignored: a client asking for it would
otherwise get an answer that looks right and is not. Invalid values are `bad_request`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import BadRequest

UNSUPPORTED = "unsupported_field"
_ONE = "this engine returns one choice"
_NO_PROMPT_LOGPROBS = "this engine returns logprobs of generated tokens only"
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
_NO_SEARCH = "this engine samples, it does not search"
_UNCONSTRAINED = "this engine does not constrain output"

TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=256)]


class SamplingParams(BaseModel):
    """What the engine's sampler needs. The defaults are greedy decoding (this project's engines
    were greedy before sampling existed, and callers that send no sampling field rely on it), so
    `temperature` None or 0 means argmax."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # None, 0 and -1 all mean "no top-k" (stored as None)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    stop: list[StopString] = Field(default_factory=list, max_length=16)  # matched by the detokenizing side
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    logprobs: bool = False  # each generated token's log-probability under the model (raw logits)
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)  # and the most likely alternatives

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int | None) -> int | None:
        return v if v is not None and v > 0 else None

    @model_validator(mode="after")
    def _min_below_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is above max_tokens={self.max_tokens}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def greedy(self) -> bool:
        """True when the next token is always the argmax (after penalties): no random draw needed."""
        return not self.temperature or self.top_k == 1

    # --- transport ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A plain msgpack/JSON-able dict; defaults are left out (an empty dict is greedy)."""
        return self.model_dump(exclude_defaults=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        return _validate(d or {}, {})

    # --- the edges ---------------------------------------------------------------------------

    @classmethod
    def from_openai(cls, request: dict[str, Any]) -> SamplingParams:
        """From an OpenAI chat-completions body (with vLLM's and Dynamo's `nvext` extensions)."""
        _refuse_openai(request)
        nvext = request.get("nvext") or {}
        if not isinstance(nvext, dict):
            raise BadRequest("`nvext` must be an object")
        fields: dict[str, Any] = {}
        names: dict[str, str] = {}  # our field -> the request key it came from, for error messages
        for key in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos", "logprobs",
                    "top_logprobs"):
            if request.get(key) is not None:
                fields[key], names[key] = request[key], key
            elif key in ("top_k", "repetition_penalty", "ignore_eos") and nvext.get(key) is not None:
                fields[key], names[key] = nvext[key], f"nvext.{key}"
        if nvext.get("greed_sampling") is True:
            fields["temperature"], names["temperature"] = 0.0, "nvext.greed_sampling"
        for key in ("max_completion_tokens", "max_tokens"):
            if request.get(key) is not None:
                fields["max_tokens"], names["max_tokens"] = request[key], key
                break
        if request.get("stop") is not None:
            stop = request["stop"]
            fields["stop"], names["stop"] = [stop] if isinstance(stop, str) else stop, "stop"
        return _validate(fields, names)

    @classmethod
    def from_dynamo(cls, request: dict[str, Any]) -> SamplingParams:
        """From Dynamo's preprocessed request (`sampling_options`, `stop_conditions`, `output_options`).
        Keys we do not know are ignored (Dynamo adds fields); known ones we cannot honour are refused."""
        so = _section(request, "sampling_options")
        sc = _section(request, "stop_conditions")
        oo = _section(request, "output_options")
        _refuse(so.get("n") not in (None, 1), "n", so.get("n"), _ONE)
        _refuse(so.get("best_of") not in (None, 1), "best_of", so.get("best_of"), _ONE)
        _refuse(bool(so.get("use_beam_search")), "use_beam_search", True, _NO_SEARCH)
        _refuse(so.get("length_penalty") not in (None, 1, 1.0), "length_penalty", so.get("length_penalty"),
                "it only applies to beam search")
        _refuse(so.get("guided_decoding") is not None, "guided_decoding", None, _UNCONSTRAINED)
        _refuse(oo.get("prompt_logprobs") is not None, "prompt_logprobs", oo.get("prompt_logprobs"),
                _NO_PROMPT_LOGPROBS)
        fields = {k: so[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                                     "frequency_penalty", "repetition_penalty") if so.get(k) is not None}
        fields |= {k: sc[k] for k in ("max_tokens", "stop", "min_tokens", "ignore_eos") if sc.get(k) is not None}
        names = {}
        if oo.get("logprobs") is not None:  # Dynamo's: how many alternatives (0: the chosen token's only)
            fields["logprobs"], fields["top_logprobs"] = True, oo["logprobs"]
            names["top_logprobs"] = "output_options.logprobs"
        if sc.get("stop_token_ids_hidden") is not None:
            fields["stop_token_ids"] = sc["stop_token_ids_hidden"]
            names["stop_token_ids"] = "stop_conditions.stop_token_ids_hidden"
        return _validate(fields, names)


def _validate(fields: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    """pydantic's errors become one 400 listing every bad field by the name the client used."""
    try:
        return SamplingParams.model_validate(fields)
    except ValidationError as e:
        parts = []
        for err in e.errors(include_url=False, include_input=False):
            loc, msg = err["loc"], err["msg"].removeprefix("Value error, ")
            if not loc:  # a check across fields: its message names them
                parts.append(msg)
                continue
            where = names.get(str(loc[0]), str(loc[0])) + "".join(f"[{x}]" for x in loc[1:])
            parts.append(f"`{where}`: {msg}")
        raise BadRequest("invalid sampling parameters: " + "; ".join(parts)) from None


def _section(request: dict[str, Any], key: str) -> dict[str, Any]:
    value = request.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"`{key}` must be an object, not {type(value).__name__}")
    return value


def _refuse(cond: bool, field: str, value: Any, why: str) -> None:
    """A field set to something we cannot honour; scalars are echoed, objects and lists are not."""
    if cond:
        shown = f"={value!r}" if isinstance(value, (bool, int, float, str)) else ""
        raise BadRequest(f"`{field}`{shown} is not supported: {why}", code=UNSUPPORTED)


def _off(value: Any) -> bool:
    """None, empty, False or "none": a field the client sent without asking for anything."""
    return value is None or value is False or value == "none" or (isinstance(value, (dict, list, str)) and not value)


def _refuse_openai(request: dict[str, Any]) -> None:
    """Every OpenAI/vLLM field that asks for something this engine does not do, refused by name."""
    get = request.get
    _refuse(get("n") not in (None, 1), "n", get("n"), _ONE)
    _refuse(get("best_of") not in (None, 1), "best_of", get("best_of"), _ONE)
    _refuse(get("prompt_logprobs") is not None, "prompt_logprobs", get("prompt_logprobs"), _NO_PROMPT_LOGPROBS)
    _refuse(not _off(get("logit_bias")), "logit_bias", get("logit_bias"), "this engine does not bias logits")
    _refuse(bool(get("use_beam_search")), "use_beam_search", get("use_beam_search"), _NO_SEARCH)
    fmt = get("response_format")
    _refuse(fmt is not None and fmt != {"type": "text"}, "response_format", fmt, "only plain text is produced")
    for key in ("tools", "tool_choice", "functions", "function_call"):
        _refuse(not _off(get(key)), key, get(key), "this engine does not call tools")
    for key in ("allowed_token_ids", "bad_words", "structured_outputs"):
        _refuse(not _off(get(key)), key, None, _UNCONSTRAINED)
    for key in sorted(k for k in request if k.startswith("guided_")):
        _refuse(bool(request[key]), key, None, _UNCONSTRAINED)
    nvext = get("nvext")
    if isinstance(nvext, dict):
        for key in sorted(k for k in nvext if k.startswith("guided_")):
            _refuse(bool(nvext[key]), f"nvext.{key}", None, _UNCONSTRAINED)
