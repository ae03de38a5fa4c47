"""One client stream's state across the worker attempts that serve it: output, tokens so far, timing, Final.

A request that migrates (services/router/migration.py) keeps one `StreamState`: the choices' detokenizers
and stop strings, the token ids streamed (`progress`), the first-token timing of the first attempt and the
queue and encode time of all of them. Invariant: what the client received is exactly `progress`'s tokens,
in order, and the Final's usage counts them (`completion_tokens`) and the migrations. With tools offered,
each choice's text is kept and the Final carries the calls parsed from it (`finish_reason` "tool_calls" for a
choice that stopped after making calls).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.rpc.epd.v1 import common_pb2, generation_pb2, worker_pb2
from services.router.accounting import Accounted
from services.router.metrics import RouterMetrics
from services.router.migration import Progress
from services.router.output import Choices
from services.router.tool_calls import parse_tool_calls


@dataclass
class StreamState:
    choices: Choices
    progress: Progress
    start: float  # perf_counter at the request's arrival
    intake_s: float = 0.0
    queue_s: float = 0.0
    encode_s: float = 0.0
    first_token_s: float = 0.0
    prefill_s: float = 0.0
    embedding_wait_s: float = 0.0
    encode_stages: common_pb2.EncodeStages = field(default_factory=common_pb2.EncodeStages)
    cached: int = 0
    prompt_tokens: int = 0  # told on the first chunk (usage before the end)
    tools: bool = False  # the model was offered tools: each choice's text is kept and parsed for calls at the end
    texts: dict[int, list[str]] = field(default_factory=dict)
    _last: float = field(default=0.0, repr=False)
    _told_prompt: bool = field(default=False, repr=False)

    def take(
        self, response: worker_pb2.WorkerResponse, metrics: RouterMetrics
    ) -> generation_pb2.GenerateResponse | None:
        """A worker response in: record its timing, keep its tokens, return the response carrying the chunk to
        stream (if any)."""
        now = time.perf_counter()
        if not self.first_token_s:
            self.first_token_s, self.prefill_s, self._last = now - self.start, response.prefill_s, now
            self.embedding_wait_s = response.encode_wait_s
            metrics.ttft_seconds.record(self.first_token_s)
        elif response.index == 0:  # inter-token latency of choice 0 (the others arrive alongside)
            metrics.itl_seconds.record(now - self._last)
            self._last = now
        if response.index == 0:
            self.cached = response.cached_tokens
        out = self.choices.chunk(response)
        if out is not None:
            chunk = out.chunk
            self.progress.add(response.index, chunk.token_ids)
            if self.tools:
                self.texts.setdefault(response.index, []).append(chunk.text)
            if not self._told_prompt:
                chunk.prompt_tokens, self._told_prompt = self.prompt_tokens, True
        return out

    def final(self, accounted: Accounted, request_id: str, migrations: int) -> generation_pb2.Final:
        usage = generation_pb2.Usage(
            prompt_tokens=accounted.prompt_tokens,
            text_tokens=accounted.text_tokens,
            image_tokens=accounted.image_tokens,
            video_tokens=accounted.video_tokens,
            completion_tokens=sum(stream.completion_tokens for stream in self.choices.streams),
            cached_tokens=min(self.cached, accounted.prompt_tokens),
            migrations=migrations,
        )
        timing = generation_pb2.Timing(
            queue_s=self.queue_s,
            encode_s=self.encode_s,
            prefill_s=self.prefill_s,
            first_token_s=self.first_token_s,
            total_s=time.perf_counter() - self.start,
            intake_s=self.intake_s,
            embedding_wait_s=self.embedding_wait_s,
            encode_stages=self.encode_stages,
        )
        ends = self.choices.ends()
        if self.tools:
            for end in ends:
                calls = parse_tool_calls("".join(self.texts.get(end.index, [])))[1]
                end.tool_calls.extend(calls)
                if calls and end.finish_reason == "stop":
                    end.finish_reason = "tool_calls"
        return generation_pb2.Final(
            finish_reason=ends[0].finish_reason, usage=usage, timing=timing, request_id=request_id, choices=ends
        )
