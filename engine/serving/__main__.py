"""``python -m engine.serving --model PATH [--port 8000] [engine options]``: the OpenAI-compatible server."""

import sys

from engine.serving.cli import main

sys.exit(main())
