"""Engine output batching (`engines.stream`) and the frontend's exact OpenAI semantics over batched
items: the first tokens are never held, the finish always goes out, logprob records stay with their
tokens, and a stop string ends generation at the token that completed it, however tokens were batched."""

from __future__ import annotations

import math

import pytest

from mm_encoder.core.engine_reply import TokenBatch, Usage, parse_item
from mm_encoder.core.engine_request import EngineRequest
from mm_encoder.core.errors import BadEngineReply, RemoteError
from mm_encoder.engines.front_door import FrontDoor
from mm_encoder.engines.stream import IMMEDIATE, batched, pacing
from mm_encoder.frontend.chat import IncrementalDetokenizer, StopStrings, item_text


def _item(token: int, finish: str | None = None, prompt_tokens: int | None = None,
          timings_ms: dict | None = None) -> TokenBatch:
    usage = None if prompt_tokens is None else Usage(prompt_tokens, 0, timings_ms or {})
    return TokenBatch([token], finish, [-float(token)], [[{"rank": 1, "token_id": token, "logprob": -float(token)}]],
                      usage)


async def _run(items: list[TokenBatch], interval_s: float, immediate: int = IMMEDIATE) -> list[dict]:
    """The batched stream as the wire carries it (`TokenBatch.to_dict`)."""
    async def source():
        for item in items:
            yield item
    return [x.to_dict() async for x in batched(source(), interval_s, immediate)]


async def test_without_an_interval_every_item_goes_out_as_it_came():
    items = [_item(1, prompt_tokens=7), _item(2), _item(3, "length")]
    assert await _run(items, 0) == [i.to_dict() for i in items]


async def test_the_first_items_go_alone_the_rest_merge_until_the_finish():
    """An interval longer than the stream: items 1 and 2 out at once (the time to first text is
    not held), items 3-5 in one item with the finish, their per-token fields concatenated in order;
    the first item's one-off fields stay on it."""
    items = [_item(1, prompt_tokens=7, timings_ms={"prefill": 1.0}), _item(2), _item(3), _item(4), _item(5, "stop")]
    out = await _run(items, 3600)
    assert [x["token_ids"] for x in out] == [[1], [2], [3, 4, 5]]
    assert [x["finish_reason"] for x in out] == [None, None, "stop"]
    assert out[0]["prompt_tokens"] == 7 and "prompt_tokens" not in out[2]
    assert out[2]["log_probs"] == [-3.0, -4.0, -5.0]
    assert [r[0]["token_id"] for r in out[2]["top_logprobs"]] == [3, 4, 5]


async def test_a_stream_that_ends_without_a_finish_still_delivers_its_tokens():
    out = await _run([_item(1), _item(2), _item(3), _item(4)], 3600)
    assert [x["token_ids"] for x in out] == [[1], [2], [3, 4]]


async def test_a_non_streamed_request_gets_its_first_token_then_the_rest_at_the_finish():
    """`EngineRequest.stream` False (the client reads the answer at once): one item alone, then one
    with everything else, whatever the engine's interval; absent or True: the engine's interval."""
    assert pacing(False, 0.02) == (math.inf, 1)
    assert pacing(True, 0.02) == (0.02, IMMEDIATE)
    assert EngineRequest.from_dict({"request_id": "r", "token_ids": [1], "max_tokens": 1}).stream  # absent: True
    items = [_item(1, prompt_tokens=7), _item(2), _item(3), _item(4, "length")]
    out = await _run(items, *pacing(False, 0))
    assert [x["token_ids"] for x in out] == [[1], [2, 3, 4]]
    assert out[1]["finish_reason"] == "length" and out[1]["log_probs"] == [-2.0, -3.0, -4.0]


