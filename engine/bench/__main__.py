"""``python -m engine.bench [SUITE ...] --model PATH``, or ``python -m engine.bench serve|native-prefill ...``."""

import sys

from engine.bench.cli import main
from engine.config import ConfigError

try:
    sys.exit(main())
except ConfigError as e:  # a setting this machine or model cannot run: the reason, not a traceback
    sys.exit(f"error: {e}")
