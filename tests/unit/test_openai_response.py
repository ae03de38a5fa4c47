"""Streamed OpenAI chunks from gRPC responses: a token whose text is held back still gets its chunk, as vLLM
streams (an unfinished character or a possible stop string: no content yet), so a client times every token."""

from __future__ import annotations

from services.common.rpc.epd.v1 import generation_pb2
from services.router.openai_response import ChunkWriter, Envelope, TextChunkWriter

ENVELOPE = Envelope("cmpl-1", 0, "m")


def _token(token_id: int, text: str) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(token_ids=[token_id], text=text))


def test_a_held_back_token_streams_an_empty_chat_delta_and_its_text_comes_with_the_next() -> None:
    writer = ChunkWriter(ENVELOPE)
    held, done = writer.add(_token(7, "")), writer.add(_token(8, "é"))
    assert [c["choices"][0]["delta"] for c in held + done] == [{"content": ""}, {"content": "é"}]
    assert writer.add(generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk())) == []  # no token, no chunk


def test_a_held_back_token_streams_an_empty_completion_text() -> None:
    writer = TextChunkWriter(ENVELOPE)
    assert [c["choices"][0]["text"] for c in writer.add(_token(7, "")) + writer.add(_token(8, "é"))] == ["", "é"]


def test_with_tools_a_held_back_token_streams_nothing() -> None:
    """The tool-call reader may be holding text that turns out to be a call: nothing goes out until it knows."""
    writer = ChunkWriter(ENVELOPE, tools=True)
    assert writer.add(_token(7, "")) == []
