"""`python -m mm_encoder.serve GRAPH`: as `mm-encoder serve`."""

import sys

from .cli import main

sys.exit(main())
