"""LLM engines that take token ids plus spliced media embeddings (never pixels).

- `worker`: the engine process (`python -m mm_encoder.engines --checkpoint DIR`): the
  checkpoint's own language model through transformers (`llm`), serving Dynamo's generate endpoint
  (`engine`), with prefix reuse (`prefix_cache`) and, for the aggregated baseline, the model's own
  vision tower (`inline`).
- `vllm`: the same request on vLLM's engine (`python -m mm_encoder.engines.vllm --model DIR`):
  `vllm_inputs` checks and builds the family's input (mixed prompt embeddings for Kimi, embeddings
  dicts for GLM and Qwen), `vllm_kv` relays vLLM's KV events with the router's media hashing,
  `vllm_glm` is the vLLM plugin that lets GLM-4.xV take embeddings; vLLM is imported lazily.

The request both take (frontend -> engine, msgpack over Dynamo RPC): `core.requests.EngineRequest`;
`inputs` decodes and checks its media; `tiny_checkpoint` writes a small random Kimi-K2.5 checkpoint
(`model_dir`: its tokenizer and chat template, without torch).
"""
