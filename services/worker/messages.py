"""Between the worker's protos and the engine: a WorkerRequest as an EngineRequest, step outputs as responses."""

from __future__ import annotations

from services.common.grammar import constraint_of
from services.common.media_refs import media_span
from services.common.rpc.epd.v1 import common_pb2, worker_pb2
from services.worker.engine.request import EngineRequest, KVTransfer, SamplingOptions, StepOutput, TokenLogprobs


def engine_request(request: worker_pb2.WorkerRequest) -> EngineRequest:
    """The engine's request for a router's: unset top_p and repetition_penalty are 1, n at least 1, seed and
    logprobs None when unset; ``bad_words`` are the router's token-id sequences (``bad_words_token_ids``); the
    constraint as the router resolved it (``any_whitespace`` set)."""
    sampling = request.sampling
    return EngineRequest(
        request_id=request.request_id,
        token_ids=list(request.token_ids),
        media=[media_span(m) for m in request.media],
        sampling=SamplingOptions(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p or 1.0,
            top_k=sampling.top_k,
            seed=sampling.seed if sampling.HasField("seed") else None,
            ignore_eos=sampling.ignore_eos,
            n=max(sampling.n, 1),
            logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
            repetition_penalty=sampling.repetition_penalty or 1.0,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            min_p=sampling.min_p,
            min_tokens=sampling.min_tokens,
            stop_token_ids=tuple(sampling.stop_token_ids),
            bad_words=tuple(tuple(word.ids) for word in sampling.bad_words_token_ids),
            logit_bias=tuple(sorted(sampling.logit_bias.items())),
            structured=constraint_of(sampling),
        ),
        cache_salt=request.cache_salt,
        generated_tokens=request.generated_tokens,
        kv_transfer=kv_transfer(request),
    )


def kv_transfer(request: worker_pb2.WorkerRequest) -> KVTransfer | None:
    """The request's part in prefill/decode disaggregation, None when it prefills and decodes here."""
    spec = request.kv_transfer
    if not request.HasField("kv_transfer") or not spec.direction:
        return None
    return KVTransfer(spec.direction, spec.skip_blocks)


def token_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs]) -> list[common_pb2.TokenLogprob]:
    """The engine's logprobs of ``token_ids`` as protos (token text is left to the router)."""
    return [
        common_pb2.TokenLogprob(token_id=token, logprob=lp.logprob, top=_top_logprobs(lp))
        for token, lp in zip(token_ids, logprobs, strict=True)
    ]


def _top_logprobs(lp: TokenLogprobs) -> list[common_pb2.TopLogprob]:
    return [common_pb2.TopLogprob(token_id=i, logprob=v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]


def by_choice(outs: list[StepOutput]) -> list[list[StepOutput]]:
    """A batch of one request's outputs grouped per choice (order kept inside each), the group holding the
    last output last: one response per group, and the request's final output stays in the last response."""
    groups: dict[int, list[StepOutput]] = {}
    for out in outs:
        groups.setdefault(out.index, []).append(out)
    last = groups.pop(outs[-1].index)
    return [*groups.values(), last]


def response(outs: list[StepOutput], prefill_s: float, state_at: float) -> worker_pb2.WorkerResponse:
    """One choice's outputs, in order, as one message (``state_at``: set on the request's last message)."""
    last = outs[-1]
    token_ids = [t for out in outs for t in out.new_token_ids]
    logprobs = [lp for out in outs for lp in out.logprobs or ()]
    return worker_pb2.WorkerResponse(
        token_ids=token_ids,
        finished=last.finished,
        finish_reason=last.finish_reason or "",
        cached_tokens=last.cached_tokens,
        prefill_s=prefill_s,
        state_at=state_at,
        index=last.index,
        logprobs=token_logprobs(token_ids, logprobs) if logprobs else [],
    )
