"""``python -m assistant serve``: run the assistant's server.

Its command line and the loading of the server live in :mod:`assistant.serve_command`, which
``python -m web`` shares.
"""

from __future__ import annotations

import logging
import os
import sys

from assistant.serve_command import apply_switch_interval, load_server, parse_config


def main(argv: list[str] | None = None) -> int:
    config, log_level, warm_up = parse_config(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # a CUDA graph captured while serving stalls the process's other GPU work: say when, and how long
    logging.getLogger("engine.cuda_graph").setLevel(logging.INFO)
    import uvicorn

    server = load_server(config, warm_up)
    apply_switch_interval(config)
    try:
        print(f"serving {server.model_name}: ws://{config.host}:{config.port}/v1/realtime and http://{config.host}:{config.port}/v1",
              file=sys.stderr, flush=True)  # fmt: skip
        uvicorn.run(server.app, host=config.host, port=config.port, log_level=log_level, timeout_graceful_shutdown=5,
                    **config.uvicorn_options())  # fmt: skip
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
