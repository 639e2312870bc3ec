"""The directory a test LLM is served from, written without torch or downloads.

`make_model_dir` writes what Dynamo, the frontend and the reference engine read: `config.json`
(its hidden size is the projector output of the vision model it serves, so spliced embeddings
go straight into `inputs_embeds`), a byte-level BPE `tokenizer.json` trained on a fixed corpus,
`tokenizer_config.json` with a chat template, and `generation_config.json`. The same call, with
the same arguments, writes the same directory everywhere (`mm-encoder serve`, the Kubernetes init
container), so a frontend and its engines always agree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..core.registry import DEFAULT_MODEL, get_spec

# Content is a string (this project's frontend renders media as its own sentinels) or a list of
# OpenAI parts (Dynamo's stock frontend, which passes images as {"type": "image"}): each media part
# becomes the model's own prompt for it with one placeholder, which the engine expands.
CHAT_TEMPLATE = (
    "{%- macro content(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is not none -%}{%- for p in c -%}"
    "{%- if p['type'] == 'text' -%}{{ p['text'] }}"
    "{%- elif p['type'] in ('image', 'image_url') -%}@IMAGE@"
    "{%- elif p['type'] in ('video', 'video_url') -%}@VIDEO@"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ content(m['content']) }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ content(m['content']) }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{{ content(m['content']) }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
CHAT_TOKENS = ["[BOS]", "[EOS]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]
_CORPUS = """The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
Describe the image in detail. What is in this picture? Compare the two images and the video.
Large language models read tokens; a vision encoder turns pixels into embeddings first.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ' " ( ) [ ] { } - _ / = + * % # @ & |
"""


def chat_template(prompt) -> str:
    """The template for one model's prompts (`spec.prompt`): a video part gets its chunk prompt
    without a timestamp, since chunks are known only once the video is encoded."""
    return CHAT_TEMPLATE.replace("@IMAGE@", prompt.image).replace("@VIDEO@", prompt.video.format(timestamp=""))


def make_model_dir(path: str | Path, model: str = DEFAULT_MODEL, *, name: str | None = None, context_length: int = 4096,
                   num_layers: int = 2, num_heads: int = 4, vocab_size: int = 1024, seed: int = 0) -> Path:
    """Write a servable model directory for the vision model `model` (its width and prompt)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = get_spec(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    media_tokens = sorted(set(re.findall(r"<\|[^|]+\|>", spec.prompt.image + spec.prompt.video)))
    specials = CHAT_TOKENS + [t for t in media_tokens if t not in CHAT_TOKENS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in specials}
    config = {
        "model_type": "mm_encoder_reference_lm",
        "architectures": ["ReferenceLM"],
        "mm_encoder_model": spec.name,
        "served_model_name": name or path.name,
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": spec.projector.out_dim,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "intermediate_size": 4 * spec.projector.out_dim,
        "max_position_embeddings": context_length,
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["[EOS]"],
        "media_placeholder_token_id": ids[spec.prompt.placeholder],
        "seed": seed,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["[EOS]"]}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": chat_template(spec.prompt),
        "model_max_length": context_length, "tokenizer_class": "PreTrainedTokenizerFast",
        # every AddedToken field: Dynamo's Rust tokenizer loader refuses entries with fewer
        "added_tokens_decoder": {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                               "single_word": False, "special": True} for t in specials},
    }, indent=2))
    return path
