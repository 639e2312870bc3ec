"""LLM engines that take token ids plus spliced media embeddings (never pixels).

- `process`: the engine process (`python -m mm_encoder.engines --checkpoint DIR`): the
  checkpoint's own language model through transformers (`llm`), serving Dynamo's generate endpoint
  (`engine`), with prefix reuse (`prefix_cache`) and, for the aggregated baseline, the model's own
  vision tower (`inline`).
- `vllm`: the same request on vLLM's engine (`python -m mm_encoder.engines.vllm --model DIR`):
  `vllm_inputs` checks and builds the family's input (mixed prompt embeddings for Kimi, embeddings
  dicts for GLM and Qwen), `vllm_kv` relays vLLM's KV events with the router's media hashing,
  `vllm_glm` and `vllm_kimi` are the vLLM plugins; vLLM is imported lazily.

Both serve this project's request (`core.engine_request.EngineRequest`, msgpack over Dynamo RPC)
through one front door (`front_door`: parse, context check, bodies fetched and decoded once by
`inputs`, refusals, usage, pacing by `stream`) and answer `core.engine_reply` items;
`tiny_checkpoint` writes a small random Kimi-K2.5 checkpoint (`model_dir`: its tokenizer and chat
template, without torch).
"""
