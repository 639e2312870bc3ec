"""`python -m mm_encoder.cache_tiers up|render ...`: as `mm-encoder cache`."""

import sys

from .cli import main

sys.exit(main())
