"""The vision model and everything before it: media decoding, preprocessing, mm_hash, the
MoonViT tower, the projectors, checkpoint loading (loading.py), the steps that run them
(steps.py: `EncodeSteps`, what the encode worker drives) and `Encoder`, the library over both (torch)."""
