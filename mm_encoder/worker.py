"""The encode worker's entry at the top of the package: `python -m mm_encoder.worker` (the graphs and
the images start it so) is `python -m mm_encoder.encode_worker`; `Worker` and `main` live in
`encode_worker/process.py` and are re-exported here for `from mm_encoder.worker import Worker`."""

from __future__ import annotations

import sys

from .encode_worker.process import Worker, main

__all__ = ["Worker", "main"]

if __name__ == "__main__":
    sys.exit(main())
