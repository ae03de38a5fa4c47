"""`n` and `logprobs` through the whole cluster: router, encoder and worker in their own processes, real Redis.

Per-token logprobs match the chunk's tokens and transformers' `generate` (raw log-softmax, token text filled by
the router); seeded choices reproduce; greedy choices equal `generate`; stop strings end each choice on its own;
bad values are INVALID_ARGUMENT naming the field; vLLM's sampling options equal `generate` with the matching
logits processors; and afterwards every KV block is free again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from services.client import Client, user_request
from services.common.registry import Registry
from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.launch.local import ClusterSpec, LocalCluster, start_cluster
from services.models.base import ChatMessage, ChatPart
from tests import media_factory
from tests.integration.conftest import RedisServer, model_folder
from tests.integration.test_skeleton import MAX_TOKENS, PROMPT, decoded, expected
from tests.oracle import hf_generate_logits


@dataclass
class Choice:
    chunks: list[generation_pb2.Chunk] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.token_ids]

    @property
    def text(self) -> str:
        return "".join(chunk.text for chunk in self.chunks)


@dataclass
class Answer:
    choices: dict[int, Choice]
    final: generation_pb2.Final


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("models"), "qwen2-vl")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    local: LocalCluster = start_cluster(ClusterSpec(model_dir, redis_url=redis_server.url, free_ports=True,
                                                    log_dir=tmp_path_factory.mktemp("logs")))  # fmt: skip
    client = Client(local.address)
    yield client
    client.close()
    local.stop()


def ask(client: Client, request: generation_pb2.GenerateRequest) -> Answer:
    """The answer's chunks grouped per choice, in stream order, and the Final (which must come last, once)."""
    choices: dict[int, Choice] = {}
    final = None
    for response in client.stream(request):
        assert final is None, "nothing may follow the Final"
        if response.HasField("chunk"):
            choices.setdefault(response.chunk.index, Choice()).chunks.append(response.chunk)
        else:
            final = response.final
    assert final is not None
    return Answer(choices, final)


def sampled(prompt: str, images: list[bytes], **fields: object) -> generation_pb2.GenerateRequest:
    request = user_request(prompt, images, max_tokens=MAX_TOKENS, stop=fields.pop("stop", ()))
    for name, value in fields.items():
        setattr(request.sampling, name, value)
    return request


def check_final(answer: Answer, n: int) -> None:
    """One ChoiceEnd per choice in index order, tokens counted per choice, usage summed, reason of choice 0."""
    final = answer.final
    assert sorted(answer.choices) == list(range(n))
    assert [end.index for end in final.choices] == list(range(n))
    assert [end.completion_tokens for end in final.choices] == [len(answer.choices[i].token_ids) for i in range(n)]
    assert final.usage.completion_tokens == sum(end.completion_tokens for end in final.choices)
    assert final.finish_reason == final.choices[0].finish_reason
    assert all(end.finish_reason in ("stop", "length") for end in final.choices)


