"""The encode worker's engine: one `EncodeService` pipeline (caches, single-flight, CPU pool,
device batcher, pack) behind two transports (aiohttp HTTP and a Dynamo endpoint)."""
