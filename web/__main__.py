"""``python -m web``: the assistant's server with the web page on it, on 127.0.0.1 by default.

    python -m web [--documents-dir DIR] [--documents-root DIR ...] [--allow-document-changes]
                  [every option of python -m assistant serve, --api-key included]

It builds the same :class:`~assistant.server.AssistantServer` as ``python -m assistant serve``
(embedded models and handbook unless told otherwise; ``--port 0`` picks a free port), mounts the
page at ``/`` beside ``/v1/realtime``, ``/v1``, ``/health`` and ``/metrics``, and prints its URL.
Nothing is sent anywhere else: Gradio's analytics are off and the page loads no outside assets.
With an API key the page asks for it (any user name, the key as password); changing the documents
folder and uploading documents are offered only with ``--allow-document-changes``, and only
folders under a ``--documents-root`` (default: the bundled handbook), the app's own folder and the
folder the server started with can be chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from pathlib import Path

from platformdirs import user_data_path

DEFAULT_DOCUMENTS_DIR = user_data_path("handbook-assistant") / "web-documents"


def parser() -> argparse.ArgumentParser:
    """The web options; everything else goes to ``python -m assistant serve``'s parser."""
    p = argparse.ArgumentParser(prog="python -m web", description=__doc__, add_help=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("-h", "--help", action="store_true", help="show this help and the server's options")
    p.add_argument("--documents-dir", type=Path, default=DEFAULT_DOCUMENTS_DIR,
                   help=f"the folder uploaded documents go to; the app owns it (default {DEFAULT_DOCUMENTS_DIR})")  # fmt: skip
    p.add_argument("--documents-root", type=Path, action="append", metavar="DIR",
                   help="the page may switch to folders under DIR (repeatable; default: the bundled handbook; "
                        "the app's own folder and the --docs folder always)")  # fmt: skip
    p.add_argument("--allow-document-changes", action="store_true",
                   help="let page users switch the documents folder and upload documents (off by default)")
    return p


def main(argv: list[str] | None = None) -> int:
    for name, value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1")):
        os.environ.setdefault(name, value)
    web_options = parser()
    options, rest = web_options.parse_known_args(sys.argv[1:] if argv is None else argv)
    from assistant.config import HANDBOOK_DIR
    from assistant.serve_command import load_server, parse_config

    if options.help:
        web_options.print_help()
        print("\nand every option of python -m assistant serve:\n")
        parse_config(["serve", "--help"])  # exits
    config, log_level, warm_up = parse_config(["serve", *rest])
    # Every page's Realtime session is opened by this process, from its own address.
    config = dataclasses.replace(config, max_sessions_per_client=config.max_sessions)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import uvicorn

    try:
        sock = socket.create_server((config.host, config.port))
    except OSError as e:
        print(f"error: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    try:
        server = load_server(config, warm_up)
    except SystemExit:
        sock.close()
        raise
    from web.app import WebApp
    from web.documents import DocumentLibrary

    try:
        local = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        library = DocumentLibrary(server.answerer, options.documents_dir, options.documents_root or [HANDBOOK_DIR])
        WebApp(server, f"ws://{local}:{port}/v1/realtime", library, options.allow_document_changes).mount("/")
        print(f"serving {server.model_name}: ws://{config.host}:{port}/v1/realtime and http://{config.host}:{port}/v1",
              file=sys.stderr, flush=True)  # fmt: skip
        print(f"Web UI: http://{config.host}:{port}/", flush=True)
        uvicorn_config = uvicorn.Config(server.app, log_level=log_level, timeout_graceful_shutdown=5, access_log=False,
                                        **config.uvicorn_options())  # fmt: skip
        uvicorn.Server(uvicorn_config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down
        pass
    finally:
        server.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
