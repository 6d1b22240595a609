"""The OpenAI-compatible server's command line: ``python -m engine.serving --model PATH [--port 8000] [engine options]``.

One ``--flag`` per :class:`EngineConfig` field; the routes themselves are in :mod:`engine.serving.server`.
``--api-key KEY`` (or ``$ENGINE_API_KEY``) makes clients send ``Authorization: Bearer KEY``; it is
required unless the server listens on loopback only (:mod:`engine.serving.auth`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from engine.async_engine import AsyncEngine
from engine.config import ConfigError, EngineConfig
from engine.serving.auth import MissingAPIKey, resolve_api_key
from engine.serving.server import MAX_BODY_BYTES, create_app

API_KEY_ENV = "ENGINE_API_KEY"


@dataclass
class ServerSettings:
    """Everything ``python -m engine.serving`` needs: the engine's config and where to listen."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    log_level: str = "info"
    api_key: str | None = None  # required by every route but /health (see engine.serving.auth)
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body gets a 413

    @property
    def model_name(self) -> str:
        """The name clients put in ``model``: given, or the model file's stem / directory name."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.engine.model)
        return path.stem if path.is_file() else path.name


def _engine_options(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per :class:`EngineConfig` field (booleans get ``--no-...``), EngineConfig's defaults."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine options (EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        elif typing.get_origin(kind) is typing.Literal:
            group.add_argument(flag, choices=args, default=argparse.SUPPRESS)
        elif typing.get_origin(kind) is tuple:
            group.add_argument(flag, type=lambda s: tuple(int(x) for x in s.split(",")), default=argparse.SUPPRESS, metavar="N,N,...")
        else:
            group.add_argument(flag, type=args[0] if args else kind, default=argparse.SUPPRESS)


def parse_settings(argv: Sequence[str] | None = None) -> ServerSettings:
    """:class:`ServerSettings` from the command line; ``--model`` is required (the engine knows no
    default model: the assistant's embedded one is ``python -m assistant.models path llm``)."""
    p = argparse.ArgumentParser(prog="python -m engine.serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="HF directory or .gguf file (the assistant's embedded LLM: $(python -m assistant.models path llm))")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the name clients send as `model` (default: the model's file stem)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--api-key", help=f"clients must send Authorization: Bearer KEY (default ${API_KEY_ENV}); "
                                     "required unless --host is 127.0.0.1, localhost or ::1")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="largest request body (default 1 MiB; larger: 413)")
    _engine_options(p)
    args = vars(p.parse_args(argv))
    if args["max_body_bytes"] < 1:
        p.error(f"--max-body-bytes must be >= 1, got {args['max_body_bytes']}")
    model = args.pop("model")
    server = {k: args.pop(k) for k in ("host", "port", "served_model_name", "log_level", "max_body_bytes")}
    try:
        api_key = resolve_api_key(server["host"], args.pop("api_key"), API_KEY_ENV)
    except MissingAPIKey as e:
        p.error(str(e))
    return ServerSettings(engine=EngineConfig(model=model, **args), api_key=api_key, **server)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until interrupted; 2 (and the reason on stderr) when the engine cannot start."""
    try:
        settings = parse_settings(argv)
        engine = AsyncEngine(settings.engine)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        app = create_app(engine, settings.model_name, max_body_bytes=settings.max_body_bytes, api_key=settings.api_key)
        print(f"serving {settings.model_name} on http://{settings.host}:{settings.port}/v1", file=sys.stderr, flush=True)
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0
