"""LLM engines that take token ids plus spliced media embeddings (never pixels).

- `worker`: the engine process (`python -m mm_encoder.engines.worker --checkpoint DIR`): the
  checkpoint's own language model through transformers (`llm`), serving Dynamo's generate endpoint
  (`engine`), with prefix reuse (`prefix_cache`) and, for the aggregated baseline, the model's own
  vision tower (`inline`).
- `vllm`: builds vLLM inputs from the same request, for GPU deployments; vLLM is imported lazily.

The request both take (frontend -> engine, msgpack over Dynamo RPC): `core.requests.EngineRequest`;
`inputs` decodes and checks its media; `tiny_checkpoint` writes a small random Kimi-K2.5 checkpoint
(`model_dir`: its tokenizer and chat template, without torch).
"""
