"""The `shardwise` command: `main(argv) -> int`, one module per subcommand.

Exit status: 0 on success; 1 when the command fails (any exception it raises:
a missing path, a bad or corrupt checkpoint), with a one-line reason on
stderr; 2 on a usage error (unknown subcommand, missing or invalid
arguments), with the usage and a one-line reason on stderr, as argparse does.
"""

from __future__ import annotations

import argparse
import functools
import logging
import pickle
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .. import __version__
from ..errors import ShardwiseError
from ..testing import RanksFailed
from . import bench, convert, demo, inspect, reshard, verify
from .verify import one_line

__all__ = ["main", "run"]

_SUBCOMMANDS = {
    "demo": demo,
    "inspect": inspect,
    "verify": verify,
    "convert": convert,
    "reshard": reshard,
    "bench": bench,
}

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

_EPILOG = f"""\
exit status:
  {EXIT_OK}  success
  {EXIT_FAILURE}  the command failed (missing path, bad or corrupt checkpoint, ...);
     one line on stderr says why
  {EXIT_USAGE}  usage error (unknown command, missing or invalid arguments)

example: shardwise inspect ckpt/step_100"""

# What bad input to a command raises; anything else is likelier a bug, so its
# one-line reason also names the exception type.
_EXPECTED = (ShardwiseError, OSError, ValueError, KeyError, pickle.UnpicklingError)


class _UsageError(Exception):
    """argparse rejected the command line; the message is argparse's one line."""


class _Parser(argparse.ArgumentParser):
    # argparse exits the process on a usage error; main() returns its code instead.
    # Subparsers are built with the parent's class, so they raise this too.
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise _UsageError(f"{self.prog}: error: {message}")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        convert = kwargs.get("type")
        if callable(convert):
            kwargs["type"] = _usage_errors_from(convert)
        return super().add_argument(*args, **kwargs)


def _usage_errors_from(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """`convert` (a `type=` function), raising only what argparse reports as a usage
    error: it lets anything but `ArgumentTypeError`, `TypeError` and `ValueError`
    escape as a traceback (an `OverflowError`, a `RecursionError`), and words a
    `ValueError` as "invalid <type> value", dropping a ShardwiseError's reason."""

    @functools.wraps(convert)  # argparse names the type in its message
    def checked(text: str) -> Any:
        try:
            return convert(text)
        except ShardwiseError as e:  # ours say what is wrong and the fix: shown as they are
            raise argparse.ArgumentTypeError(one_line(str(e))) from e
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            raise
        except Exception as e:
            raise argparse.ArgumentTypeError(f"invalid value {text[:80]!r}: {_reason(e)}") from e

    return checked


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardwise",
        description="Sharded tensors and resharding checkpoints on PyTorch.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _SUBCOMMANDS.values():
        module.add_parser(sub)
    return parser


def _reason(e: BaseException) -> str:
    """The exception as one line: its message's first line, with its type where unexpected."""
    if isinstance(e, RanksFailed) and e.errors:
        return _per_rank(e.errors)
    # KeyError's str() is the repr of its key; its message is the plain text.
    text = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 else str(e)
    lines = str(text).strip().splitlines()
    if isinstance(e, ShardwiseError):  # ours are one line, unless a crafted key held a newline
        lines = [one_line(str(text).strip())]
    message = one_line(lines[0]) if lines and lines[0] else type(e).__name__
    return message if isinstance(e, _EXPECTED) else f"{type(e).__name__}: {message}"


def _per_rank(errors: dict[int, BaseException]) -> str:
    """Ranks' errors as one line, each distinct one once with the ranks that raised it
    (a collective failure raises the same error on every rank)."""
    by_reason: dict[str, list[int]] = {}
    for rank, error in sorted(errors.items()):
        by_reason.setdefault(_reason(error), []).append(rank)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {reason}"
        for reason, ranks in by_reason.items()
    )


def _flag_names(parser: argparse.ArgumentParser, command: str) -> Callable[[str], str]:
    """A message's Python argument names (`overwrite=True`, `max_file_size`) as the
    flags of `command` that set them (`--overwrite`, `--max-file-size`): the library
    words its errors for Python callers, the command line names its own flags."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    words: list[tuple[re.Pattern[str], str]] = []
    for action in sub.choices[command]._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or action.dest == "help":
            continue
        # not inside a repr's argument list: `Layout(..., world_size=2)` stays as it is
        name = rf"(?<!\()(?<!, )\b{re.escape(action.dest)}"
        if isinstance(action, argparse._StoreTrueAction):
            words.append((re.compile(rf"{name}=True\b"), flag))
        words.append((re.compile(rf"{name}=(?=\S)"), f"{flag} "))
        if "_" in action.dest:  # an identifier, never an English word
            words.append((re.compile(rf"{name}\b"), flag))

    def named(text: str) -> str:
        for pattern, flag in words:
            text = pattern.sub(flag, text)
        return text

    return named


class _Warnings(logging.Handler):
    """The `shardwise` logger's warnings during a command, one line each on stderr,
    worded as the command's errors are."""

    def __init__(self, command: str, named: Callable[[str], str]) -> None:
        super().__init__(logging.WARNING)
        self.command, self.named = command, named

    def emit(self, record: logging.LogRecord) -> None:
        text = one_line(self.named(record.getMessage()))
        print(f"shardwise {self.command}: warning: {text}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand (`argv` defaults to `sys.argv[1:]`); return its exit status.

    0: success. 1: the command raised; one line on stderr says why. 2: usage
    error; argparse's usage and one line on stderr. `--help` prints and raises
    `SystemExit(0)`, as argparse does.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # whatever else parsing raised is still bad input, not a crash
        parser.print_usage(sys.stderr)
        print(f"shardwise: error: {_reason(e)}", file=sys.stderr)
        return EXIT_USAGE
    named = _flag_names(parser, args.command)
    warnings = _Warnings(args.command, named)
    logger = logging.getLogger("shardwise")
    logger.addHandler(warnings)
    try:
        return int(args.func(args) or EXIT_OK)
    except SystemExit as e:  # a benchmark script run in-process may call sys.exit
        if e.code is None or isinstance(e.code, int):
            return e.code or EXIT_OK
        print(f"shardwise {args.command}: error: {e.code}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as e:
        print(f"shardwise {args.command}: error: {named(_reason(e))}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        logger.removeHandler(warnings)


def run() -> None:
    """The console entry point: `sys.exit(main())`."""
    sys.exit(main())
