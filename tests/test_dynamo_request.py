"""Dynamo's preprocessed request as the engine takes it (engines/dynamo_request.py): the stock
frontend's one-placeholder media prompts expanded from the Encode worker's handles to exactly the
token ids this project's frontend builds, and every mismatch refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from mm_encoder import wire
from mm_encoder.core.errors import BadRequest, ContextOverflow, HandleError, RemoteError
from mm_encoder.core.handle import MediaHandle, Source, encoder_result
from mm_encoder.core.prompt import ChatTokenizer, Splicer
from mm_encoder.core.registry import get_spec
from mm_encoder.engines.dynamo_request import chunk, from_preprocessed
from mm_encoder.engines.model_dir import make_model_dir
from mm_encoder.frontend.chat import StopStrings, parse_messages, prompt_segments

STAMPS = ["00:00:00.000", "00:00:02.000"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return ChatTokenizer(make_model_dir(tmp_path_factory.mktemp("lm") / "chat", "tiny", context_length=512))


def handle(modality: str, mm_hash: str) -> MediaHandle:
    if modality == "image":
        body = wire.encode(mm_hash=mm_hash, model="tiny", modality="image", embeds=torch.zeros(12, 8),
                           grid_thws=[[1, 6, 8]])
    else:
        body = wire.encode(mm_hash=mm_hash, model="tiny", modality="video", embeds=torch.zeros(8, 8),
                           grid_thws=[[4, 4, 4], [4, 4, 4]], timestamps=STAMPS)
    return MediaHandle.build(wire.peek(body), Source(model="tiny", url=f"https://m.test/{mm_hash[:4]}",
                                                     modality=modality), chain=None, route="cluster", rpc=None)


CONTENT = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "https://m.test/i"}},
           {"type": "text", "text": "b"}, {"type": "video_url", "video_url": {"url": "https://m.test/v"}},
           {"type": "image_url", "image_url": {"url": "https://m.test/j"}}]


def stock_ids(tok: ChatTokenizer) -> list[int]:
    """What Dynamo's frontend sends: the template rendered over list content, image parts as {"type": "image"}."""
    parts = [{"type": {"image_url": "image", "video_url": "video"}.get(p["type"], p["type"]),
              **({"text": p["text"]} if p["type"] == "text" else {})} for p in CONTENT]
    return tok.encode(tok.render([{"role": "user", "content": parts}]))


def test_the_stock_request_expands_to_what_our_frontend_splices(tok):
    h1, hv, h2 = handle("image", "aa" * 32), handle("video", "bb" * 32), handle("image", "cc" * 32)
    request = {"token_ids": stock_ids(tok), "eos_token_ids": [1],
               "stop_conditions": {"max_tokens": 7, "stop_token_ids_hidden": [1]},
               "sampling_options": {"temperature": 0.5, "seed": 3}, "output_options": {},
               "encoder_result": encoder_result({"image": [h1, h2], "video": [hv]})}
    splicer = Splicer(tok, get_spec("tiny").prompt)
    req = from_preprocessed(request, splicer, 512, "rid")
    # our frontend's path for the same messages: sentinels, segments, splice
    messages, media = parse_messages([{"role": "user", "content": CONTENT}], 16)
    ours = splicer.splice(prompt_segments(tok, messages, len(media)),
                          [("image", [12], None), ("video", [4, 4], STAMPS), ("image", [12], None)])
    assert req.token_ids == ours.token_ids
    assert [m.spans for m in req.media] == ours.spans
    assert [m.mm_hash for m in req.media] == [h1.mm_hash, hv.mm_hash, h2.mm_hash]  # prompt order
    assert req.max_tokens == 7
    assert req.sampling == {"temperature": 0.5, "seed": 3, "stop_token_ids": [1], "max_tokens": 7}
    assert req.request_id == "rid" and req.eos_token_ids == [1]


def test_mismatches_are_refused_by_name(tok):
    splicer = Splicer(tok, get_spec("tiny").prompt)
    ids = stock_ids(tok)
    with pytest.raises(BadRequest, match="no encoder_result"):
        from_preprocessed({"token_ids": ids}, splicer, 512)
    with pytest.raises(BadRequest, match="2 image and 1 video placeholders but the encoder answered 1 and 1"):
        from_preprocessed({"token_ids": ids, "encoder_result": encoder_result(
            {"image": [handle("image", "aa" * 32)], "video": [handle("video", "bb" * 32)]})}, splicer, 512)
    pad = tok.token_id(get_spec("tiny").prompt.placeholder)
    with pytest.raises(BadRequest, match="outside any media item's prompt"):
        from_preprocessed({"token_ids": [5, pad, 6]}, splicer, 512)
    with pytest.raises(BadRequest, match="token_ids"):
        from_preprocessed({"token_ids": ["x"]}, splicer, 512)
    with pytest.raises(HandleError, match="not an mm-encoder result"):
        from_preprocessed({"token_ids": ids, "encoder_result": {"handles": []}}, splicer, 512)
    err = {"mm_encoder": 1, "error": {"code": "forbidden_address", "message": "no", "status": 403}}
    with pytest.raises(RemoteError) as e:
        from_preprocessed({"token_ids": ids, "encoder_result": err}, splicer, 512)
    assert (e.value.code, e.value.http_status) == ("forbidden_address", 403)
    with pytest.raises(BadRequest, match="`n`"):
        from_preprocessed({"token_ids": [5], "sampling_options": {"n": 2}}, splicer, 512)
    with pytest.raises(ContextOverflow, match="context length is 40"):
        from_preprocessed({"token_ids": ids, "encoder_result": encoder_result(
            {"image": [handle("image", "aa" * 32), handle("image", "cc" * 32)],
             "video": [handle("video", "bb" * 32)]})}, splicer, 40)


def test_output_chunks_carry_the_expanded_prompt_length_at_the_end():
    assert chunk(5, None, 100, 1) == {"token_ids": [5], "index": 0}
    assert chunk(6, "stop", 100, 2) == {"token_ids": [6], "index": 0, "finish_reason": "stop",
                                        "completion_usage": {"prompt_tokens": 100, "completion_tokens": 2,
                                                             "total_tokens": 102}}


def test_stop_strings_cut_the_text_across_deltas():
    s = StopStrings(["STOP", "xy"])
    assert s.push("hello S") == ("hello ", False)  # "S" may begin "STOP": held back
    assert s.push("T") == ("", False)
    assert s.push("OP and more") == ("", True)  # the text ends before the stop string
    s = StopStrings(["xy"])
    assert s.push("ax") == ("a", False) and s.push("b") == ("xb", False)
    assert s.push("x", final=True) == ("x", False)  # the end of the stream releases what was held
    assert StopStrings(["xy"]).push("axy tail") == ("a", True)
    assert StopStrings([]).push("anything") == ("anything", False)
