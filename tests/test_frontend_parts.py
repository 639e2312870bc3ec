"""The frontend's parts one by one: routing info, chat parsing and media expansion, max_tokens, cache
keys, wire headers, logprob chunks, the engine's parity with transformers, and that the frontend
handles no embeddings. Everything runs on the tiny random Kimi-K2.5 checkpoint (`checkpoint`
fixture): its tokenizer and chat template, its language model (`Engine`) and its vision tower
(`ckpt_encoder`), against transformers' own `Kimi_K25ForConditionalGeneration` loaded from it."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re

import pytest
import torch
from transformers import Kimi_K25ForConditionalGeneration

from harness.media_factory import image_bytes, natural_image
from harness.worker_fixtures import SERVED, SPEC, MeasuredClient, engine_beside_worker, engine_for, processor_beside
from mm_encoder import wire
from mm_encoder.client.encoder import EncoderClient
from mm_encoder.core.engine_reply import TokenBatch, parse_item
from mm_encoder.core.engine_request import EngineRequest, MediaInput
from mm_encoder.core.errors import BadRequest, ContextOverflow, ModelDirError
from mm_encoder.core.handle import MediaHandle
from mm_encoder.core.prompt import ChatTokenizer, Splicer
from mm_encoder.core.registry import get_spec
from mm_encoder.core.requests import EncodeRequest, MediaRef, cache_key
from mm_encoder.core.sampling import SamplingParams
from mm_encoder.engines.engine import Placed, Prompt
from mm_encoder.frontend import chunks
from mm_encoder.frontend.chat import parse_messages
from mm_encoder.frontend.hold import Hold
from mm_encoder.frontend.processor import Limits, MultimodalProcessor
from mm_encoder.routing import MediaSpan, block_mm_infos, pad_routing_tokens, to_signed64

H1, H2 = "ab" * 32, "cd" * 32
STAMPS = ["00:00:00.000", "00:00:02.000"]
PAD, VPAD = "<|media_pad|>", "<|kimi_k25_video_placeholder|>"


@pytest.fixture(scope="module")
def tok(checkpoint) -> ChatTokenizer:  # the checkpoint's tokenizer and chat template
    return ChatTokenizer(checkpoint)


@pytest.fixture(scope="module")
def splicer(tok) -> Splicer:
    return Splicer(tok, get_spec(SPEC).prompt)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    """transformers' own whole model, loaded by its own loader from the checkpoint's released layout."""
    return Kimi_K25ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def hf_logits(model, ids: list[int], rows: list[tuple[int, torch.Tensor]], last_only: bool = True) -> torch.Tensor:
    """transformers' forward on `inputs_embeds`: the token embeddings with `rows` written at their
    offsets; logits [T or 1, V] (last_only: `logits_to_keep=1`, as its `generate` computes them)."""
    with torch.no_grad():
        x = model.get_input_embeddings()(torch.tensor([ids])).clone()
        for offset, r in rows:
            x[0, offset : offset + r.shape[0]] = r
        return model(inputs_embeds=x, logits_to_keep=1 if last_only else 0).logits[0]


def processor(tok, **limits) -> MultimodalProcessor:
    """A processor with no encoder, router or engine: for the parts that run before them."""
    return MultimodalProcessor(served_name="m", spec=get_spec(SPEC), tokenizer=tok,
                               encoder=EncoderClient(SPEC, rpc_client=object()), router=None, engine_client=None,
                               block_size=16, eos_token_ids=[1], limits=Limits(**{"context_length": 100, **limits}))


# --- routing --------------------------------------------------------------------------------------


def test_the_runtime_threads_option_sets_dynamos_variable_and_honours_one_already_set(checkpoint):
    """`--runtime-threads N` wins; unset, a DYN_RUNTIME_NUM_WORKER_THREADS the operator set stays,
    and without either the runtime gets 1 worker thread."""
    from mm_encoder.frontend.__main__ import RUNTIME_THREADS, set_runtime_threads
    from mm_encoder.frontend.settings import FrontendSettings

    def env_after(args: list[str], env: dict[str, str]) -> dict[str, str]:
        set_runtime_threads(FrontendSettings(_cli_parse_args=["--model-dir", str(checkpoint), *args]), env)
        return env

    assert env_after([], {}) == {RUNTIME_THREADS: "1"}
    assert env_after([], {RUNTIME_THREADS: "4"}) == {RUNTIME_THREADS: "4"}
    assert env_after(["--runtime-threads", "3"], {RUNTIME_THREADS: "4"}) == {RUNTIME_THREADS: "3"}
    with pytest.raises(ValueError):
        FrontendSettings(_cli_parse_args=["--model-dir", str(checkpoint), "--runtime-threads", "0"])


def test_every_dynamo_process_takes_the_shared_options_under_its_own_prefix(checkpoint, monkeypatch):
    """`runtime.dynamo.DynamoOptions` (namespace, log level) in the encode worker, the engine and the
    frontend, `KvOptions` (block size) in the last two; each reads its own environment prefix, and a
    log level that is not one is refused by name."""
    from mm_encoder.encode_worker.settings import WorkerSettings
    from mm_encoder.engines.process import EngineSettings
    from mm_encoder.frontend.settings import FrontendSettings
    from mm_encoder.runtime.dynamo import DynamoOptions, KvOptions

    assert issubclass(WorkerSettings, DynamoOptions) and not issubclass(WorkerSettings, KvOptions)
    assert issubclass(EngineSettings, KvOptions) and issubclass(FrontendSettings, KvOptions)
    monkeypatch.setenv("MM_ENGINE_NAMESPACE", "ns-engine")
    monkeypatch.setenv("MM_FRONTEND_LOG_LEVEL", "debug")
    engine = EngineSettings(_cli_parse_args=["--checkpoint", str(checkpoint), "--block-size", "32"])
    frontend = FrontendSettings(_cli_parse_args=["--model-dir", str(checkpoint)])
    worker = WorkerSettings(_cli_parse_args=["--log-level", "warning"])
    assert (engine.namespace, engine.block_size, engine.log_level) == ("ns-engine", 32, "INFO")
    assert (frontend.namespace, frontend.block_size, frontend.log_level) == ("mm", 16, "DEBUG")
    assert (worker.namespace, worker.log_level) == ("mm", "WARNING")
    with pytest.raises(ValueError, match="log level 'loud' is not one of DEBUG"):
        WorkerSettings(_cli_parse_args=["--log-level", "loud"])


def test_the_entry_point_refuses_options_only_our_launcher_acts_on(checkpoint):
    """Under Dynamo's own frontend the runtime and the HTTP server exist before the provider is
    called: `runtime_threads` (or a port, a drain timeout) in the processor's JSON would do nothing,
    so it is refused by name instead of dropped."""
    from types import SimpleNamespace

    from mm_encoder.frontend.provider import chat_processor

    assert chat_processor(SimpleNamespace(), {"model_dir": str(checkpoint)}).s.runtime_threads is None
    for name, value in (("runtime_threads", 2), ("http_port", 9000)):
        with pytest.raises(ValueError, match=f"'{name}' is an option of `python -m mm_encoder.frontend` only"):
            chat_processor(SimpleNamespace(), {"model_dir": str(checkpoint), name: value})


def test_block_mm_infos_marks_exactly_the_blocks_an_item_covers():
    assert block_mm_infos(40, 16, []) is None  # text only: routes as before
    infos = block_mm_infos(40, 16, [MediaSpan(H1, ((10, 12),)), MediaSpan(H2, ((30, 5),))])
    assert len(infos) == 3
    assert infos[0] == {"mm_objects": [{"mm_hash": int(H1[:16], 16), "offsets": [[10, 16]]}]}
    assert infos[1]["mm_objects"] == [{"mm_hash": int(H1[:16], 16), "offsets": [[16, 22]]},
                                      {"mm_hash": int(H2[:16], 16), "offsets": [[30, 32]]}]
    assert infos[2] == {"mm_objects": [{"mm_hash": int(H2[:16], 16), "offsets": [[32, 35]]}]}
    with pytest.raises(ValueError):
        block_mm_infos(40, 16, [MediaSpan(H1, ((35, 10),))])
    pad = 1_000_000 + (int(H1[:16], 16) & (2**30 - 1))
    assert pad_routing_tokens([1, 2, 3, 4], [MediaSpan(H1, ((1, 2),))]) == [1, pad, pad, 4]
    assert to_signed64(2**64 - 1) == -1 and to_signed64(5) == 5


def test_dynamo_block_hashes_change_only_where_the_image_is():
    from dynamo.llm import compute_block_hash_for_seq

    tokens = list(range(64))
    a = compute_block_hash_for_seq(tokens, 16, block_mm_infos(64, 16, [MediaSpan(H1, ((36, 20),))]))
    b = compute_block_hash_for_seq(tokens, 16, block_mm_infos(64, 16, [MediaSpan(H2, ((36, 20),))]))
    plain = compute_block_hash_for_seq(tokens, 16)
    assert a[:2] == b[:2] == plain[:2]  # blocks before the image: the same KV
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))  # image blocks: never a false hit


# --- chat parsing and media expansion ---------------------------------------------------------------


def _content(*parts: str) -> list[dict]:
    """OpenAI content parts: "i" an image, "v" a video, anything else a text part."""
    media = {"i": ("image_url", "https://m.test/i"), "v": ("video_url", "https://m.test/v")}
    return [{"type": media[p][0], media[p][0]: {"url": media[p][1]}} if p in media else {"type": "text", "text": p}
            for p in parts]


def test_parse_messages_passes_content_through_and_refuses_bad_parts(splicer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": _content("a", "i", "b", "v")}]
    given = copy.deepcopy(messages)
    msgs, media = parse_messages(messages, max_media=4, reserved=splicer.reserved)
    assert msgs == given  # unchanged: the chat template renders the parts as the client sent them
    assert media == [MediaRef("image", "https://m.test/i"), MediaRef("video", "https://m.test/v")]
    for bad in ([], [{"role": "user", "content": [{"type": "audio_url"}]}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], [{"content": "x"}]):
        with pytest.raises(BadRequest):
            parse_messages(bad, max_media=4)
    with pytest.raises(BadRequest, match="at most 2 media items"):
        parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}] * 3}], max_media=2)


async def test_text_holding_a_media_placeholder_token_is_refused_by_name(splicer, tok):
    """A client's `<|media_pad|>` or video placeholder would claim media rows nothing fills: refused,
    naming the token and where it is, in string content and in text parts, and by the processor."""
    assert splicer.reserved == (PAD, VPAD)
    with pytest.raises(BadRequest, match=re.escape(f"messages[0].content contains '{PAD}'")):
        parse_messages([{"role": "user", "content": f"look {PAD} here"}], 4, splicer.reserved)
    with pytest.raises(BadRequest, match=re.escape(f"messages[1].content[2].text contains '{VPAD}'")):
        parse_messages([{"role": "system", "content": "s"},
                        {"role": "user", "content": _content("a", "i", f"x{VPAD}")}], 4, splicer.reserved)
    from dynamo.llm.exceptions import InvalidArgument  # Dynamo's 400 with our message
    proc = processor(tok)
    with pytest.raises(InvalidArgument, match=re.escape(f"[bad_request] messages[0].content contains '{PAD}'")):
        await proc.generate({"messages": [{"role": "user", "content": PAD}]}).__anext__()
    assert proc.stats.errors == {"bad_request": 1}


def test_expand_text_is_the_string_built_expansion(tok, splicer):
    """An image (6 rows), a video of 2 chunks (4 and 3 rows, with timestamps) and an image (2 rows):
    the ids are exactly the tokenized string that the spec's prompts build (each image's placeholder
    repeated, each chunk's prompt with its timestamp and its rows), and each span is a run of its
    modality's token with other tokens on both sides."""
    prompt = get_spec(SPEC).prompt
    text = tok.render([{"role": "user", "content": _content("a", "i", "b", "v", "i")}])
    assert text == (f"<|im_user|>user<|im_middle|>a{prompt.image}b{VPAD}{prompt.image}<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>")
    items = [("image", [6], None), ("video", [4, 3], STAMPS), ("image", [2], None)]
    out = splicer.expand_text(text, items)
    chunks = "".join(prompt.video.format(timestamp=t).replace(VPAD, VPAD * n)
                     for t, n in zip(STAMPS, (4, 3), strict=True))
    expected = (f"<|im_user|>user<|im_middle|>a{prompt.image.replace(PAD, PAD * 6)}b{chunks}"
                f"{prompt.image.replace(PAD, PAD * 2)}<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert tok._tok.decode(out.token_ids, skip_special_tokens=False) == expected
    assert out.token_ids == tok.encode(expected)
    assert [[n for _, n in s] for s in out.spans] == [[6], [4, 3], [2]]
    ids = out.token_ids
    for (modality, _, _), spans in zip(items, out.spans, strict=True):
        run = splicer.placeholder_id if modality == "image" else splicer.video_id
        for offset, n in spans:
            assert ids[offset : offset + n] == [run] * n
            assert ids[offset - 1] != run and ids[offset + n] != run
    assert ids.count(splicer.placeholder_id) == 8 and ids.count(splicer.video_id) == 7
    # Dynamo's stock frontend path (token ids, one placeholder per item) gives the same prompt
    assert splicer.expand_ids(tok.encode(text), items) == out


def test_a_template_that_does_not_match_the_media_items_is_an_error(tok, splicer):
    text = tok.render([{"role": "user", "content": _content("a", "i", "v")}])
    with pytest.raises(ModelDirError, match=r"placeholders \(image\) do not match its media items \(image, image\)"):
        splicer.expand_text(tok.render([{"role": "user", "content": _content("i")}]),
                            [("image", [2], None), ("image", [2], None)])
    with pytest.raises(ModelDirError, match="wrote 1 video placeholders for 2 videos"):
        splicer.expand_text(text, [("image", [2], None), ("video", [1], None), ("video", [1], None)])
    with pytest.raises(ModelDirError, match="do not match"):  # the order matters: the video comes second
        splicer.expand_text(text, [("video", [1], STAMPS[:1]), ("image", [2], None)])
    with pytest.raises(BadRequest, match=r"placeholders \(image, video chunk\) do not match its media items "
                                         r"\(video, image\)"):  # from token ids: the request's fault
        splicer.expand_ids(tok.encode(text), [("video", [1], STAMPS[:1]), ("image", [2], None)])


def test_incremental_detokenizer_equals_decoding_everything(tok):
    from mm_encoder.frontend.chat import IncrementalDetokenizer

    ids = tok.encode("Describe the image: a picture is worth a thousand words, café ☕ 100%!")
    for step in (1, 2, 3):
        d = IncrementalDetokenizer(tok)
        out = "".join(d.push(ids[i : i + step]) for i in range(0, len(ids), step)) + d.flush()
        assert out == tok.decode(ids)
        assert "\ufffd" not in out


def test_max_tokens_is_capped_to_the_context_and_overflow_refused(tok):
    proc = processor(tok, default_max_tokens=30)

    def cap(request, prompt):
        return proc.max_tokens_for(SamplingParams.from_openai(request), prompt)

    assert cap({}, 50) == 30
    assert cap({"max_tokens": 500}, 50) == 50
    assert cap({"max_completion_tokens": 10, "max_tokens": 500}, 50) == 10
    with pytest.raises(ContextOverflow, match=r"context length is 100"):
        cap({}, 100)
    with pytest.raises(BadRequest, match="max_tokens"):
        cap({"max_tokens": 0}, 10)


def test_cache_key_names_what_the_answer_depends_on():
    def documented(model, processor, ref, scope, modality=None):  # sha256 of canonical JSON
        doc = json.dumps([model, processor or {}, ref, scope, modality], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(doc.encode()).hexdigest()

    k = cache_key("tiny", None, "https://x/a.png", "")
    assert k == documented("tiny", None, "https://x/a.png", "")
    assert len({k, cache_key("tiny", None, "https://x/a.png", "t2"), cache_key("other", None, "https://x/a.png", ""),
                cache_key("tiny", {"in_patch_limit": 64}, "https://x/a.png", ""),
                cache_key("tiny", None, "https://x/a.png", "", "image"),
                cache_key("tiny", None, "https://x/a.png", "", "video")}) == 6  # modality is part of the answer
    # a data: URL is keyed by the hash of its text, not the text (which may be megabytes)
    url = "data:image/png;base64,AAAA"
    assert cache_key("tiny", None, url, "") == documented("tiny", None, "sha256:" + hashlib.sha256(url.encode())
                                                          .hexdigest(), "")
    assert cache_key("tiny", None, url, "") != cache_key("tiny", None, "data:image/png;base64,AAAB", "")


def test_wire_peek_reads_the_header_without_the_tensor():
    body = wire.encode(mm_hash=H1, model="tiny", modality="video", embeds=torch.randn(32, 8),
                       grid_thws=[[4, 8, 8], [4, 8, 8]], timestamps=["00:00:00.000", "00:00:02.000"])
    h, m = wire.peek(body), wire.decode(body)
    assert (h.mm_hash, h.length, h.grid_thws, h.timestamps, h.shape) == (m.mm_hash, m.length, m.grid_thws,
                                                                          m.timestamps, m.shape)
    for bad in (b"", b"xx", body[:8], b"\x28\xb5\x2f\xfd" + b"\0" * 20):
        with pytest.raises(wire.WireError):
            wire.peek(bad)


@pytest.mark.parametrize("chunks", [1, 300, 1200])
def test_wire_peek_reads_a_header_longer_than_its_read_size(chunks):
    """Found by bench/hostile_memory.py: a 600 s video's header (300 chunks: grids and timestamps
    over 4 KB) was cut by peek's 4 KB reads, and a value split across two reads lost its key."""
    body = wire.encode(mm_hash=H1, model="tiny", modality="video", embeds=torch.randn(4 * chunks, 8),
                       grid_thws=[[4, 4, 4]] * chunks, timestamps=[f"00:{i // 60:02d}:{i % 60:02d}.000"
                                                                   for i in range(chunks)])
    h, m = wire.peek(body), wire.decode(body)
    assert (h.grid_thws, h.timestamps, h.shape) == (m.grid_thws, m.timestamps, m.shape)
    assert len(h.timestamps) == chunks


# --- logprob chunks and the engine ---------------------------------------------------------------


def _handle(body: bytes, url: str = "https://media.test/a.png") -> MediaHandle:
    return MediaHandle.build(wire.peek(body), EncodeRequest(model=SPEC, url=url), chain=None, route="cluster",
                             rpc=None)


def _image_prompt(tok, splicer, rows: int) -> tuple[list[int], int]:
    """A rendered chat prompt with one image of `rows` rows: (token ids, the image's offset)."""
    text = tok.render([{"role": "user", "content": _content("Describe", "i")}])
    spliced = splicer.expand_text(text, [("image", [rows], None)])
    return spliced.token_ids, spliced.spans[0][0][0]


async def test_engine_first_step_logits_equal_transformers_forward_with_the_rows_written(
        checkpoint, tok, splicer, hf_model):
    """The engine's prefill with media rows written at their span gives transformers' logits for the
    same `inputs_embeds`: bitwise as its `generate` computes them (`logits_to_keep=1`), and within
    1e-6 of the all-positions forward (measured 3e-7: the LM head over T rows sums in another order).
    Greedy decoding with the KV cache (and the prefix store, which then holds the prompt's first
    block) gives the tokens that recomputing the whole sequence each step gives."""
    emb = torch.randn(6, 256, generator=torch.Generator().manual_seed(0))
    ids, off = _image_prompt(tok, splicer, 6)
    body = wire.encode(mm_hash=H1, model=SPEC, modality="image", embeds=emb, grid_thws=[[1, 4, 6]], dtype="float32")
    async with engine_for(checkpoint) as engine:
        assert engine.lm.hidden_size == 256 and 16 <= len(ids) < 32  # one full KV block
        logits, _, _, reused = engine.prefill(Prompt(ids, [(off, emb)], [Placed(H1, "image", [(off, 6)], [[1, 4, 6]])]))
        assert reused == 0 and torch.equal(logits, hf_logits(hf_model, ids, [(off, emb)])[-1])
        full = hf_logits(hf_model, ids, [(off, emb)], last_only=False)
        torch.testing.assert_close(logits, full[-1], rtol=0, atol=1e-6)
        req = EngineRequest("r", ids, 3, [], [MediaInput(_handle(body), [(off, 6)], body)])
        items = [item async for item in engine.generate(req.to_dict())]
    seq = list(ids)
    for _ in range(3):
        seq.append(int(hf_logits(hf_model, seq, [(off, emb)])[-1].argmax()))
    # the first token alone; the rest as the engine batches them (engines.stream)
    assert items[0]["token_ids"] == seq[len(ids):][:1]
    assert [t for item in items for t in item["token_ids"]] == seq[len(ids):]
    assert items[0]["reused_tokens"] == 16 and items[0]["prompt_tokens"] == len(ids)
    assert [item["finish_reason"] for item in items] == [None] * (len(items) - 1) + ["length"]


async def test_engine_refuses_a_span_or_a_width_that_does_not_fit_as_an_error_item(checkpoint, tok, splicer):
    """A span whose length is not the handle's token count is refused before any fetch; a body
    whose rows are not the model's hidden size wide is refused before the prefill. Each is one
    `{"error": ...}` item with its code and status, and nothing is generated."""
    ids, off = _image_prompt(tok, splicer, 6)
    good = wire.encode(mm_hash=H1, model=SPEC, modality="image", embeds=torch.zeros(6, 256), grid_thws=[[1, 4, 6]])
    narrow = wire.encode(mm_hash=H2, model=SPEC, modality="image", embeds=torch.zeros(6, 8), grid_thws=[[1, 4, 6]])
    async with engine_for(checkpoint) as engine:
        short = EngineRequest("r", ids, 2, [], [MediaInput(_handle(good), [(off, 5)])])
        (err,) = [item async for item in engine.generate(short.to_dict())]
        assert (err["error"]["code"], err["error"]["status"], engine.resolver.fetches) == ("bad_request", 400, 0)
        assert f"spans [({off}, 5)] do not match its token counts [6]" in err["error"]["message"]
        wide = EngineRequest("r", ids, 2, [], [MediaInput(_handle(narrow), [(off, 6)], narrow)])
        (err,) = [item async for item in engine.generate(wide.to_dict())]
        assert err["error"] == {"code": "bad_request", "status": 400,
                                "message": f"media {H2[:12]}: embeddings are 8 wide, the model takes 256"}
        assert engine.requests == 0  # neither reached the model


async def test_logprob_chunks_carry_the_engines_logprobs_in_openais_form(checkpoint, tok, splicer, hf_model):
    """With `logprobs`/`top_logprobs: 2` the engine's item carries the chosen token's log-probability
    (log_softmax of transformers' logits) and the two best; the processor's `_logprobs` turns it into
    OpenAI's `choices[].logprobs.content` entry (token text, logprob, UTF-8 bytes, top_logprobs)."""
    emb = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))
    ids, off = _image_prompt(tok, splicer, 6)
    body = wire.encode(mm_hash=H1, model=SPEC, modality="image", embeds=emb, grid_thws=[[1, 4, 6]], dtype="float32")
    req = EngineRequest("r", ids, 1, [], [MediaInput(_handle(body), [(off, 6)], body)],
                        sampling=SamplingParams.from_openai({"logprobs": True, "top_logprobs": 2}).to_dict())
    async with engine_for(checkpoint) as engine:
        (item,) = [item async for item in engine.generate(req.to_dict())]
    lp = torch.log_softmax(hf_logits(hf_model, ids, [(off, emb)])[-1], 0)
    best = torch.topk(lp, 2)
    (token,) = item["token_ids"]
    assert token == int(best.indices[0]) and item["log_probs"] == [float(lp[token])]
    def entry(tid: int) -> dict:
        return {"token": tok.token_text(tid), "logprob": float(lp[tid]), "bytes": list(tok.token_bytes(tid))}

    # Dynamo's per-position records (what its own frontends read): rank, id, text, logprob, bytes
    assert item["top_logprobs"] == [[{"rank": r, "token_id": int(t), **entry(int(t))}
                                     for r, t in enumerate(best.indices, 1)]]
    assert chunks.logprobs(tok, parse_item(item), 2) == {
        "content": [{**entry(token), "top_logprobs": [entry(int(t)) for t in best.indices]}]}
    assert chunks.logprobs(tok, parse_item(item), 1)["content"][0]["top_logprobs"] == [entry(int(best.indices[0]))]
    assert chunks.logprobs(tok, TokenBatch([token]), 2) == {"content": []}  # no logprobs asked: none


