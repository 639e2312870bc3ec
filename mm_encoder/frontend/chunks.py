"""The OpenAI chunks a processor streams back: one per engine item, with the engine's logprobs in
OpenAI's shape and the usage on the last."""

from __future__ import annotations

from typing import Any

from ..core.engine_reply import TokenBatch
from ..core.prompt import ChatTokenizer


def chunk(rid: str, created: int, model: str, delta: dict[str, Any], finish: str | None, prompt: int,
          completion: int, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One `chat.completion.chunk`; the last (`finish`) carries the usage."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    out = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if finish:
        out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return out


def logprobs(tok: ChatTokenizer, data: TokenBatch, top: int) -> dict[str, Any]:
    """The engine's logprobs for this step's tokens in OpenAI's form (`choices[].logprobs`): per
    token its text, log-probability and bytes, and the `top` most likely tokens by rank. The
    engine's per-position records (Dynamo's convention: the chosen token among them) carry each
    token's text and bytes; a token without them is decoded here."""
    def entry(record: dict[str, Any]) -> dict[str, Any]:
        tid = int(record["token_id"])
        text, raw = record.get("token"), record.get("bytes")
        return {"token": text if isinstance(text, str) else tok.token_text(tid),
                "logprob": float(record["logprob"]),
                "bytes": raw if isinstance(raw, list) else list(tok.token_bytes(tid))}

    content = []
    for tid, lp, position in zip(data.token_ids, data.log_probs or [], data.top_logprobs or [], strict=False):
        ranked = sorted((r for r in position if isinstance(r, dict)), key=lambda r: r.get("rank", 1 << 30))
        chosen = next((r for r in ranked if r.get("token_id") == tid), {})
        content.append({**entry({**chosen, "token_id": tid, "logprob": lp}),
                        "top_logprobs": [entry(r) for r in ranked[:top]]})
    return {"content": content}
