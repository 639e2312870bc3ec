"""`python -m mm_encoder.engines`: the engine process (`engines.process`)."""

import sys

from .process import main

sys.exit(main())