def test_logprobs_per_token_equal_generate(cluster: Client, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    data = media_factory.png(120, 90, seed=31)
    answer = ask(cluster, sampled(PROMPT, [data], logprobs=3))
    check_final(answer, 1)
    (choice,) = answer.choices.values()
    parts = [ChatPart("image"), ChatPart("text", PROMPT)]
    tokens, logits = hf_generate_logits(model_dir, [ChatMessage("user", parts)], [decoded(data)], MAX_TOKENS)
    assert choice.token_ids == tokens == expected(model_dir, [data])
    reference = torch.log_softmax(logits, dim=-1)
    entries = []
    for chunk in choice.chunks:
        assert [entry.token_id for entry in chunk.logprobs] == list(chunk.token_ids)
        entries += chunk.logprobs
    for position, entry in enumerate(entries):
        top = [alt.logprob for alt in entry.top]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert entry.logprob == max(top) and entry.top[0].token_id == entry.token_id  # greedy: the most likely
        assert entry.logprob == pytest.approx(reference[position, entry.token_id].item(), abs=1e-4)
        assert top == pytest.approx(reference[position].topk(3).values.tolist(), abs=1e-4)
        assert entry.token == tokenizer.decode([entry.token_id])
        assert [alt.token for alt in entry.top] == [tokenizer.decode([alt.token_id]) for alt in entry.top]
    plain = ask(cluster, sampled(PROMPT, [data]))
    assert plain.choices[0].token_ids == tokens and not any(c.logprobs for c in plain.choices[0].chunks)


def test_seeded_choices_reproduce(cluster: Client) -> None:
    request = sampled("Tell me a story.", [], n=3, temperature=1.0, seed=1234, ignore_eos=True, logprobs=0)
    first = ask(cluster, request)
    check_final(first, 3)
    answers = [first.choices[i].token_ids for i in range(3)]
    assert all(len(tokens) == MAX_TOKENS for tokens in answers) and len({tuple(t) for t in answers}) > 1
    for i in range(3):  # logprobs=0: the drawn token's logprob alone
        assert all(len(c.logprobs) == len(c.token_ids) and all(not e.top for e in c.logprobs)
                   for c in first.choices[i].chunks)  # fmt: skip
    again = ask(cluster, request)
    assert [again.choices[i].token_ids for i in range(3)] == answers
    assert [again.choices[i].text for i in range(3)] == [first.choices[i].text for i in range(3)]


def test_greedy_choices_equal_generate_and_stop_each_on_its_own(cluster: Client, model_dir: Path) -> None:
    data = media_factory.jpeg(160, 120, seed=32)
    answer = ask(cluster, sampled(PROMPT, [data], n=2))
    check_final(answer, 2)
    greedy = expected(model_dir, [data])
    assert [answer.choices[i].token_ids for i in range(2)] == [greedy, greedy]
    text = answer.choices[0].text
    assert text == answer.choices[1].text and len(text.strip()) > 6, text
    stop = text.strip()[3:6]
    stopped = ask(cluster, sampled(PROMPT, [data], n=2, stop=[stop]))
    assert [end.finish_reason for end in stopped.final.choices] == ["stop", "stop"]
    assert [stopped.choices[i].text for i in range(2)] == [text[: text.find(stop)]] * 2


def test_count_tokens_projects_n_choices(cluster: Client) -> None:
    count = cluster.count(sampled(PROMPT, [], n=3))
    assert count.projected_tokens == count.prompt_tokens + 3 * MAX_TOKENS


@pytest.mark.parametrize(
    ("fields", "needle"), [({"n": 9}, "sampling.n"), ({"logprobs": 21}, "sampling.logprobs")], ids=["n", "logprobs"]
)
def test_bad_n_or_logprobs_is_invalid_argument(cluster: Client, fields: dict[str, int], needle: str) -> None:
    for call in (cluster.generate, cluster.count):
        with pytest.raises(grpc.RpcError) as info:
            call(sampled(PROMPT, [], **fields))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert needle in info.value.details()


def test_vllm_sampling_options_equal_generate(cluster: Client, model_dir: Path) -> None:
    """Penalties, min_p, bad words (strings the router tokenizes), logit_bias, min_tokens and stop_token_ids on a
    seeded image request equal `generate` with the matching logits processors; the stop id that ends it (forced
    by its bias once min_tokens allow) is the last token id, not in the text; a bad value is refused naming it."""
    from services.common.rpc.epd.v1 import worker_pb2
    from services.models.registry import load_adapter
    from services.router.processor_params import check_processor_params
    from services.worker.messages import engine_request
    from tests.oracle_processors import hf_generate_with

    adapter = load_adapter(model_dir)
    stop_id = adapter.tokenizer.encode("cat", add_special_tokens=False)[-1]
    data = media_factory.png(96, 72, seed=33)
    fields = {"temperature": 0.8, "seed": 77, "repetition_penalty": 1.5, "presence_penalty": 0.5,
              "frequency_penalty": 0.25, "min_p": 0.125, "min_tokens": 6}  # fmt: skip
    request = sampled(PROMPT, [data], **fields)
    request.sampling.stop_token_ids.append(stop_id)
    request.sampling.bad_words.extend(["the picture", "hello"])
    request.sampling.logit_bias[stop_id] = 100.0
    answer = ask(cluster, request)
    (choice,) = answer.choices.values()
    routed = common_pb2.SamplingParams()
    routed.CopyFrom(request.sampling)
    check_processor_params(routed, adapter.tokenizer, adapter.vocab_size)
    opts = engine_request(worker_pb2.WorkerRequest(request_id="x", token_ids=[1], sampling=routed)).sampling
    assert len(opts.bad_words) >= 2
    messages = [ChatMessage("user", [ChatPart("image"), ChatPart("text", PROMPT)])]
    oracle = hf_generate_with(model_dir, messages, [decoded(data)], opts, adapter.eos_token_ids)
    assert choice.token_ids == oracle and len(oracle) == 7 and oracle[-1] == stop_id
    assert answer.final.finish_reason == "stop"
    assert choice.text == adapter.tokenizer.decode(oracle[:-1], skip_special_tokens=True)
    with pytest.raises(grpc.RpcError) as info:
        cluster.generate(sampled(PROMPT, [], repetition_penalty=float("nan")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.repetition_penalty" in info.value.details()


def test_every_block_is_free_afterwards(cluster: Client, redis_server: RedisServer) -> None:
    """After the requests above (n up to 3, with images), the worker's published KV state is whole again."""
    registry = Registry(redis_server.url)
    deadline = time.monotonic() + 10
    try:
        while True:
            (member,) = registry.members("worker")
            state = member.state
            if state["free_blocks"] == state["total_blocks"] and state["reserved_blocks"] == 0:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
    finally:
        registry.close()
    assert state["running"] == 0 and state["waiting"] == 0 and state["preemptions"] == 0
