"""``python -m app``: serve the app on ``HOST``:``PORT`` with uvicorn.

The same as ``uvicorn --factory app.main:create_app --host $HOST --port $PORT``, except that
each response goes out in one write (``app.http_protocol``), and that a SIGTERM or SIGINT
that ends in a clean, graceful shutdown exits with status 0 (plain uvicorn re-raises the
signal after shutting down, so its exit status reads "killed by SIGTERM").
"""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap

import uvicorn

from app.errors import SettingsError
from app.http_protocol import server_options
from app.main import create_app
from app.settings import Settings, get_settings


def _settings_help() -> str:
    """Every setting with its default and meaning, from the one Settings class: its own
    first, then those of its parts (broker mode and the shared cache, the test hooks)."""
    lines = ["settings (environment variables, or a .env file in the working directory):"]
    fields = Settings.model_fields
    own = [name for name in fields if name in Settings.__annotations__]
    for name in own + [name for name in fields if name not in own]:
        field = fields[name]
        value = field.get_default(call_default_factory=True)
        default = "unset" if value is None else repr(value)
        lines.append(f"  {name.upper()} (default {default})")
        if field.description:
            lines += textwrap.wrap(
                field.description, width=88, initial_indent="      ", subsequent_indent="      "
            )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app",
        description="Serve the micro-batching model server (configured by the environment).",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    _parse(argv)  # --help, or refuse arguments this command does not take
    try:
        settings = get_settings()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # uvicorn restores and re-raises the handlers it found: make those a no-op so a graceful
    # shutdown is an ordinary exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_config=None,  # create_app configured logging, uvicorn's loggers included
            log_level=settings.log_level,
            **server_options(settings.mb_keep_alive),
        )
    )
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
