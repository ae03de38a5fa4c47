"""Turning a GenerateRequest's messages into chat parts and media items, within limits.

Runs before any work is spent on the request. Only headers are read: an image's format, size, frames
and orientation; a video's container, codec, size, frame count and rate; pixels and frames are never
decoded here. Every refusal is an INVALID_ARGUMENT naming the message and part at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.media import ImageHeader, MediaError, MediaLimits, MediaReason, decode_data_url, probe_image
from services.common.media_types import VideoHeader, VideoLimits
from services.common.rpc.epd.v1 import generation_pb2
from services.common.video import probe_video
from services.models.base import ChatMessage, ChatPart
from services.router.errors import invalid, too_large

ROLES = frozenset({"system", "user", "assistant"})


@dataclass(frozen=True)
class IntakeLimits:
    max_images_per_prompt: int
    max_item_bytes: int
    max_request_bytes: int
    media: MediaLimits
    max_videos_per_prompt: int = 1
    video: VideoLimits = field(default_factory=VideoLimits)
    accepts_video: bool = True  # the model's family takes video (`services.models.base.supports_video`)


@dataclass(frozen=True)
class MediaItem:
    """One image or video of the request, in prompt order: its bytes and what its header says."""

    index: int
    data: bytes
    header: ImageHeader | VideoHeader
    modality: str = "image"


@dataclass(frozen=True)
class Intake:
    messages: list[ChatMessage]
    items: list[MediaItem]


def _media_bytes(media: generation_pb2.Media, where: str, limits: IntakeLimits) -> bytes:
    source = media.WhichOneof("source")
    if source == "data":
        data = media.data
    elif source == "url" and media.url.startswith("data:"):
        try:
            data = decode_data_url(media.url, limits.max_item_bytes)
        except MediaError as exc:
            refuse = too_large if exc.reason == MediaReason.BYTES else invalid
            raise refuse(f"{where}: {exc}") from exc
    elif source == "url":
        raise invalid(
            f"{where}: media URL was not fetched (URL fetch is disabled on this router); "
            "send the bytes inline or as a data: URL"
        )
    else:
        raise invalid(f"{where}: media has neither data nor url")
    if not data:
        raise invalid(f"{where}: empty media data")
    if len(data) > limits.max_item_bytes:
        raise too_large(f"{where}: {len(data)} bytes, above the per-item limit of {limits.max_item_bytes}")
    return data


def parse_messages(messages: list[generation_pb2.Message], limits: IntakeLimits) -> Intake:
    """Validate roles, parts and media; raises RequestError (INVALID_ARGUMENT) on the first problem."""
    if not messages:
        raise invalid("request has no messages")
    chat: list[ChatMessage] = []
    items: list[MediaItem] = []
    total_bytes = 0
    counts = {"image": 0, "video": 0}
    for m_index, message in enumerate(messages):
        if message.role not in ROLES:
            raise invalid(f"messages[{m_index}]: unknown role {message.role!r}; use one of {sorted(ROLES)}")
        parts: list[ChatPart] = []
        for p_index, part in enumerate(message.content):
            where = f"messages[{m_index}].content[{p_index}]"
            kind = part.WhichOneof("part")
            if kind == "text":
                parts.append(ChatPart("text", part.text))
                continue
            if kind not in ("image", "video"):
                raise invalid(f"{where}: empty content part")
            if kind == "video" and not limits.accepts_video:
                raise invalid(f"{where}: video input is not supported by this model")
            cap = limits.max_images_per_prompt if kind == "image" else limits.max_videos_per_prompt
            if counts[kind] >= cap:
                raise invalid(f"{where}: more than {cap} {kind}s in one prompt")
            counts[kind] += 1
            data = _media_bytes(getattr(part, kind), where, limits)
            total_bytes += len(data)
            if total_bytes > limits.max_request_bytes:
                raise too_large(f"{where}: media total exceeds {limits.max_request_bytes} bytes per request")
            try:
                if kind == "image":
                    header = probe_image(data, limits.media, index=len(items))
                else:
                    header = probe_video(data, limits.video, index=len(items))
            except MediaError as exc:
                raise invalid(f"{where}: {exc}") from exc
            items.append(MediaItem(len(items), data, header, kind))
            parts.append(ChatPart(kind))
        if not parts:
            raise invalid(f"messages[{m_index}]: message has no content")
        chat.append(ChatMessage(message.role, parts))
    return Intake(chat, items)
