"""The fields of `shardwise.json`, each declared once: one table per record of the
file (the top level, a tensor, a chunk, an object, DCP's storage meta).

`field_table.encode` / `decode` run these tables; checks that relate several
fields (byte ranges inside files, geometry) stay in `manifest.py`, which runs
them on the decoded entries.
"""

from __future__ import annotations

from .fast_entries import (
    FAST_CHUNK,
    dump_chunk,
    dump_tensor,
    parse_chunk,
    parse_tensor,
    parse_tensors,
)
from .field_kinds import (
    CRC,
    CRCS,
    FILE,
    INDEX,
    NONNEG,
    POSITIVE,
    RANGE,
    RANGE_OR_NULL,
    STR_OR_NULL,
    TRANSFORM,
    is_base64,
    is_dtype_name,
    is_int,
    is_nonneg_list,
    is_range,
    is_str,
    list_of,
)
from .field_table import (
    Field,
    FieldError,
    Kind,
    const,
    decode,
    encode,
    leaf,
    record,
    record_list,
    record_map,
)
from .manifest_entries import (
    FORMAT,
    READS,
    VERSION,
    ChunkEntry,
    IndexRef,
    ObjectEntry,
    TensorEntry,
)
from .planner_data import encode_planner_data

__all__ = [
    "CHUNK",
    "FAST_CHUNK",
    "INDEX_REF",
    "FORMAT",
    "OBJECT",
    "READS",
    "RECORDS",
    "STORAGE_META",
    "TENSOR",
    "TOP",
    "VERSION",
    "ChunkEntry",
    "Field",
    "IndexRef",
    "FieldError",
    "Kind",
    "ObjectEntry",
    "TensorEntry",
    "decode",
    "encode",
]

STORAGE_META = (
    Field("checkpoint_id", STR_OR_NULL, "where it was saved", default=None),
    Field("save_id", STR_OR_NULL, "the id of the save", default=None),
    Field("modules", leaf("a list of strings", list_of(is_str)), "DCP's modules", default=[]),
)

CHUNK = (
    Field("offsets", INDEX, "where the stored block starts, in global coordinates"),
    Field("sizes", INDEX, "the stored block's sizes"),
    Field("file", FILE, "its data file"),
    Field("record", RANGE, "the chunk's `torch.save` record in the file: what stock DCP reads"),
    Field(
        "payload",
        RANGE_OR_NULL,
        "the raw element bytes in C order inside the record; `null` when transformed",
    ),
    Field(
        "pages",
        CRCS,
        "crc32c of each `page_size` slice of the payload (the last may be shorter); "
        "when transformed, one crc32c of the whole record",
        until=2,
        attr="crcs",
    ),
    Field(
        "tile",
        leaf(
            "a list of non-negative integers or null",
            lambda v: v is None or is_nonneg_list(v),
            lambda v: None if v is None else tuple(v),
        ),
        "the tile shape: the payload's checksum grid (see Tiles); `null` when transformed",
        since=3,
    ),
    Field(
        "tiles",
        CRCS,
        "crc32c of each tile of the payload, in the tile grid's C order; when transformed, "
        "one crc32c of the whole record",
        since=3,
        attr="crcs",
    ),
    Field("frame", CRC, "crc32c of the record's bytes before the payload, then after it"),
    Field(
        "transform",
        TRANSFORM,
        "DCP stream-transform descriptors (e.g. `stream.zstd/1`): the record is read whole",
        default=None,
        since=2,
    ),
)


