"""`python -m mm_encoder.capacity` is `mm-encoder capacity`."""

import sys

from .cli import main

sys.exit(main())
