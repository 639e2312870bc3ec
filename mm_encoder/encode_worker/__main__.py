"""`python -m mm_encoder.encode_worker`: the encode worker process (`encode_worker.process`)."""

import sys

from .process import main

sys.exit(main())
