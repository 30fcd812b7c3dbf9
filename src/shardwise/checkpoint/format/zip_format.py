"""The zip structures of a `torch.save` archive, defined once for the record reader and writer.

torch.save writes a zip64 archive of stored (uncompressed) entries; these are
the header layouts and the end-of-archive trailer both sides must agree on.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ...errors import ShardwiseError

__all__ = [
    "CENTRAL_HEADER",
    "CENTRAL_SIGNATURE",
    "LOCAL_HEADER",
    "LOCAL_SIGNATURE",
    "STORED",
    "UTF8_NAMES",
    "VERSION",
    "VERSION_ZIP64",
    "ZIP64_EXTRA",
    "ZIP64_LIMIT",
    "LocalHeader",
    "RecordError",
    "end_of_archive",
    "local_header",
]


class RecordError(ShardwiseError, ValueError):
    """A `torch.save` record that is not a single plain tensor, or is damaged.
    Internal: its readers catch it (as a `ValueError`) and raise
    `CorruptCheckpointError` naming the tensor and the file, or fall back to
    loading the record whole."""


# signature, version, flags, method, time, date, crc, sizes, name/extra lengths
LOCAL_HEADER = struct.Struct("<4s5H3I2H")
LOCAL_SIGNATURE = b"PK\x03\x04"
# signature, versions made by/needed, flags, method, time, date, crc, sizes, name/extra/comment
# lengths, disk, attributes, local header offset
CENTRAL_HEADER = struct.Struct("<4s6H3I5H2I")
CENTRAL_SIGNATURE = b"PK\x01\x02"
_END64 = struct.Struct("<4sQ2H2I4Q")  # zip64 end of central directory record
_END64_SIGNATURE = b"PK\x06\x06"
_LOCATOR = struct.Struct("<4sIQI")  # where the zip64 record is
_LOCATOR_SIGNATURE = b"PK\x06\x07"
_END = struct.Struct("<4s4H2IH")  # the classic end of central directory record
_END_SIGNATURE = b"PK\x05\x06"

STORED = 0  # compression method: none
UTF8_NAMES = 0x0800  # general purpose flag: entry names are UTF-8
VERSION = 20  # version needed for a plain stored entry
VERSION_ZIP64 = 45  # ... and for one with zip64 fields
ZIP64_EXTRA = 1  # extra field id of the zip64 sizes/offsets
ZIP64_LIMIT = 0xFFFFFFFF  # a 32-bit field at this value defers to the zip64 extra field


class LocalHeader(NamedTuple):
    method: int
    name_length: int
    extra_length: int

    @property
    def data_offset(self) -> int:
        """Where the entry's data starts, from the start of its header."""
        return LOCAL_HEADER.size + self.name_length + self.extra_length


def local_header(buf: bytes, pos: int = 0) -> LocalHeader:
    """The local header at `pos` of `buf`; `RecordError` when there is none."""
    if len(buf) < pos + LOCAL_HEADER.size or buf[pos : pos + 4] != LOCAL_SIGNATURE:
        raise RecordError("bad zip local header in the record")
    fields = LOCAL_HEADER.unpack_from(buf, pos)
    return LocalHeader(fields[3], fields[9], fields[10])


def end_of_archive(entries: int, directory_size: int, directory_offset: int) -> bytes:
    """What follows the central directory: the zip64 record, its locator, and the classic
    record with its fields capped (readers then take the zip64 values)."""
    return (
        _END64.pack(
            _END64_SIGNATURE,
            44,  # the size of the rest of this record
            VERSION_ZIP64,
            VERSION_ZIP64,
            0,
            0,
            entries,
            entries,
            directory_size,
            directory_offset,
        )
        + _LOCATOR.pack(_LOCATOR_SIGNATURE, 0, directory_offset + directory_size, 1)
        + _END.pack(
            _END_SIGNATURE,
            0,
            0,
            min(entries, 0xFFFF),
            min(entries, 0xFFFF),
            min(directory_size, ZIP64_LIMIT),
            min(directory_offset, ZIP64_LIMIT),
            0,
        )
    )
