"""The ``espresso`` command: one entry point, one sub-command per task.

Sub-commands register themselves in :data:`COMMANDS`; each module that adds one keeps its
argument parsing next to its code.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from byteps_espresso import config

__all__ = ["COMMANDS", "main"]

# name -> (help, add_arguments(parser), run(args) -> exit code)
Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {}


def register(name: str, help_text: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    """Add a sub-command; a second registration of the same name is a bug."""
    if name in COMMANDS:
        raise ValueError(f"espresso sub-command {name!r} is registered twice")
    COMMANDS[name] = (help_text, add_arguments, run)


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true",
                        help="print the README's configuration table")


def _config_run(args: argparse.Namespace) -> int:
    if args.markdown:
        print(config.markdown_table())
        return 0
    cfg = config.Config.from_env()
    for var in config.VARIABLES:
        print(f"{var.name}={getattr(cfg, var.attr)!s}")
    return 0


register("config", "show the parsed environment, or the configuration table",
         _config_args, _config_run)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, []):
            return action.help
        return super()._get_help_string(action)


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``espresso ... | head``): stop without a traceback.

    stdout is pointed at /dev/null so that the interpreter's final flush does not fail too;
    the status is the shell's for a process ended by SIGPIPE (128 + 13).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def _load_plugins() -> None:
    """Import the modules that contribute sub-commands (absent ones are skipped)."""
    import importlib

    for module in ("byteps_espresso.kernels.cli", "byteps_espresso.strategy.cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def main(argv: Sequence[str] | None = None) -> int:
    _load_plugins()
    parser = argparse.ArgumentParser(prog="espresso", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text,
                                     formatter_class=_DefaultsFormatter))
    args = parser.parse_args(argv)
    try:
        code = COMMANDS[args.command][2](args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except config.ConfigError as exc:
        print(f"espresso {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: sub-commands register into
    # byteps_espresso.cli.COMMANDS, which is a different dict from this module's.
    from byteps_espresso.cli import main as _main

    sys.exit(_main())
