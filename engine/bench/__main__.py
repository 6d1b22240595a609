"""``python -m engine.bench [SUITE ...] --model PATH``, or ``python -m engine.bench serve ...``."""

import sys

from engine.bench.cli import main

sys.exit(main())
