"""The engine on real checkpoints, in this process (no Dynamo): the checkpoint's language model as
transformers runs it, prefix reuse, M-RoPE positions for GLM, bf16, refusals.

References are transformers' own model classes: `Glm4vForConditionalGeneration.generate` with the
same precomputed image rows (its own `get_rope_index` inside), and the engine without reuse.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from harness.media_factory import image_bytes, natural_image
from mm_encoder.core.errors import CheckpointError
from mm_encoder.core.prompt import ChatTokenizer, Splicer
from mm_encoder.core.registry import get_spec
from mm_encoder.core.sampling import SamplingParams
from mm_encoder.engines.engine import Engine, Placed, Prompt
from mm_encoder.engines.llm import LanguageModel
from mm_encoder.engines.prefix_cache import PrefixCache
from mm_encoder.engines.tiny_checkpoint import write_checkpoint
from mm_encoder.model.encoder import Encoder

pytest.importorskip("dynamo.llm")  # the block hashes are Dynamo's own


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("glm") / "glm-tiny", "glm-tiny")


def _prompt(ckpt, spec_name: str, encoder: Encoder, texts: list[str], images: list[bytes]) -> Prompt:
    """The frontend's way: the checkpoint's template over OpenAI parts, each image's rows spliced."""
    tok = ChatTokenizer(ckpt)
    splicer = Splicer(tok, get_spec(spec_name).prompt)
    parts = []
    for i, text in enumerate(texts):
        parts.append({"type": "text", "text": text})
        if i < len(images):
            parts.append({"type": "image_url", "image_url": {"url": "x"}})
    results = [encoder.encode_file(data)[0] for data in images]
    spliced = splicer.expand_text(tok.render([{"role": "user", "content": parts}]),
                                  [("image", [r.num_tokens], None) for r in results])
    rows = [(spans[0][0], r.embeds) for r, spans in zip(results, spliced.spans, strict=True)]
    media = [Placed(r.mm_hash, "image", list(spans), [list(r.grid_thw)])
             for r, spans in zip(results, spliced.spans, strict=True)]
    return Prompt(spliced.token_ids, rows, media)


def _greedy(engine: Engine, prompt: Prompt, n: int) -> tuple[list[int], int]:
    async def run():
        steps = [(s, r) async for s, r in engine.decode(Prompt(prompt.token_ids, list(prompt.rows), prompt.media), n,
                                                          SamplingParams(), [])]
        return [s.token for s, _ in steps], steps[0][1]

    return asyncio.run(run())


def _engine(ckpt, spec_name: str, **kw) -> Engine:
    return Engine(LanguageModel.load(ckpt), splicer=Splicer(ChatTokenizer(ckpt), get_spec(spec_name).prompt), **kw)