def test_a_logprob_entrys_bytes_are_the_tokens_own(tok):
    """OpenAI's `bytes` lets a client rebuild characters split across tokens: "é" is 2 tokens here,
    each shown as U+FFFD, with its own byte; a special token's bytes are its text."""
    ids = [*tok.encode("é"), tok.token_id("<|im_end|>")]
    content = chunks.logprobs(tok, TokenBatch(ids, None, [0.0] * 3, [[]] * 3), 0)
    assert [(e["token"], e["bytes"]) for e in content["content"]] == [
        ("\ufffd", [0xC3]), ("\ufffd", [0xA9]), ("<|im_end|>", list(b"<|im_end|>"))]


# --- in one process on the real Dynamo runtime ----------------------------------------------------


def _image_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(image_bytes(natural_image(112, 84, seed=seed))).decode()


async def test_frontend_holds_no_embeddings(ckpt_encoder, checkpoint, tok, tmp_path, monkeypatch):
    """In one process on the real Dynamo runtime: encode worker, engine (fetching bodies by handle
    over RPC), KvRouter and the processor. The processor's encoder client receives headers only
    (0 body bytes) and the engine request is kilobytes."""
    async with engine_beside_worker(ckpt_encoder, checkpoint, tmp_path, monkeypatch) as (rt, rpc, engine):
        proc = await processor_beside(rt, rpc, tok, MeasuredClient)
        url = _image_url(5)
        request = {"model": SERVED, "max_tokens": 40,
                   "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        chunks = [c async for c in proc.generate(request)]
        assert chunks[-1]["usage"]["completion_tokens"] == 40
        assert proc.encoder.body_bytes == 0 and proc.encoder.calls == 1
        assert engine.resolver.fetches == 1
        assert [n < len(url) + 4096 for n in proc.engine_client.sizes] == [True]  # the data URL once, no embeddings
        assert proc.capacity.waiting == 0 and proc.snapshot()["media_requests_in_flight"] == 0


async def test_a_non_streamed_answer_comes_in_two_engine_items(ckpt_encoder, checkpoint, tok, tmp_path, monkeypatch):
    """A client that reads the answer at once gains nothing from interim items: the engine sends the
    first token alone (the router learns the prefill is done) and the rest at the finish. Streamed,
    or with stop strings (which this processor finds, and may end generation early), the engine's
    interval applies: its first two items alone, then what each interval holds. The answer is the
    same either way."""
    async with engine_beside_worker(ckpt_encoder, checkpoint, tmp_path, monkeypatch) as (rt, rpc, _):
        proc = await processor_beside(rt, rpc, tok, MeasuredClient)
        base = {"model": SERVED, "max_tokens": 12, "ignore_eos": True, "logprobs": True,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _image_url(3)}}]}]}
        answers = {}
        for name, extra in (("whole", {}), ("streamed", {"stream": True}), ("stop", {"stop": ["\x00never"]})):
            chunks = [c async for c in proc.generate({**base, **extra})]
            tokens = [len(c["choices"][0]["logprobs"]["content"]) for c in chunks]
            answers[name] = (tokens, "".join(c["choices"][0]["delta"]["content"] for c in chunks),
                             chunks[-1]["usage"]["completion_tokens"])
    assert [p.get("stream", True) for p in proc.engine_client.payloads] == [False, True, True]
    assert answers["whole"][0] == [1, 11]
    for name in ("streamed", "stop"):
        assert answers[name][0][:2] == [1, 1] and sum(answers[name][0]) == 12
    assert answers["whole"][1:] == answers["streamed"][1:] == answers["stop"][1:]
    assert answers["whole"][2] == 12


