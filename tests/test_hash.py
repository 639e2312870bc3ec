"""mm_hash identifies what the model sees: content + model identity, not the source."""

from __future__ import annotations

import blake3

from harness.media_factory import image_bytes, natural_image, video_bytes
from mm_encoder import Encoder, PreprocessConfig


def test_same_bytes_same_hash_other_bytes_other_hash(tiny):
    a = image_bytes(natural_image(120, 90, seed=1))
    b = image_bytes(natural_image(120, 90, seed=2))
    ra, ra2, rb = tiny.encode([a, a, b])
    assert ra.mm_hash == ra2.mm_hash != rb.mm_hash
    # the documented construction: blake3(len(identity) as 4 LE bytes, identity, modality NUL, bytes), hex
    assert ra.mm_hash == _blake3(tiny.identity(), "image", a).hexdigest() == tiny.identify(a)[1]


def test_hash_depends_on_model_and_processor_settings(tiny):
    data = image_bytes(natural_image(120, 90, seed=1))
    other_model = Encoder.from_pretrained("tiny", seed=9)
    small = PreprocessConfig(in_patch_limit=16)
    h = tiny.encode([data])[0]
    assert other_model.encode([data])[0].mm_hash != h.mm_hash
    r = tiny.encode([data], processor=small)[0]
    assert r.mm_hash != h.mm_hash and r.num_tokens < h.num_tokens


def _blake3(identity: bytes, modality: str, data: bytes) -> blake3.blake3:
    return blake3.blake3(len(identity).to_bytes(4, "little") + identity + modality.encode() + b"\0" + data)


def test_video_chunks_hash_from_the_videos_mm_hash(tiny):
    data = video_bytes(64, 48, frames=20, fps=5)
    first = tiny.encode_file(data)
    again = tiny.encode_file(data)
    assert [r.mm_hash for r in first] == [r.mm_hash for r in again]
    assert all(r.modality == "video" and r.grid_thw[0] == 4 for r in first)
    identity = tiny.identity()
    video = _blake3(identity, "video", data).hexdigest()
    assert tiny.identify(data) == ("video", video)  # what the worker caches the whole video's body under
    chunks = [_blake3(identity, "video", video.encode() + b"\0chunk" + i.to_bytes(4, "little")).hexdigest()
              for i in range(2)]
    assert [r.mm_hash for r in first] == chunks