def test_glm_engine_answers_what_transformers_glm4v_generate_answers(glm_checkpoint):
    """GLM's M-RoPE: positions from each image's grid. The engine (its positions from transformers'
    `get_rope_index`, its text model loaded from the LM shards alone) and transformers' whole
    `Glm4vForConditionalGeneration` (given the same image rows, computing positions itself) agree
    token for token, for one image and for two."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from mm_encoder.engines.llm import _language_model_tensors, read_config

    config = read_config(glm_checkpoint)
    # the reference's own ViT is unused (rows are given): build it small, load the language model
    cfg = Glm4vConfig.from_dict({**config, "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2,
                                                             "out_hidden_size": 256, "intermediate_size": 64}})
    ref = Glm4vForConditionalGeneration(cfg).eval()
    state = {("model.language_model." + k[6:] if k.startswith("model.") else k): v
             for k, v in _language_model_tensors(glm_checkpoint, LanguageModel.load(glm_checkpoint).family).items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing)
    encoder = Encoder.from_pretrained(glm_checkpoint, dtype="fp32")
    engine = _engine(glm_checkpoint, "glm-5.2-vision")
    images = [image_bytes(natural_image(140, 84, seed=1)), image_bytes(natural_image(84, 112, seed=2))]
    for n_images in (1, 2):
        prompt = _prompt(glm_checkpoint, "glm-5.2-vision", encoder, ["Look", "and", "compare"][: n_images + 1],
                         images[:n_images])
        ids = torch.tensor([prompt.token_ids])
        types = torch.zeros_like(ids, dtype=torch.int32)
        for m in prompt.media:
            (offset, n), = m.spans
            types[0, offset : offset + n] = 1
        rows = tuple(r for _, r in prompt.rows)
        with torch.inference_mode():
            out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=6, min_new_tokens=6, mm_token_type_ids=types,
                               image_grid_thw=torch.tensor([m.grids[0] for m in prompt.media]),
                               mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=rows)})
        ours, _ = _greedy(engine, prompt, 6)
        assert ours == out[0, ids.shape[1] :].tolist()
        # the M-RoPE positions are not plain ones: an image's tokens share a temporal position
        positions = engine.lm.positions(prompt.token_ids, [(m.modality, m.spans, m.grids) for m in prompt.media])
        assert positions.max() + 1 < len(prompt.token_ids)


@pytest.mark.parametrize("which", ["kimi", "glm"])
def test_a_reused_prefix_gives_the_same_answer_as_a_full_prefill(which, checkpoint, glm_checkpoint):
    """The second prompt shares the first one's blocks (the same image after the same text): the
    engine with the prefix store prefills only the rest and answers what an engine without a store
    answers; its first logits agree to float noise."""
    ckpt, spec = (checkpoint, "kimi-k2.5-vision") if which == "kimi" else (glm_checkpoint, "glm-5.2-vision")
    encoder = Encoder.from_pretrained(ckpt, dtype="fp32")
    image = image_bytes(natural_image(280, 196, seed=3))
    first = _prompt(ckpt, spec, encoder, ["Describe this:", ""], [image])
    second = _prompt(ckpt, spec, encoder, ["Describe this:", " and then say more about its colours, please."], [image])
    reusing, fresh = _engine(ckpt, spec), _engine(ckpt, spec, prefix_tokens=0)
    _greedy(reusing, first, 1)
    ours, reused = _greedy(reusing, second, 8)
    want, none = _greedy(fresh, second, 8)
    shared = next(i for i, (a, b) in enumerate(zip(first.token_ids, second.token_ids, strict=False)) if a != b)
    assert none == 0 and reused == shared // 16 * 16 > 0
    assert ours == want
    a, *_ = reusing.prefill(second)
    b, *_ = fresh.prefill(second)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_prefix_store_holds_what_its_events_say():
    """Block hashes are stored when their first holder arrives and removed when the last one goes
    (a shared prefix stays while any prompt holds it); the store never exceeds its token bound."""

    class Cache:  # what the store asks of a transformers cache: its length, crop and copy
        def __init__(self, n):
            self.n = n

        def get_seq_length(self):
            return self.n

        def crop(self, k):
            self.n += k

        layers = ()

    store = PrefixCache(block_size=16, max_tokens=64)
    assert store.add([1, 2], Cache(40)) == ([1, 2], [])
    assert store.add([1, 2, 3], Cache(48)) == ([3], [])  # [1, 2] is now a prefix of a held prompt: dropped
    assert store.match([1, 2, 9], 48).tokens == 32 and store.match([7], 48).tokens == 0
    assert store.match([1, 2, 3], 48).tokens == 32  # one token must be left to prefill
    stored, removed = store.add([5, 6], Cache(32))  # 80 tokens held: the least recently used prompt goes
    assert stored == [5, 6] and sorted(removed) == [1, 2, 3] and store.tokens == 32
    assert store.add([9] * 5, Cache(80)) == ([], [])  # larger than the whole store: not kept


def test_bf16_agrees_with_fp32_to_the_parity_gate(checkpoint, ckpt_encoder):
    """bf16 end to end (the encoder's rows and the language model) against fp32: embeddings at the
    encoder's parity gate and the first logits' direction (cosine) close."""
    image = image_bytes(natural_image(280, 196, seed=4))
    bf16 = Encoder.from_pretrained(checkpoint, dtype="bf16")
    a, b = ckpt_encoder.encode_file(image)[0].embeds.float(), bf16.encode_file(image)[0].embeds.float()
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).mean() >= 0.9994  # the parity gate (measured 0.99998)
    prompt32 = _prompt(checkpoint, "kimi-k2.5-vision", ckpt_encoder, ["What is it?", ""], [image])
    prompt16 = _prompt(checkpoint, "kimi-k2.5-vision", bf16, ["What is it?", ""], [image])
    spl = Splicer(ChatTokenizer(checkpoint), get_spec("kimi-k2.5-vision").prompt)
    e32 = Engine(LanguageModel.load(checkpoint), splicer=spl, prefix_tokens=0)
    e16 = Engine(LanguageModel.load(checkpoint, dtype=torch.bfloat16), splicer=spl, prefix_tokens=0)
    l32, *_ = e32.prefill(prompt32)
    l16, *_ = e16.prefill(prompt16)
    assert torch.nn.functional.cosine_similarity(l32.float(), l16.float(), dim=0) >= 0.999  # measured 0.99997


def test_families_without_an_engine_are_refused_with_what_serves_them(tmp_path, checkpoint):
    import json
    import shutil

    for model_type, words in (("kimi_vl", "serve it with vLLM"), ("llama", "has no engine here")):
        d = tmp_path / model_type
        shutil.copytree(checkpoint, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
        with pytest.raises(CheckpointError, match=words):
            LanguageModel.load(d)


def test_a_missing_language_model_shard_names_itself(tmp_path, checkpoint):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(checkpoint, d)
    (d / "model-00001-of-00008.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard model-00001-of-00008\.safetensors .* is missing"):
        LanguageModel.load(d)


def test_a_stopped_request_stops_after_its_token(checkpoint):
    """Dynamo's per-request context, reduced to what the engine reads of it (a stand-in: the real one
    is made by Dynamo's runtime for a live stream)."""

    class Stopped:
        def is_stopped(self):
            return True

    engine = _engine(checkpoint, "kimi-k2.5-vision")
    ids = ChatTokenizer(checkpoint).encode("hello there")

    async def run():
        return [s async for s in engine.decode(Prompt(ids, []), 10, SamplingParams(), [], Stopped())]

    assert len(asyncio.run(run())) == 1


@pytest.mark.parametrize("layout", ["save_pretrained", "in_memory"])
def test_the_language_model_loads_from_transformers_own_layouts(layout, tmp_path):
    """A checkpoint written by transformers' own Kimi-K2.5 class, either through `save_pretrained`
    (its spelling of the released layout: `language_model.model.blocks.*`, per-expert weights) or as
    its in-memory state dict (`model.language_model.*`, fused experts): the engine's language model
    gives the whole model's logits for the same token ids, and only language-model shards are read."""
    import json

    from safetensors.torch import save_file
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from mm_encoder.engines.model_dir import write_text_files
    from mm_encoder.engines.tiny_checkpoint import PRESETS, text_config

    ids = write_text_files(tmp_path)
    cfg = Kimi_K25Config(text_config=text_config(PRESETS["tiny"], ids), projection_hidden_size=64,
                         image_token_id=ids["<|media_pad|>"], tie_word_embeddings=False,
                         vision_config={"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                        "num_hidden_layers": 1})
    torch.manual_seed(3)
    model = Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if layout == "save_pretrained":
        model.save_pretrained(tmp_path, max_shard_size="1MB")
    else:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file({k: v for k, v in state.items() if "vision_tower" not in k}, str(tmp_path / "a.safetensors"))
        (tmp_path / "b.safetensors").write_bytes(b"not a safetensors file: the engine must not open it")
        weight_map = {k: "b.safetensors" if "vision_tower" in k else "a.safetensors" for k in state}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    lm = LanguageModel.load(tmp_path)
    tokens = ChatTokenizer(tmp_path).encode("The quick brown fox jumps over the lazy dog.")
    with torch.inference_mode():
        ours, _ = lm.forward(lm.embed(tokens))
        theirs = model(input_ids=torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("which", ["kimi", "glm"])
def test_the_aggregated_engine_answers_as_the_disaggregated_one(which, checkpoint, glm_checkpoint):
    """`--encode-inline` (the rendered prompt and a data: URL; Kimi-K2.5: transformers' own vision
    tower; GLM: this project's MoonViT in-process, transformers has none) gives the engine the same
    prompt tokens and the same answer as rows encoded apart and spliced by the frontend's path."""
    import base64

    from mm_encoder.core.engine_request import InlineRequest
    from mm_encoder.engines.process import EngineSettings, build_engine

    ckpt, spec = (checkpoint, "kimi-k2.5-vision") if which == "kimi" else (glm_checkpoint, "glm-5.2-vision")
    image = image_bytes(natural_image(196, 140, seed=5))
    prompt = _prompt(ckpt, spec, Encoder.from_pretrained(ckpt, dtype="fp32"), ["Describe:", ""], [image])
    want, _ = _greedy(_engine(ckpt, spec), prompt, 6)
    agg = build_engine(EngineSettings(_cli_parse_args=[], checkpoint=ckpt, encode_inline=True, device="cpu"))
    tok = ChatTokenizer(ckpt)
    text = tok.render([{"role": "user", "content": [{"type": "text", "text": "Describe:"},
                                                    {"type": "image_url", "image_url": {"url": "x"}}]}])
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    req = InlineRequest("r", [], 6, [], prompt=text, media_refs=[{"url": url, "modality": "image"}])

    async def run():
        return [item async for item in agg.generate(req.to_dict())]

    items = asyncio.run(run())
    assert items[0]["prompt_tokens"] == len(prompt.token_ids)
    assert [t for i in items for t in i["token_ids"]] == want
