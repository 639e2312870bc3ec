"""The encode worker: one `EncodeService` pipeline (caches, single-flight, CPU pool, device
batcher, pack) behind two transports (aiohttp HTTP and a Dynamo endpoint). Its entry point is
`mm_encoder.worker`."""
