"""An engine's reply to an `EngineRequest` (`core.engine_request`), typed, in one place.

A reply is a stream of items over Dynamo's response stream (msgpack), each a map of one of two kinds:

- a **token batch** (`TokenBatch`), the tokens generated since the previous item:

  ============== ======================== =====================================================
  key            type                     meaning
  ============== ======================== =====================================================
  token_ids      list[int]                the new tokens; empty only on a finish without a token
  finish_reason  str | None               on the last item: "stop" (a stop token), "length"
                                          (`max_tokens`), or the engine's own ("abort"); else
                                          None or absent
  log_probs      list[float]              only when the request asked for logprobs: per token
                                          its log-probability (from the raw logits)
  top_logprobs   list[list[record]]       likewise: per token its position's records
                                          `{rank, token_id, logprob[, token, bytes]}`, the
                                          chosen token among them (Dynamo's convention)
  prompt_tokens  int                      first item only (`Usage`): the prompt as the engine
                                          ran it
  reused_tokens  int                      first item only: the prompt tokens its prefix store
                                          (or vLLM's prefix cache) supplied
  timings_ms     map[str, float]          first item only: what the engine spent before the
                                          first token, by stage ("fetch", "decode", "prefill")
  ============== ======================== =====================================================

- a **refusal**: `{"error": {"code": str, "message": str, "status": int}}`, the only item, sent
  instead of any token (`MMEncoderError.to_dict(status=True)`); the frontend answers the client
  with that status and code.

Engines build items with `TokenBatch` and `refusal`; the frontend reads each with `parse_item`,
which checks every field on arrival (a malformed item is `BadEngineReply`, a 502), so nothing
downstream of it reads an untyped map. Token batches merge (`TokenBatch.extend`) when an engine
paces its stream (`engines.stream`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import BadEngineReply, MMEncoderError, RemoteError


@dataclass(slots=True)
class Usage:
    """What the first item says of the request as a whole."""

    prompt_tokens: int
    reused_tokens: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class TokenBatch:
    """One reply item: the tokens generated since the previous one."""

    token_ids: list[int]
    finish_reason: str | None = None
    log_probs: list[float] | None = None
    top_logprobs: list[list[dict[str, Any]]] | None = None
    usage: Usage | None = None  # the first item only

    def extend(self, later: TokenBatch) -> None:
        """`later`'s tokens (and their logprob records) after these; its finish wins; this item's
        usage stays (the first item's is the request's)."""
        self.token_ids = [*self.token_ids, *later.token_ids]
        if later.log_probs is not None:
            self.log_probs = [*(self.log_probs or ()), *later.log_probs]
        if later.top_logprobs is not None:
            self.top_logprobs = [*(self.top_logprobs or ()), *later.top_logprobs]
        self.finish_reason = later.finish_reason

    def first(self, n: int) -> TokenBatch:
        """This item cut to its first n tokens (and their logprob records): a stop string ended it."""
        return TokenBatch(self.token_ids[:n], self.finish_reason,
                          None if self.log_probs is None else self.log_probs[:n],
                          None if self.top_logprobs is None else self.top_logprobs[:n], self.usage)

    def logprob_fields(self) -> dict[str, Any]:
        """`log_probs` and `top_logprobs` where the request asked for them (Dynamo's names)."""
        d: dict[str, Any] = {}
        if self.log_probs is not None:
            d["log_probs"] = self.log_probs
        if self.top_logprobs is not None:
            d["top_logprobs"] = self.top_logprobs
        return d

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"token_ids": self.token_ids, "finish_reason": self.finish_reason,
                             **self.logprob_fields()}
        if self.usage is not None:
            d.update(prompt_tokens=self.usage.prompt_tokens, reused_tokens=self.usage.reused_tokens,
                     timings_ms=self.usage.timings_ms)
        return d


def refusal(error: MMEncoderError) -> dict[str, Any]:
    """The one item of a refused request: the error's code, message and status."""
    return error.to_dict(status=True)


def parse_item(obj: Any) -> TokenBatch:
    """A peer engine's item, checked: a token batch, or the refusal raised as `RemoteError` (its
    code and status); anything else is `BadEngineReply`."""
    if not isinstance(obj, dict):
        raise BadEngineReply(f"an engine's reply item is a map, not a {type(obj).__name__}")
    if "error" in obj:
        raise RemoteError.from_dict(obj["error"], "the engine failed without a message")
    ids = obj.get("token_ids")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise BadEngineReply("an engine's reply item has no list of integer token_ids")
    finish = obj.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise BadEngineReply(f"an engine's finish_reason is a {type(finish).__name__}, not a string")
    log_probs, top = obj.get("log_probs"), obj.get("top_logprobs")
    if log_probs is not None and (not isinstance(log_probs, list) or len(log_probs) != len(ids)
                                  or not all(isinstance(v, (int, float)) for v in log_probs)):
        raise BadEngineReply("an engine's log_probs are not one number per token")
    if top is not None and (not isinstance(top, list) or len(top) != len(ids)
                            or not all(isinstance(p, list) and all(isinstance(r, dict) for r in p) for p in top)):
        raise BadEngineReply("an engine's top_logprobs are not one list of records per token")
    return TokenBatch(ids, finish, log_probs, top, _usage(obj))


def _usage(obj: dict[str, Any]) -> Usage | None:
    if "prompt_tokens" not in obj:
        return None
    prompt, reused, timings = obj["prompt_tokens"], obj.get("reused_tokens", 0), obj.get("timings_ms") or {}
    if type(prompt) is not int or type(reused) is not int or prompt < 0 or reused < 0:
        raise BadEngineReply("an engine's prompt_tokens and reused_tokens must be counts")
    if not isinstance(timings, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                                for k, v in timings.items()):
        raise BadEngineReply("an engine's timings_ms must map stage names to milliseconds")
    return Usage(prompt, reused, {k: float(v) for k, v in timings.items()})
