"""Byte-level readers for video container headers: pure functions over untrusted bytes.

What FFmpeg would allocate from a header alone is read here first: an MP4's sample tables claim a
sample count per track (`stsz`/`stz2`, and `trun` in fragments) that the demuxer turns into an index
of that many entries while opening the file, so a few kB claiming tens of millions of samples cost
gigabytes and seconds inside `avformat_open_input`. The box walk is bounded (`MAX_BOXES`) and never
reads sample data; malformed input gives None, never an exception. A box running past the end of the
data (a truncated file) is read as ending there: FFmpeg tolerates that too, and decoding finds what is
missing.
"""

from __future__ import annotations

import struct

MAX_BOXES = 20_000
"""Boxes an MP4 walk visits before it calls the file malformed (real files hold a few hundred)."""
_CONTAINERS = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl", b"moof", b"traf", b"edts", b"mvex"})
_MP4_FIRST = frozenset({b"ftyp", b"styp"})
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"


def sniff_container(data: bytes) -> str | None:
    """ "mp4" (ISO BMFF: MP4, MOV, 3GP), "matroska" (Matroska, WebM) or None, from the magic bytes."""
    if data[4:8] in _MP4_FIRST:
        return "mp4"
    if data.startswith(_EBML_MAGIC):
        return "matroska"
    return None


def mp4_track_samples(data: bytes) -> dict[int, int] | None:
    """Samples each track's tables claim (fragments included), by track number in file order; None when
    the box structure is malformed or holds more than `MAX_BOXES` boxes."""
    counts: dict[int, int] = {}
    state = {"boxes": 0, "tracks": 0, "fragment_track": 0}
    if not _walk(data, 0, len(data), counts, state):
        return None
    return counts


def _walk(data: bytes, start: int, end: int, counts: dict[int, int], state: dict[str, int]) -> bool:
    pos = start
    while pos + 8 <= end:
        state["boxes"] += 1
        if state["boxes"] > MAX_BOXES:
            return False
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            if pos + 16 > end:
                return False
            size, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif size == 0:
            size = end - pos
        if size < header:
            return False
        size = min(size, end - pos)
        body = pos + header
        if kind == b"trak":
            state["tracks"] += 1
        elif kind == b"tfhd" and body + 8 <= pos + size:
            state["fragment_track"] = struct.unpack_from(">I", data, body + 4)[0]
        if kind in _CONTAINERS:
            if not _walk(data, body, pos + size, counts, state):
                return False
        elif kind in (b"stsz", b"stz2") and body + 12 <= pos + size:
            track = state["tracks"]
            counts[track] = counts.get(track, 0) + struct.unpack_from(">I", data, body + 8)[0]
        elif kind == b"trun" and body + 8 <= pos + size:
            track = state["fragment_track"]
            counts[track] = counts.get(track, 0) + struct.unpack_from(">I", data, body + 4)[0]
        pos += size
    return True
