"""Dynamo's preprocessed request (what the stock `python -m dynamo.frontend` sends a worker) as an
`EngineRequest`, and our answers as Dynamo's output chunks.

The stock frontend renders the checkpoint's chat template (one placeholder per image, one video
placeholder per video), tokenizes, and forwards the Encode worker's `encoder_result` (handles per
modality). Here each item is expanded to its encoder rows with the same `Splicer` our own frontend
uses (`expand_ids`), so both frontends give an engine the same token ids for images; a video's
chunk prompts are tokenized on their own here. Torch-free.
"""

from __future__ import annotations

import uuid
from typing import Any

from ..core.context import room
from ..core.engine_request import EngineRequest, MediaInput
from ..core.errors import BadRequest
from ..core.handle import parse_encoder_result
from ..core.prompt import Splicer
from ..core.sampling import SamplingParams


def from_preprocessed(request: dict[str, Any], splicer: Splicer, context_length: int,
                      request_id: str | None = None) -> EngineRequest:
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
        raise BadRequest("token_ids must be a list of integers")
    params = SamplingParams.from_dynamo(request)
    handles = parse_encoder_result(request.get("encoder_result"))
    modalities = splicer.media_order(token_ids)
    wanted = {m: modalities.count(m) for m in ("image", "video")}
    got = {m: len(handles.get(m, [])) for m in ("image", "video")}
    if sum(wanted.values()) and "encoder_result" not in request:
        raise BadRequest("the request has media but no encoder_result: no Encode worker answered for it (run the "
                         "encode worker with --stock-model-dir and the engines with --frontend stock)")
    if wanted != got:
        raise BadRequest(f"the prompt has {wanted['image']} image and {wanted['video']} video placeholders but the "
                         f"encoder answered {got['image']} and {got['video']} items")
    queues = {m: list(hs) for m, hs in handles.items()}
    ordered = [queues[m].pop(0) for m in modalities]
    spliced = splicer.expand_ids(token_ids, [(h.header.modality, h.num_tokens, h.header.timestamps) for h in ordered])
    media = [MediaInput(h, list(spans)) for h, spans in zip(ordered, spliced.spans, strict=True)]
    left = room(len(spliced.token_ids), context_length)
    eos = [t for t in request.get("eos_token_ids") or [] if type(t) is int]
    return EngineRequest(request_id or uuid.uuid4().hex, spliced.token_ids, min(params.max_tokens or left, left),
                         eos, media, sampling=params.to_dict())


def chunk(token: int, finish: str | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """One output step; the last carries the usage (prompt_tokens: the prompt as expanded here)."""
    out: dict[str, Any] = {"token_ids": [token], "index": 0}
    if finish is not None:
        out["finish_reason"] = finish
        out["completion_usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                   "total_tokens": prompt_tokens + completion_tokens}
    return out
