"""A tiny random GLM-4.1V for vLLM's GLM plugin (`engines.vllm_glm`): its checkpoint as transformers writes
it, image rows, and transformers' own greedy answer from those rows at the placeholders (the expected side).
Shared by tests/vllm/test_glm_plugin.py and bench/gpu_vllm.py."""

from __future__ import annotations

import torch

GLM4V = "Glm4vForConditionalGeneration"
VOCAB = 64
HIDDEN = 64
SPECIAL = ["<|endoftext|>", "<|image|>", "<|begin_of_image|>", "<|end_of_image|>", "<|video|>",
           "<|begin_of_video|>", "<|end_of_video|>"]
IMAGE, BOI, EOI = 1, 2, 3  # ids of <|image|>, <|begin_of_image|>, <|end_of_image|>
GRIDS = torch.tensor([[1, 4, 4], [1, 2, 6]])  # merge 2 -> 4 and 3 rows


def write_tiny_glm4v(path) -> None:
    """A tiny GLM-4.1V: transformers' `Glm4vConfig`, a tokenizers-library WordLevel tokenizer, the image
    processor config (deterministic, nothing downloaded). Head dim 32, mrope_section sums to rotary_dim/2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Glm4vConfig, PreTrainedTokenizerFast
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    vocab = {t: i for i, t in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(
        path
    )
    Glm4vImageProcessorPil(merge_size=2, patch_size=14, temporal_patch_size=2).save_pretrained(path)
    config = Glm4vConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
                     "eos_token_id": 0, "pad_token_id": 0,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                       "out_hidden_size": HIDDEN, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=IMAGE, video_token_id=4, image_start_token_id=BOI, image_end_token_id=EOI,
        video_start_token_id=5, video_end_token_id=6, tie_word_embeddings=False,
    )
    config.architectures = [GLM4V]
    # random weights wide enough that positions change the greedy answer (at 0.02 they do not)
    config.initializer_range = config.text_config.initializer_range = 0.1
    config.save_pretrained(path)


def embeddings(seed: int = 0, rows: int = 7, width: int = HIDDEN) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


PROMPT = [10, BOI, IMAGE, EOI, 11, BOI, IMAGE, EOI, 12]
EXPANDED = [10, BOI, *[IMAGE] * 4, EOI, 11, BOI, *[IMAGE] * 3, EOI, 12]
ENGINE_SEEDS = (5, 6)


def transformers_greedy(model, rows: torch.Tensor, steps: int = 8, mrope: bool = True) -> list[int]:
    """transformers' own GLM-4.1V, no cache: the placeholders' embeddings replaced by `rows`, positions from
    its own `get_rope_index` (or plain 1-D ones with `mrope=False`, the control)."""
    n = len(EXPANDED)
    image = torch.tensor(EXPANDED) == IMAGE
    ids = list(EXPANDED)
    with torch.inference_mode():
        for _ in range(steps):
            x = torch.tensor([ids])
            types_ = torch.zeros_like(x, dtype=torch.int32)
            types_[0, :n][image] = 1
            emb = model.get_input_embeddings()(x)
            emb[0, :n][image] = rows
            if mrope:
                pos, _ = model.model.get_rope_index(x, types_, image_grid_thw=GRIDS)
            else:
                pos = torch.arange(x.shape[1]).expand(3, 1, -1)
            logits = model(inputs_embeds=emb, position_ids=pos, attention_mask=torch.ones_like(x)).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[n:]
