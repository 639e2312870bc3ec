"""transformers as the reference for whole-graph tests: a Kimi-K2.5 checkpoint written by its own
`Kimi_K25ForConditionalGeneration.save_pretrained` with random weights, and the answer its
monolithic `generate` gives from pixels.

Nothing of this project's is in the reference's path but the tokenizer files: the pixels, frames,
chunks and timestamps are `released_processor`'s (Kimi-K2.5's released processor's rules, written in
the tests; transformers' image processors need torchvision, which does not install here, and its
video processor samples other frames than the released code), the chat template is rendered by
transformers' `apply_chat_template`, the tokenizer is transformers'.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import torch

from harness import released_processor as released
from harness.media_factory import image_bytes, natural_image, video_bytes


def randomize(model: torch.nn.Module, seed: int, std: float = 0.05, lm_std: float | None = None) -> None:
    """Every parameter random (transformers initialises biases to zero and its weights at std 0.02,
    which would hide a wrong bias and make attention near-uniform), norms around 1. `lm_std`: the
    language model's own scale (the tower keeps `std`)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            scale = lm_std if lm_std is not None and ("language_model" in name or "lm_head" in name) else std
            noise = torch.randn(p.shape, generator=gen) * scale
            p.copy_(noise + 1.0 if "norm" in name and name.endswith("weight") else noise)


def write_hf_checkpoint(path: Path, text: dict[str, Any], *, vocab_size: int = 1024, seed: int = 1,
                        lm_std: float | None = None, max_shard_size: str = "1MB") -> Path:
    """`Kimi_K25ForConditionalGeneration(config).save_pretrained(path)` with `text` as the DeepseekV3
    text config (transformers' format: what DeepseekV3Config does not know is not written), a
    64-wide MoonViT, every parameter random (`randomize`), plus the tokenizer and chat template."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from mm_encoder.engines.model_dir import write_text_files

    ids = write_text_files(path, vocab_size=vocab_size)
    text = {"model_type": "deepseek_v3", **text, "vocab_size": ids["vocab_size"], "bos_token_id": ids["[BOS]"],
            "eos_token_id": ids["[EOS]"], "pad_token_id": ids["[PAD]"]}
    cfg = Kimi_K25Config(
        text_config=text, projection_hidden_size=64, image_token_id=ids["<|media_pad|>"],
        video_token_id=ids["<|kimi_k25_video_placeholder|>"], tie_word_embeddings=False, pad_token_id=ids["[PAD]"],
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
                       "pos_emb_height": 64, "pos_emb_width": 64,
                       "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}})
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(cfg).eval()
    randomize(model, seed, lm_std=lm_std)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


class Reference:
    """transformers' whole model from `path` (fp32) and its tokenizer (template included)."""

    def __init__(self, path: Path):
        from transformers import AutoTokenizer, Kimi_K25ForConditionalGeneration

        self.model = Kimi_K25ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(path)

    def expected(self, content: list[dict], media: list[bytes], max_tokens: int) -> tuple[list[int], list[float], int]:
        """transformers' greedy tokens, their log-probabilities and the prompt length for `content`
        (images and videos, in order), from the released processor's pixels and prompt."""
        text = self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
        images, videos = [], []
        for data, part in zip(media, [p for p in content if p["type"] != "text"], strict=True):
            if part["type"] == "video_url":
                videos.append(released.video(data))
            else:
                images.append(released.image(data))
        ids = self.tok(released.expand(text, images, videos), add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens, output_logits=True,
                                      return_dict_in_generate=True, **released.model_inputs(images, videos))
        tokens = out.sequences[0, input_ids.shape[1]:].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens, strict=True)]
        return tokens, logprobs, input_ids.shape[1]

    def token_bytes(self, tokens: list[int]) -> list[bytes]:
        """Each token's bytes as the frontend's logprob records carry them (this project's reading of
        the tokenizer file: transformers has no byte-level view of a tiktoken vocabulary)."""
        from mm_encoder.core.prompt import ChatTokenizer

        ours = ChatTokenizer(self.tok.name_or_path)
        return [ours.token_bytes(t) for t in tokens]


def content(case: list[tuple]) -> tuple[list[dict], list[bytes]]:
    """OpenAI content parts and their media bytes for a case: ("text", str), ("image", (w, h)) or
    ("video", (frames, fps)): a 112x84 clip whose every frame differs (a square moving 7 px a frame
    across 96)."""
    parts, media = [], []
    for i, (kind, arg) in enumerate(case):
        if kind == "text":
            parts.append({"type": "text", "text": arg})
            continue
        if kind == "image":
            data, mime, part = image_bytes(natural_image(*arg, seed=i)), "image/png", "image_url"
        else:
            data, mime, part = video_bytes(width=112, height=84, frames=arg[0], fps=arg[1]), "video/mp4", "video_url"
        media.append(data)
        parts.append({"type": part, part: {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}})
    return parts, media
