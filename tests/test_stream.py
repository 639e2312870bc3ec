"""Engine output batching (`engines.stream`) and the frontend's exact OpenAI semantics over batched
items: the first tokens are never held, the finish always goes out, logprob records stay with their
tokens, and a stop string ends generation at the token that completed it, however tokens were batched."""

from __future__ import annotations

import math

import pytest

from mm_encoder.engines.stream import IMMEDIATE, batched, pacing
from mm_encoder.frontend.chat import IncrementalDetokenizer, StopStrings, first_tokens, item_text


def _item(token: int, finish: str | None = None, **extra) -> dict:
    return {"token_ids": [token], "finish_reason": finish, "log_probs": [-float(token)],
            "top_logprobs": [[{"rank": 1, "token_id": token, "logprob": -float(token)}]], **extra}


async def _run(items: list[dict], interval_s: float, immediate: int = IMMEDIATE) -> list[dict]:
    async def source():
        for item in items:
            yield item
    return [x async for x in batched(source(), interval_s, immediate)]


async def test_without_an_interval_every_item_goes_out_as_it_came():
    items = [_item(1, prompt_tokens=7), _item(2), _item(3, "length")]
    assert await _run(items, 0) == items


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
    assert pacing({"stream": False}, 0.02) == (math.inf, 1)
    assert pacing({}, 0.02) == pacing({"stream": True}, 0.02) == (0.02, IMMEDIATE)
    items = [_item(1, prompt_tokens=7), _item(2), _item(3), _item(4, "length")]
    out = await _run(items, *pacing({"stream": False}, 0))
    assert [x["token_ids"] for x in out] == [[1], [2, 3, 4]]
    assert out[1]["finish_reason"] == "length" and out[1]["log_probs"] == [-2.0, -3.0, -4.0]


async def test_an_error_item_goes_out_at_once():
    err = {"error": {"code": "bad_request", "message": "no", "status": 400}}
    assert await _run([err], 3600) == [err]


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
    item = {**_item(1), "token_ids": [1, 2, 3], "log_probs": [-1.0, -2.0, -3.0], "top_logprobs": [[], [], []]}
    cut = first_tokens(item, 2)
    assert (cut["token_ids"], cut["log_probs"], len(cut["top_logprobs"])) == ([1, 2], [-1.0, -2.0], 2)
