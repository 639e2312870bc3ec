"""The engine's next-token choice for one request: penalties, masks, then argmax or a seeded draw.

One `Sampler` per request keeps the tokens it chose (and their counts, for the penalties), so the
generate loop is two calls per step:

    sampler = Sampler(params, eos_token_ids)
    token = sampler.next(logits)
    finish = sampler.stop_reason(token) or ("length" if last else None)

Order follows vLLM: repetition, frequency and presence penalties over the generated tokens, the
min_tokens mask, temperature, min_p, top_k, top_p, then a draw from a per-request generator (same
seed, same logits -> same tokens).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core.engine_reply import TokenBatch
from ..core.sampling import SamplingParams

if TYPE_CHECKING:
    from ..core.prompt import ChatTokenizer


class Sampler:
    def __init__(self, params: SamplingParams, eos_token_ids: list[int]):
        self.params = params
        # Tokens that end the request; min_tokens masks exactly these (ignore_eos takes eos out of both).
        self.stop_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_token_ids)
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.generated: list[int] = []
        self._penalized = params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
        self._counts: torch.Tensor | None = None
        self._stop_index: torch.Tensor | None = None
        self._generator: torch.Generator | None = None

    def next(self, logits: torch.Tensor) -> int:
        """The next token from the last position's logits (1-D over the vocabulary); it is recorded."""
        p = self.params
        x = logits.detach().reshape(-1).to(torch.float32, copy=True)
        if self._penalized:
            x = self._penalize(x)
        if len(self.generated) < p.min_tokens and self.stop_ids:
            if self._stop_index is None:  # ids past the vocabulary cannot be drawn anyway
                ids = sorted(t for t in self.stop_ids if t < x.numel())
                self._stop_index = torch.tensor(ids, dtype=torch.long, device=x.device)
            x[self._stop_index] = -torch.inf
        token = int(x.argmax()) if p.greedy else self._draw(x)
        self.generated.append(token)
        if self._counts is not None:
            self._counts[token] += 1
        return token

    def stop_reason(self, token: int) -> str | None:
        """The finish reason `token` gives: "stop" for eos (unless ignore_eos) or a stop token id, else None."""
        return "stop" if token in self.stop_ids else None

    def _penalize(self, x: torch.Tensor) -> torch.Tensor:
        p = self.params
        if self._counts is None:
            self._counts = torch.zeros(x.numel(), dtype=torch.int32, device=x.device)
            return x  # nothing generated yet
        counts = self._counts.to(torch.float32)
        seen = self._counts > 0
        if p.repetition_penalty != 1:  # vLLM/CTRL: shrink a seen token's logit towards "less likely"
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        return x - p.frequency_penalty * counts - p.presence_penalty * seen.to(torch.float32)

    def _draw(self, x: torch.Tensor) -> int:
        p = self.params
        x /= p.temperature
        if p.min_p > 0:
            probs = torch.softmax(x, 0)
            x[probs < p.min_p * probs.max()] = -torch.inf
        if p.top_k is not None and p.top_k < x.numel():
            x[x < torch.topk(x, p.top_k).values[-1]] = -torch.inf
        if p.top_p < 1:
            probs, order = torch.softmax(x, 0).sort(descending=True)
            before = probs.cumsum(0) - probs  # mass of the more likely tokens; the first one is always kept
            x[order[before >= p.top_p]] = -torch.inf
        if self._generator is None:
            self._generator = torch.Generator(device=x.device).manual_seed(self.seed)
        return int(torch.multinomial(torch.softmax(x, 0), 1, generator=self._generator))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, int, float]]]:
    """The chosen token's log-probability under the model (its raw logits, before penalties and
    temperature, as vLLM reports by default), and (rank, token, logprob) for the `top` most likely
    tokens plus the chosen one at its own rank when it is not among them (Dynamo's and vLLM's
    convention: a position lists the sampled token too)."""
    lp = torch.log_softmax(logits.detach().reshape(-1).float(), 0)
    chosen = float(lp[token])
    ranked = []
    if top:
        best = torch.topk(lp, top)
        ranked = [(r, t, v) for r, (t, v) in enumerate(zip(best.indices.tolist(), best.values.tolist(),
                                                              strict=True), 1)]
    if all(t != token for _, t, _ in ranked):
        ranked.append((1 + int((lp > chosen).sum()), token, chosen))
    return chosen, ranked


@dataclass
class Step:
    token: int
    finish: str | None
    logprob: float | None = None
    top: list[tuple[int, int, float]] | None = None  # (rank, token, logprob), the chosen token included

    def batch(self, tok: ChatTokenizer) -> TokenBatch:
        """This step as a reply item (`core.engine_reply`): with logprobs, the token's and per
        position the records `{rank, token_id, token, logprob, bytes}` (what Dynamo's frontends read)."""
        if self.logprob is None:
            return TokenBatch([self.token], self.finish)
        position = [{"rank": r, "token_id": t, "token": tok.token_text(t), "logprob": v,
                     "bytes": list(tok.token_bytes(t))} for r, t, v in self.top or []]
        return TokenBatch([self.token], self.finish, [self.logprob], [position])
