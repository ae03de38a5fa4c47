"""A small client for the public API: build requests, stream answers (used by `epd generate`/`count`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from services.common.grpc_server import channel_options
from services.common.rpc.epd.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def user_request(
    prompt: str,
    images: Sequence[bytes] = (),
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    cache_salt: str = "",
    request_id: str = "",
) -> generation_pb2.GenerateRequest:
    """One user turn: the images first, then the text (the usual VLM layout)."""
    parts = [generation_pb2.ContentPart(image=generation_pb2.Media(data=data)) for data in images]
    parts.append(generation_pb2.ContentPart(text=prompt))
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=list(stop))
    if seed is not None:
        sampling.seed = seed
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        messages=[generation_pb2.Message(role="user", content=parts)],
        sampling=sampling,
        cache_salt=cache_salt,
    )


@dataclass
class Answer:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: generation_pb2.Final | None = None


class Client:
    """The public API over one channel: TLS when `credentials` (e.g. `grpc.ssl_channel_credentials(ca)`),
    and `authorization: Bearer <api_key>` on every call when `api_key` is set."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None, api_key: str = "") -> None:
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=channel_options())
        else:
            self._channel = grpc.secure_channel(address, credentials, options=channel_options())
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Connect now (channels connect on their first call otherwise); raises on timeout."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def stream(
        self,
        request: generation_pb2.GenerateRequest,
        timeout_s: float = 120.0,
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """The response stream; it is also the call, so `.cancel()` aborts the request."""
        return self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)

    def generate(self, request: generation_pb2.GenerateRequest, timeout_s: float = 120.0) -> Answer:
        answer = Answer()
        for response in self.stream(request, timeout_s):
            if response.HasField("chunk"):
                answer.token_ids.extend(response.chunk.token_ids)
                answer.text += response.chunk.text
            else:
                answer.final = response.final
        return answer

    def count(
        self,
        request: generation_pb2.GenerateRequest,
        timeout_s: float = 30.0,
    ) -> generation_pb2.TokenCount:
        return self._stub.CountTokens(request, timeout=timeout_s, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
