"""`--storage-option KEY=VALUE`: the fsspec backend options of a URL, on the command line.

The same dictionary `storage_options=` takes in Python (s3fs's `endpoint_url`,
`key`, `anon`, ...). Values are read as JSON when they parse (`true`, `3`,
`{"region_name": "eu-west-1"}`), else kept as strings. Backends also read
their usual environment variables (`AWS_ENDPOINT_URL`, `AWS_PROFILE`, ...).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_storage_options", "storage_options"]


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value
    except RecursionError:  # argparse reports only ValueError / TypeError as usage errors
        raise argparse.ArgumentTypeError(
            f"the value of {key!r} nests too deeply to read as JSON ({len(value)} characters)"
        ) from None


def add_storage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-option",
        action="append",
        type=_option,
        default=[],
        metavar="KEY=VALUE",
        help="an option of the fsspec backend of a URL path (repeatable), "
        "e.g. endpoint_url=http://127.0.0.1:9000",
    )


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    return dict(args.storage_option) or None
