"""`switchboard serve`: run the gateway."""

from __future__ import annotations

import argparse
import os

from gateway.cli.common import load_settings

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add `serve`."""
    serve = sub.add_parser("serve", help="run the gateway (fetches the tiers' models on first start)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    settings = load_settings()
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        settings = settings.model_copy(update=overrides)
    # OpenMP reads this once, when torch starts: set it before the first torch import.
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.max_threads))
    from gateway.http.logging_setup import configure

    configure(settings.log_level, settings.log_format)
    import uvicorn

    from gateway.app import create_app
    from gateway.runtime.tiers import ensure_models

    ensure_models(settings)  # before the server starts, so progress bars show on a plain terminal
    # log_config=None: uvicorn keeps our root handler (its own config would print plain text)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None
    )
    return 0