async def test_logprobs_end_to_end_equal_transformers(ckpt_encoder, checkpoint, tok, splicer, hf_model, tmp_path,
                                                      monkeypatch):
    """A request with `logprobs: true, top_logprobs: 2` through worker, router and engine (fp32 on
    the wire, so the engine's rows are the encoder's): each chunk's logprob is log_softmax of
    transformers' logits, on the prompt with the image's rows written, for the token chosen, and its
    alternatives are transformers' two best."""
    image = image_bytes(natural_image(112, 84, seed=7))
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    fp32 = {"wire_dtype": "float32"}
    async with engine_beside_worker(ckpt_encoder, checkpoint, tmp_path, monkeypatch, **fp32) as (rt, rpc, _):
        proc = await processor_beside(rt, rpc, tok)
        chunks = [c async for c in proc.generate({"model": SERVED, "max_tokens": 2, "logprobs": True,
                                                  "top_logprobs": 2, "messages": messages})]
    (encoded,) = ckpt_encoder.encode([image])
    spliced = splicer.expand_text(tok.render(messages), [("image", [encoded.num_tokens], None)])
    ids, off = spliced.token_ids, spliced.spans[0][0][0]
    assert chunks[-1]["usage"]["prompt_tokens"] == len(ids) and len(chunks) == 2
    seq = list(ids)
    for step, c in enumerate(chunks):
        (got,) = c["choices"][0]["logprobs"]["content"]
        lp = torch.log_softmax(hf_logits(hf_model, seq, [(off, encoded.embeds)])[-1], 0)
        best = torch.topk(lp, 2)
        token = int(best.indices[0])  # greedy: the most likely token is the one generated
        assert got["token"] == tok.token_text(token) and got["bytes"] == list(tok.token_bytes(token))
        assert [t["token"] for t in got["top_logprobs"]] == [tok.token_text(int(t)) for t in best.indices]
        # the prefill is transformers' computation (bitwise); a KV-cache step sums in another shape than
        # recomputing the sequence does (measured equal here too, but not guaranteed): within 1e-6
        tol = 0 if step == 0 else 1e-6
        assert got["logprob"] == pytest.approx(float(lp[token]), rel=0, abs=tol)
        assert [t["logprob"] for t in got["top_logprobs"]] == pytest.approx(best.values.tolist(), rel=0, abs=tol)
        seq.append(token)


