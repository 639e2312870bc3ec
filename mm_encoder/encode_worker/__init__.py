"""The encode worker: one `EncodeService` pipeline (caches, single-flight, CPU pool, device
batcher, pack) behind two transports (aiohttp HTTP and a Dynamo endpoint). The process
(`process.py`: `Worker`, `main`) runs as `python -m mm_encoder.encode_worker`; `mm_encoder.worker`
is the same entry at the top of the package."""
