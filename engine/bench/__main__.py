"""``python -m engine.bench [SUITE ...] --model PATH``, or ``python -m engine.bench serve|native-prefill ...``."""

import sys

from engine.bench.cli import main

sys.exit(main())