TENSOR = (
    Field("dtype", leaf("a torch dtype name", is_dtype_name), "`float32`, `bfloat16`, ..."),
    Field("shape", INDEX, "the global shape (`[]` for a 0-d tensor)"),
    Field(
        "requires_grad",
        leaf("true or false", lambda v: type(v) is bool),
        "DCP's `TensorProperties.requires_grad`",
        default=False,
        since=2,
    ),
    Field(
        "chunks",
        record_list("a list of chunks", CHUNK, ChunkEntry, (parse_chunk, dump_chunk)),
        "the stored blocks",
        until=3,
    ),
    Field(
        "section",
        leaf(
            "[block, offset, length, rows, crc32c]: non-negative integers",
            lambda v: is_nonneg_list(v) and len(v) == 5 and v[4] < 1 << 32,
            tuple,
        ),
        "where its chunks are in the index: the block (`index.blocks`), the offset in it, "
        "the length, the number of chunk rows and the section's crc32c (see Index)",
        since=4,
    ),
    Field(
        "transforms",
        leaf("a list of transforms", list_of(TRANSFORM.ok)),  # type: ignore[arg-type]
        "the transforms its chunk rows name by position",
        default=[],
        since=4,
    ),
)

INDEX_REF = (
    Field("file", FILE, "the index file: a data file of the save"),
    Field(
        "blocks",
        leaf("a list of non-negative integers", is_nonneg_list),
        "where each block of sections starts in the file (one per writer of sections)",
    ),
)

OBJECT = (
    Field("file", FILE, "its data file"),
    Field("offset", NONNEG, "where its pickle starts in the file"),
    Field("length", NONNEG, "its length in bytes"),
    Field("crc32c", CRC, "crc32c of those bytes"),
    Field("transform", TRANSFORM, "as for chunks", default=None, since=2),
)

TOP = (
    Field("format", const(FORMAT), "what this file is", fixed=FORMAT, stored=False),
    Field(
        "version",
        leaf(f"one of {', '.join(map(str, READS))}", lambda v: is_int(v) and v in READS),
        "the format version (see Versioning)",
    ),
    Field("world_size", POSITIVE, "ranks that saved"),
    Field(
        "checksum", const("crc32c"), "the checksum used throughout", fixed="crc32c", stored=False
    ),
    Field("page_size", POSITIVE, "bytes of payload per checksum page", until=2),
    Field("metadata_crc32c", CRC, "crc32c of DCP's `.metadata` (checked by `verify`)"),
    Field(
        "metadata_tail",
        leaf("[size, crc32c]", lambda v: is_range(v) and v[1] < 1 << 32, tuple),
        "`.metadata`'s size and the crc32c of its last 4 KiB, where its save id is: what a "
        "load checks (`metadata_crc32c` would make every rank read all of it)",
        since=4,
    ),
    Field(
        "index",
        record(INDEX_REF, IndexRef),
        "the index file holding the tensors' chunk sections",
        since=4,
    ),
    Field("dcp_version", STR_OR_NULL, "DCP's `Metadata.version`", since=2),
    Field("storage_meta", record(STORAGE_META, dict), "DCP's `StorageMeta`", since=2),
    Field(
        "planner_data",
        Kind(
            "any JSON value",
            lambda value, _version, _path: value,  # tags read as tuples (`untag`)
            lambda value, _version: encode_planner_data(value),
        ),
        'DCP\'s `Metadata.planner_data`, tuples tagged `{"__tuple__": [...]}`; `null` when '
        "it is not plain JSON",
        since=2,
    ),
    Field(
        "planner_data_pickle",
        leaf("base64 text", is_base64),
        "planner data that is not plain JSON, pickled, read with the unpickler of stock "
        "`.metadata` (kept here: the manifest never depends on `.metadata`)",
        default=None,
        since=2,
    ),
    Field(
        "tensors",
        record_map(
            "an object: key to tensor",
            TENSOR,
            TensorEntry,
            (parse_tensor, dump_tensor),
            parse_tensors,
        ),
        "the tensors, by DCP's flattened key (`model.emb.weight`)",
    ),
    Field(
        "objects",
        record_map("an object: key to object", OBJECT, ObjectEntry),
        "the stored Python objects (pickled), by key",
    ),
    Field(
        "crc32c",
        CRC,
        "crc32c of this document written compact (no spaces), with this field 0",
        fixed=0,
        stored=False,
    ),
)

# every record type, as docs/format.md titles its table
RECORDS = {
    "top level": TOP,
    "storage_meta": STORAGE_META,
    "tensor": TENSOR,
    "chunk": CHUNK,
    "object": OBJECT,
    "index": INDEX_REF,
}
