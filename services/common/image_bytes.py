"""Byte-level readers for image container headers: pure functions over untrusted bytes.

Each reads a bounded amount of structure (magic numbers, RIFF and PNG chunk lists, GIF block
lists) and never decompresses anything; malformed or short input gives None or a partial
count, never an exception. `services.common.media` turns their answers into decisions.
"""

from __future__ import annotations

_TIFF_MAGIC = (b"MM\x00\x2a", b"II\x2a\x00", b"MM\x00\x2b", b"II\x2b\x00")


def sniff_format(data: bytes) -> str | None:
    """The supported format named by the file's magic bytes, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data.startswith(b"BM"):
        return "BMP"
    return "TIFF" if data[:4] in _TIFF_MAGIC else None


def webp_size(head: bytes) -> tuple[int, int] | None:
    """Canvas size from a WebP's first 30 bytes (VP8, VP8L or VP8X chunk), or None."""
    kind = head[12:16]
    if kind == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF
    if kind == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X" and len(head) >= 30:
        return int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    return None


def gif_frame_count(data: bytes, stop_at: int) -> int:
    """Image descriptors in a GIF, walked like PIL's reader (unknown bytes skipped singly)."""
    pos, count, end = 13, 0, len(data)
    if end < pos:
        return 1
    if data[10] & 0x80:
        pos += 3 << ((data[10] & 7) + 1)
    while pos < end and count < stop_at:
        tag = data[pos]
        if tag == 0x3B:  # trailer
            break
        if tag == 0x21:  # extension: label, then data sub-blocks
            pos = _skip_sub_blocks(data, pos + 2)
        elif tag == 0x2C:  # image descriptor, optional local palette, LZW size, sub-blocks
            if pos + 10 > end:
                break
            count += 1
            flags = data[pos + 9]
            pos += 10 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
            pos = _skip_sub_blocks(data, pos + 1)
        else:
            pos += 1
    return max(count, 1)


def _skip_sub_blocks(data: bytes, pos: int) -> int:
    """Position after the GIF data sub-blocks starting at `pos` (each a length byte, 0 ends)."""
    end = len(data)
    while pos < end and data[pos]:
        pos += data[pos] + 1
    return pos + 1


def png_exif_chunk(data: bytes) -> bytes | None:
    """The body of a PNG's eXIf chunk wherever it sits (PIL only sees it before IDAT unless it
    decodes the pixels), found by walking chunk lengths; None when absent."""
    pos, end = 8, len(data)
    while pos + 8 <= end:
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8]
        if kind == b"eXIf":
            return data[pos + 8 : pos + 8 + length]
        if kind == b"IEND":
            return None
        pos += 12 + length
    return None