async def test_a_refusal_is_the_one_item_and_goes_out_at_once():
    """The front door answers a refused request with its error as the only item, unpaced (a
    request whose protocol is another's is refused by name before anything else)."""
    door = _Door()
    request = {"protocol": "mm-encoder.engine/9", "request_id": "r", "token_ids": [1], "max_tokens": 1}
    (err,) = [x async for x in door.generate(request)]
    assert err == {"error": {"code": "bad_request", "status": 400,
                             "message": "this engine speaks 'mm-encoder.engine/1', not protocol 'mm-encoder.engine/9'"}}
    (err,) = [x async for x in door.generate({"request_id": "r", "token_ids": [1], "max_tokens": 5})]
    assert err["error"]["code"] == "context_length_exceeded" and door.generated == 0


class _Door(FrontDoor):
    """A front door over an engine that would generate one token (context length 4)."""

    stream_interval_s = 3600.0
    generated = 0

    @property
    def context_length(self) -> int:
        return 4

    def sampling(self, req):
        return None

    async def inputs(self, req, media):
        return None

    async def tokens(self, req, inputs, sampling, context):
        self.generated += 1
        yield TokenBatch([1], "length"), 0


class _Tok:
    """One character per token id (ids 97.. -> 'a'..), enough for the detokenizer's window logic."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("split", [[1] * 6, [2, 2, 2], [6], [1, 5], [4, 2]])
def test_a_stop_string_ends_at_its_token_however_the_tokens_were_batched(split):
    """"abcdef" with stop "cd": the text is "ab" and generation ends at the 4th token ('d'), so
    usage counts 4 tokens and the logprob records are cut there, whatever the item boundaries."""
    tokens = [ord(c) for c in "abcdef"]
    detok, stops = IncrementalDetokenizer(_Tok()), StopStrings(["cd"])
    text, used_total, pos = "", 0, 0
    for n in split:
        chunk = tokens[pos : pos + n]
        pos += n
        delta, used, matched = item_text(detok, stops, chunk, final=pos == len(tokens))
        text += delta
        used_total += used
        if matched:
            break
    assert (text, used_total, len(detok.ids)) == ("ab", 4, 4)
    assert matched


def test_without_stop_strings_an_item_is_decoded_at_once():
    detok, stops = IncrementalDetokenizer(_Tok()), StopStrings([])
    assert item_text(detok, stops, [ord(c) for c in "hello"], final=True) == ("hello", 5, False)


def test_an_item_is_cut_to_its_first_tokens_with_their_records():
    item = TokenBatch([1, 2, 3], None, [-1.0, -2.0, -3.0], [[], [], []])
    cut = item.first(2)
    assert (cut.token_ids, cut.log_probs, len(cut.top_logprobs)) == ([1, 2], [-1.0, -2.0], 2)


def test_the_frontend_reads_every_reply_field_and_refuses_a_malformed_item():
    """`core.engine_reply.parse_item` on arrival: an item round-trips with every field, a refusal is
    the engine's own error (code and status kept), anything else a 502 `bad_engine_reply`."""
    item = TokenBatch([5, 6], "stop", [-0.5, -1.5], [[{"rank": 1, "token_id": 5, "logprob": -0.5}], []],
                      Usage(12, 8, {"fetch": 1.5, "prefill": 3.0}))
    assert parse_item(item.to_dict()) == item
    assert parse_item({"token_ids": [1]}) == TokenBatch([1])
    with pytest.raises(RemoteError) as e:
        parse_item({"error": {"code": "context_length_exceeded", "message": "too long", "status": 400}})
    assert (e.value.code, e.value.http_status, e.value.message) == ("context_length_exceeded", 400, "too long")
    bad = [[1], {"token_ids": ["a"]}, {"token_ids": [1], "finish_reason": 3},
           {"token_ids": [1, 2], "log_probs": [-1.0]}, {"token_ids": [1], "top_logprobs": [1]},
           {"token_ids": [1], "prompt_tokens": -1}, {"token_ids": [1], "prompt_tokens": 3, "timings_ms": {"x": "y"}}]
    for obj in bad:
        with pytest.raises(BadEngineReply) as e:
            parse_item(obj)
        assert (e.value.code, e.value.http_status) == ("bad_engine_reply", 502), obj
