"""LLM engines that take token ids plus spliced media embeddings (never pixels).

- `reference`: a small CPU causal LM in torch that registers with Dynamo as a chat model,
  publishes KV events with media info, and lets the whole graph run without a GPU.
- `vllm`: builds vLLM inputs from the same request (prompt token ids + precomputed embeddings),
  for GPU deployments; vLLM itself is imported lazily.

The request both take (frontend -> engine, msgpack over Dynamo RPC): `core.requests.EngineRequest`;
`inputs` decodes and checks its media; `model_dir` writes the test LLM's directory (no torch).
"""
