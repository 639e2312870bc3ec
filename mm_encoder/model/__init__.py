"""The vision model and everything before it: media decoding, preprocessing, mm_hash, the
MoonViT tower, the projectors, checkpoint loading, and the `Encoder` that runs them (torch)."""