async def test_the_entry_point_provider_returns_a_working_factory(ckpt_encoder, checkpoint, tmp_path, monkeypatch):
    """What Dynamo's frontend (after 1.6.1) does with `--dyn-chat-processor mm-encoder`: resolve the
    entry point, call the provider with its parsed FrontendConfig (Dynamo 1.6.1's own parser) and
    the processor's JSON config, then call the factory for a discovered model. The factory reads
    the checkpoint's card (registry model, context length, eos); the returned engine is Dynamo's
    PythonAsyncEngine; the processor behind it answers a request end to end (real worker and engine
    on the Dynamo runtime in this process)."""
    import argparse
    import importlib.metadata
    from types import SimpleNamespace

    from dynamo.frontend.frontend_args import FrontendArgGroup, FrontendConfig
    from dynamo.llm import PythonAsyncEngine

    from harness.worker_fixtures import until_routable

    (ep,) = [e for e in importlib.metadata.entry_points(group="dynamo.frontend.chat_processors")
             if e.name == "mm-encoder"]
    parser = argparse.ArgumentParser()
    FrontendArgGroup().add_arguments(parser)
    config = FrontendConfig.from_cli_args(parser.parse_args(["--namespace", "mm"]))
    factory = ep.load()(config, {"model_dir": str(checkpoint), "max_media": 4})
    assert factory.s.namespace == "mm" and factory.s.max_media == 4
    eos = json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"]
    async with engine_beside_worker(ckpt_encoder, checkpoint, tmp_path, monkeypatch):
        try:
            made = await factory(SimpleNamespace(name=SERVED), None, None)  # the process's own runtime
            assert isinstance(made, PythonAsyncEngine)
            proc = factory.processors[SERVED]
            assert (proc.spec.name, proc.limits.context_length, proc.eos_token_ids) == (SPEC, 32768, [eos])
            await until_routable(proc.router)
            chunks = [c async for c in proc.generate({"model": SERVED, "max_tokens": 3, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _image_url(6)}}]}]})]
            assert chunks[-1]["usage"]["completion_tokens"] == 3 and factory.encoder.calls == 1
        finally:
            await factory.close()


