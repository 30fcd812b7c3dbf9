"""A `Layout` as plain JSON: what `Layout.to_json` writes and `Layout.from_json` reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import LayoutError
from .block import Block

if TYPE_CHECKING:
    from .layout import Layout

__all__ = ["JSON_FORMAT", "JSON_VERSION", "layout_args", "to_json_dict"]

JSON_FORMAT = "shardwise.layout"
JSON_VERSION = 1


def to_json_dict(layout: Layout) -> dict[str, Any]:
    return {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "global_shape": list(layout.global_shape),
        "world_size": layout.world_size,
        "allow_holes": layout.allow_holes,
        "blocks": [
            [[b.offsets, b.sizes] for b in rank_blocks]  # tuples dump as lists
            for rank_blocks in layout.blocks
        ],
    }


def layout_args(data: Any) -> tuple[Any, dict[int, list[Block]], Any, Any]:
    """`(global_shape, blocks, world_size, allow_holes)` of a layout document, for
    `Layout` to validate."""
    if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
        raise LayoutError(f"not a shardwise layout document (format must be {JSON_FORMAT!r})")
    if data.get("version") != JSON_VERSION:
        raise LayoutError(
            f"layout JSON version {data.get('version')!r} is not supported "
            f"(this shardwise reads version {JSON_VERSION})"
        )
    try:
        blocks = {
            rank: [Block(tuple(o), tuple(s)) for o, s in rank_blocks]
            for rank, rank_blocks in enumerate(data["blocks"])
        }
        return data["global_shape"], blocks, data["world_size"], data.get("allow_holes", False)
    except (KeyError, TypeError) as e:
        raise LayoutError(f"malformed layout JSON: {e!r}") from e
