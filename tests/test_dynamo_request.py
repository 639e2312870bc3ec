"""Dynamo's preprocessed request as the engine takes it (engines/dynamo_request.py): the stock
frontend's prompt (the checkpoint's chat template rendered over `{"type": "image"}` /
`{"type": "video"}` parts, one placeholder per item, tokenized) expanded from the Encode worker's
handles to exactly the token ids and spans this project's frontend builds, and every mismatch
refused with a clear error. Tokenizer and template: the tiny Kimi-K2.5 checkpoint's."""

from __future__ import annotations

import pytest
import torch

from mm_encoder import wire
from mm_encoder.core.errors import BadRequest, ContextOverflow, HandleError, RemoteError
from mm_encoder.core.handle import MediaHandle, encoder_result
from mm_encoder.core.prompt import ChatTokenizer, Splicer
from mm_encoder.core.registry import get_spec
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.engines.dynamo_request import chunk, from_preprocessed
from mm_encoder.frontend.chat import StopStrings, parse_messages

STAMPS = ["00:00:00.000", "00:00:02.000"]
SPEC = "kimi-k2.5-vision"


@pytest.fixture(scope="module")
def tok(checkpoint):
    return ChatTokenizer(checkpoint)


@pytest.fixture(scope="module")
def splicer(tok):
    return Splicer(tok, get_spec(SPEC).prompt)


def handle(modality: str, mm_hash: str) -> MediaHandle:
    if modality == "image":
        body = wire.encode(mm_hash=mm_hash, model=SPEC, modality="image", embeds=torch.zeros(12, 8),
                           grid_thws=[[1, 6, 8]])
    else:
        body = wire.encode(mm_hash=mm_hash, model=SPEC, modality="video", embeds=torch.zeros(8, 8),
                           grid_thws=[[4, 4, 4], [4, 4, 4]], timestamps=STAMPS)
    return MediaHandle.build(wire.peek(body), EncodeRequest(model=SPEC, url=f"https://m.test/{mm_hash[:4]}",
                                                     modality=modality), chain=None, route="cluster", rpc=None)


CONTENT = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "https://m.test/i"}},
           {"type": "text", "text": "b"}, {"type": "video_url", "video_url": {"url": "https://m.test/v"}},
           {"type": "image_url", "image_url": {"url": "https://m.test/j"}}]


def stock_ids(tok: ChatTokenizer, content: list[dict] = CONTENT) -> list[int]:
    """What Dynamo's frontend sends: the template rendered over list content, media parts as
    {"type": "image"} / {"type": "video"}, tokenized."""
    parts = [{"type": {"image_url": "image", "video_url": "video"}.get(p["type"], p["type"]),
              **({"text": p["text"]} if p["type"] == "text" else {})} for p in content]
    return tok.encode(tok.render([{"role": "user", "content": parts}]))


def ours(tok: ChatTokenizer, splicer: Splicer, content: list[dict] = CONTENT):
    """Our frontend's path for the same messages: parse (content as given), render, expand the text."""
    messages, media = parse_messages([{"role": "user", "content": content}], 16, splicer.reserved)
    return splicer.expand_text(tok.render(messages), [
        ("image", [12], None) if m.modality == "image" else ("video", [4, 4], STAMPS) for m in media])