async def test_requests_beyond_max_inflight_get_a_503_at_once(tok):
    """At twice its capacity the frontend used to queue without bound, until 1,484 of 11,160
    requests hung past their deadline (bench/soak.py); now the excess is refused."""
    from dynamo.llm.exceptions import CannotConnect

    proc = processor(tok, max_inflight_requests=2)
    held = [Hold(proc.capacity, rid, lambda rid: None) for rid in ("a", "b")]  # two requests being served
    with pytest.raises(CannotConnect, match="overloaded"):
        await proc.generate({"messages": [{"role": "user", "content": "hi"}]}).__anext__()
    assert proc.stats.errors == {"overloaded": 1} and proc.capacity.inflight == 2
    for hold in held:
        hold.release()
    assert proc.capacity.inflight == 0


async def test_the_encoder_client_names_its_dtype_and_refuses_rows_of_another():
    """With `--wire-dtype`, every encode request names the rows' dtype (so the tiers' key does), and
    an answer of another dtype (an encoder older than the field) is a 409 `dtype_mismatch`, never
    spliced. Only the chain's network call is replaced: it records the request and answers a header."""
    from mm_encoder.core.errors import RemoteError

    packed = wire.pack(mm_hash="ab" * 32, model=SPEC, modality="image", embeds=torch.zeros(4, 8),
                       grid_thws=[(1, 4, 4)], dtype="bfloat16")
    asked = []

    async def describe(source):
        asked.append(source)
        return packed.header, "http:cluster=HIT"

    for dtype, ok in (("bfloat16", True), ("float32", False), (None, True)):
        client = EncoderClient(SPEC, rpc_client=object(), dtype=dtype)
        client.chain.describe = describe
        ref = MediaRef("image", "https://m.test/a.png")
        if ok:
            assert (await client.embed(ref)).handle.source.dtype == dtype
        else:
            with pytest.raises(RemoteError) as e:
                await client.embed(ref)
            assert (e.value.code, e.value.http_status) == ("dtype_mismatch", 409)
        assert asked[-1].dtype == dtype
    assert len({a.key() for a in asked}) == 3
