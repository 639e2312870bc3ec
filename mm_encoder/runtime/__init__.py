"""How every mm-encoder process runs: Dynamo's runtime behind one seam (`dynamo.py`: the runtime,
endpoints, the KV router, the HTTP frontend, our errors as its exceptions, the options every Dynamo
process takes), the process lifecycle (`process.py`: settings, logging, signals, the ready line,
shutdown) and asyncio helpers (`aio.py`). Imports `core` only."""
