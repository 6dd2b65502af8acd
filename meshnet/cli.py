"""The `meshnet` command line.

    meshnet up        [--model M] [--nodes N] [--prefill-nodes N] [--port 8000] [--dtype D]
    meshnet tracker   [--host H] [--port P]
    meshnet node      --model M --layers A-B --tracker URL[,URL2...] [--host H] [--port P] [--relay URL] [--dtype D] [--device D]
    meshnet node      --model M --tracker URL [--max-memory SIZE]   (no --layers: the tracker places the node)
    meshnet relay     [--host H] [--port P]
    meshnet bootstrap [--host H] [--port P] [--registry addresses|cache-layouts]
    meshnet chat      [--url URL] "prompt"
    meshnet token     create --node-id ID [--model M] [--layers A-B] [--ttl 30d] | list | revoke ID

The flags of the service commands are generated from each service's settings
class, so every flag has its environment twin `MESHNET_<FLAG>` and the same
default, and `--help` shows both. A flag given on the command line wins over
the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

ENV_PREFIX = "MESHNET_"
SECRET_FIELDS = frozenset({"secret", "api_keys", "admin_key", "join_token", "node_key"})


@dataclass(frozen=True)
class ServiceCommand:
    """A subcommand that runs one service: where its settings and its `serve` live."""

    name: str
    summary: str
    settings_path: str  # "module:Class"
    serve_path: str  # "module:function"
    required: tuple[str, ...] = ()

    def load(self, path: str) -> Any:
        module, attr = path.split(":")
        return getattr(importlib.import_module(module), attr)


SERVICE_COMMANDS: tuple[ServiceCommand, ...] = (
    ServiceCommand(
        "tracker",
        "run the tracker: node registry, signed routes, the OpenAI API",
        "services.tracker.settings:TrackerSettings",
        "services.tracker.server:serve",
    ),
    ServiceCommand(
        "node",
        "run a node holding a contiguous range of a model's layers",
        "services.node.settings:NodeSettings",
        "services.node.server:serve",
    ),
    ServiceCommand(
        "relay",
        "run the WebSocket relay for nodes behind NAT",
        "services.relay.settings:RelaySettings",
        "services.relay.server:serve",
    ),
    ServiceCommand(
        "bootstrap",
        "run the prefill/decode (PD) bootstrap registry",
        "services.bootstrap.settings:BootstrapSettings",
        "services.bootstrap.server:serve",
    ),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(annotation: Any) -> Callable[[str], Any] | None:
    """The argparse converter for a field: int/float/str, or None for booleans and others."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar_type(args[0]) if len(args) == 1 else str
    if annotation is bool:
        return None
    if annotation in (int, float):
        return annotation
    return str


def _describe_default(name: str, info: FieldInfo) -> str:
    if name in SECRET_FIELDS:
        return "(hidden)"
    if info.default_factory is not None:
        return "(computed)"
    return repr(info.default) if info.default is not None else "none"


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings]) -> None:
    """One flag per settings field, with its env twin and default in the help."""
    for name, info in settings_cls.model_fields.items():
        env = ENV_PREFIX + name.upper()
        description = (info.description or "").rstrip(".")
        help_text = f"{description + '. ' if description else ''}env {env}, default {_describe_default(name, info)}"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %: a description's "0.5%" is text
        literal_choices = _literal_choices(info.annotation)
        if info.annotation is bool:
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
            continue
        parser.add_argument(
            _flag(name),
            dest=name,
            default=None,
            type=_scalar_type(info.annotation) or str,
            choices=literal_choices,
            metavar=name.upper() if not literal_choices else None,
            help=help_text,
        )


def _literal_choices(annotation: Any) -> list[Any] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return None


def settings_from_args(settings_cls: type[BaseSettings], args: argparse.Namespace) -> BaseSettings:
    """Settings from the environment, overridden by the flags the user actually gave."""
    given = {name: getattr(args, name) for name in settings_cls.model_fields if getattr(args, name, None) is not None}
    return settings_cls(**given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshnet",
        description="Serve one large language model across many ordinary machines, behind an OpenAI-compatible API.",
        epilog="Start here: `meshnet up`, then point the OpenAI SDK at the URL it prints.",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    up = sub.add_parser("up", help="a whole local mesh: tracker, relay, bootstrap and N nodes splitting a model",
                        description="Start a local mesh on this machine and print how to use it. Ctrl-C stops it.")
    from meshnet.up import UpSettings

    add_settings_flags(up, UpSettings)

    chat = sub.add_parser("chat", help="one streamed chat answer from a tracker",
                          description="Ask the mesh one question and stream the answer to the terminal.")
    from meshnet.chat import ChatSettings

    add_settings_flags(chat, ChatSettings)
    chat.add_argument("prompt", help="what to ask")

    from meshnet.tokens import add_token_parser

    add_token_parser(sub)

    for command in SERVICE_COMMANDS:
        p = sub.add_parser(command.name, help=command.summary, description=command.summary[0].upper() + command.summary[1:] + ".")
        add_settings_flags(p, command.load(command.settings_path))
    return parser


def configure_logging(level: str) -> None:
    """Readable log lines (JSON lines with MESHNET_LOG_FORMAT=json), shared with the services."""
    from meshwire.logs import configure_logging as configure

    configure(level)


def _invalid_settings(exc: Any) -> str:
    """A pydantic ``ValidationError`` as lines naming each setting by its variable and flag."""
    from meshwire.exposure import MAKE_A_SECRET

    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error.get("loc") else ""
        name = f"{ENV_PREFIX}{field.upper()} ({_flag(field)})" if field else "settings"
        line = f"invalid setting {name}: {error['msg']}"
        if field == "secret":
            line += f"; make one with `{MAKE_A_SECRET}`"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        raise SystemExit(2)
    configure_logging(args.log_level)
    try:
        if args.command == "up":
            from meshnet.up import UpSettings, run_up

            raise SystemExit(run_up(settings_from_args(UpSettings, args), log_level=args.log_level))
        if args.command == "chat":
            from meshnet.chat import ChatSettings, run_chat

            raise SystemExit(run_chat(settings_from_args(ChatSettings, args), args.prompt))
        if args.command == "token":
            from meshnet.tokens import run_token

            raise SystemExit(run_token(args))
        command = next(c for c in SERVICE_COMMANDS if c.name == args.command)
        settings = settings_from_args(command.load(command.settings_path), args)
        command.load(command.serve_path)(settings)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as exc:  # a clear one-line error for the user, the traceback under --log-level debug
        from pydantic import ValidationError

        from meshwire.exposure import UnsafeSecret

        if isinstance(exc, ValidationError):
            print(f"meshnet {args.command}: {_invalid_settings(exc)}", file=sys.stderr)
            raise SystemExit(2) from None
        if isinstance(exc, UnsafeSecret):
            print(f"meshnet {args.command}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        if isinstance(exc, OSError) and args.log_level != "debug":  # a taken port, an unknown host
            print(f"meshnet {args.command}: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        raise


if __name__ == "__main__":
    main()