def test_the_stock_request_expands_to_what_our_frontend_splices(tok, splicer):
    """Image, video (2 chunks with timestamps), image: the same token ids and spans both ways, the
    handles in prompt order, and the sampling fields carried over."""
    h1, hv, h2 = handle("image", "aa" * 32), handle("video", "bb" * 32), handle("image", "cc" * 32)
    request = {"token_ids": stock_ids(tok), "eos_token_ids": [1],
               "stop_conditions": {"max_tokens": 7, "stop_token_ids_hidden": [1]},
               "sampling_options": {"temperature": 0.5, "seed": 3}, "output_options": {"logprobs": 2},
               "encoder_result": encoder_result({"image": [h1, h2], "video": [hv]})}
    req = from_preprocessed(request, splicer, 512, "rid")
    assert stock_ids(tok) == tok.encode(tok.render([{"role": "user", "content": CONTENT}]))  # both spellings
    expected = ours(tok, splicer)
    assert req.token_ids == expected.token_ids
    assert [m.spans for m in req.media] == expected.spans
    assert [[n for _, n in s] for s in expected.spans] == [[12], [4, 4], [12]]
    assert [m.mm_hash for m in req.media] == [h1.mm_hash, hv.mm_hash, h2.mm_hash]  # prompt order
    assert req.max_tokens == 7
    assert req.sampling == {"temperature": 0.5, "seed": 3, "stop_token_ids": [1], "max_tokens": 7, "logprobs": True,
                            "top_logprobs": 2}
    assert req.request_id == "rid" and req.eos_token_ids == [1]


@pytest.mark.parametrize("before", ["see ", "see  ", "see\n\n", "100 ", "(", "é "])
def test_text_before_a_video_expands_alike(tok, splicer, before):
    """The stock path tokenizes each chunk prompt on its own, ours tokenizes the spliced text whole (as
    transformers' Kimi_K25Processor does): with Kimi's pre-tokenizer split the two agree whatever the
    text before the video ends in (a timestamp's digits never merge with what precedes them)."""
    content = [{"type": "text", "text": before}, {"type": "video_url", "video_url": {"url": "https://m.test/v"}}]
    request = {"token_ids": stock_ids(tok, content), "encoder_result": encoder_result(
        {"video": [handle("video", "bb" * 32)]})}
    req, expected = from_preprocessed(request, splicer, 512), ours(tok, splicer, content)
    assert (req.token_ids, [m.spans for m in req.media]) == (expected.token_ids, expected.spans)


def test_expand_ids_refuses_a_video_placeholder_without_a_video(tok, splicer):
    """A prompt's video placeholder with no video item is an error, as an image placeholder without one is."""
    with pytest.raises(BadRequest, match="more video placeholders than the request has videos"):
        splicer.expand_ids(stock_ids(tok), [("image", [12], None), ("image", [12], None)])


def test_mismatches_are_refused_by_name(tok, splicer):
    """Media without an encoder answer, counts or modalities that differ from the prompt's, bad token
    ids, a foreign or failed encoder result, unsupported sampling fields and a prompt over the context
    are each refused with the error that names them."""
    ids = stock_ids(tok)
    with pytest.raises(BadRequest, match="no encoder_result"):
        from_preprocessed({"token_ids": ids}, splicer, 512)
    with pytest.raises(BadRequest, match="2 image and 1 video placeholders but the encoder answered 1 and 1"):
        from_preprocessed({"token_ids": ids, "encoder_result": encoder_result(
            {"image": [handle("image", "aa" * 32)], "video": [handle("video", "bb" * 32)]})}, splicer, 512)
    # an encoder answer filed under the wrong modality: its header says video where the prompt has an image
    swapped = encoder_result({"image": [handle("video", "aa" * 32), handle("image", "cc" * 32)],
                              "video": [handle("video", "bb" * 32)]})
    with pytest.raises(BadRequest, match=r"placeholders \(image, video chunk, video chunk, image\) do not match "
                                         r"its media items \(video, video, image\)"):
        from_preprocessed({"token_ids": ids, "encoder_result": swapped}, splicer, 512)
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
    with pytest.raises(BadRequest, match="`prompt_logprobs`"):
        from_preprocessed({"token_ids": [5], "output_options": {"prompt_logprobs": 1}}, splicer, 512)
    n = len(ours(tok, splicer).token_ids)
    with pytest.raises(ContextOverflow, match=f"the prompt is {n} tokens after expanding its media; the model's "
                                              "context length is 40"):
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
