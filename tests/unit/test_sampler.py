"""The device sampler: vectorised top-k/top-p against a row-by-row reference, the exponential race's distribution,
greedy rows untouched, seeded rows independent of their neighbours."""

from __future__ import annotations

import random

import torch

from services.worker.engine.host_device import HostDevice
from services.worker.engine.request import SamplingOptions
from services.worker.engine.sampler import Sampler, filter_top_k_top_p


def one_row(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The rule, one row at a time: values below the k-th largest dropped, then outside the top-p mass."""
    out = logits.clone()
    if 0 < top_k < logits.shape[0]:
        out[out < torch.topk(out, top_k).values[-1]] = float("-inf")
    if 0 < top_p < 1:
        probs = out.softmax(-1)
        order = torch.argsort(out, descending=True, stable=True)
        mass = 0.0
        for token in order.tolist():
            if mass >= top_p:
                out[token] = float("-inf")
            mass += float(probs[token])
    return out


def test_filter_matches_row_by_row() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows, vocab = rng.randint(1, 6), rng.randint(2, 60)
        logits = torch.randn(rows, vocab, generator=gen) * 3
        logits[:, 0] = logits[:, 1]  # a tie at some rank
        ks = [rng.choice([vocab, 1, 2, rng.randint(1, vocab)]) for _ in range(rows)]
        ps = [rng.choice([1.0, 0.5, 0.9, rng.random()]) for _ in range(rows)]
        got = filter_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps, dtype=torch.float32))
        for row in range(rows):
            expected = one_row(logits[row], ks[row], ps[row])
            assert torch.equal(torch.isinf(got[row]), torch.isinf(expected)), (ks[row], ps[row])
            kept = ~torch.isinf(expected)
            assert torch.equal(got[row][kept], expected[kept])


def test_argmax_to_host_is_torch_argmax() -> None:
    """The greedy read (numpy's argmax of CPU float32/float64 logits) takes torch's index: the first of tied
    maxima, the first NaN, strided rows too; other dtypes keep torch's own argmax. Each is one counted read."""
    io = HostDevice(torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    cases = [
        torch.randint(0, 3, (64, 97), generator=generator).float(),  # many ties
        torch.randn(8, 562, generator=generator, dtype=torch.float64),
        torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [float("-inf")] * 4, [float("inf"), 0, float("inf"), 1]]),
        torch.randn(5, 33, generator=generator).bfloat16(),
        torch.randn(40, 64, generator=generator)[:, ::2],  # strided rows
    ]
    for logits in cases:
        assert io.argmax_to_host(logits) == logits.argmax(dim=-1).tolist()
    assert io.downloads == len(cases)


def test_exponential_race_draws_by_probability() -> None:
    """20,000 rows of the same distribution: each token's share within 1.5 % of its probability."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = probs.log().expand(20_000, -1).clone()
    sampler = Sampler(seed=5, io=HostDevice(torch.device("cpu")))
    options = [SamplingOptions(temperature=1.0)] * logits.shape[0]
    tokens = sampler.sample(logits, options, [None] * logits.shape[0])
    share = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    assert (share - probs).abs().max() < 0.015 and share[4] == 0


def test_greedy_rows_and_seeded_rows_keep_to_themselves() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen)
    sampler = Sampler(seed=0, io=HostDevice(torch.device("cpu")))
    greedy = SamplingOptions()
    seeded = SamplingOptions(temperature=1.0, top_k=10, seed=7)
    hot = SamplingOptions(temperature=2.0)
    generators = [None, torch.Generator().manual_seed(7), None, None, None, torch.Generator().manual_seed(7)]
    mixed = sampler.sample(logits, [greedy, seeded, hot, greedy, hot, seeded], generators)
    assert mixed[0] == logits[0].argmax() and mixed[3] == logits[3].argmax()
    alone = sampler.sample(logits[1:2], [seeded], [torch.Generator().manual_seed(7)])
    assert mixed[1] == alone[0]
    alone5 = sampler.sample(logits[5:6], [seeded], [torch.Generator().manual_seed(7)])
    assert mixed[5] == alone5[0]
    assert int(mixed[1]) in torch.topk(logits[1], 10).indices.tolist()


def test_logprobs_are_the_raw_log_softmax_read_in_one_copy() -> None:
    """Greedy and sampled rows (filtered, seeded or not) and rows without logprobs, k from 0 to 20: the token is
    what ``sample`` draws, its logprob and the top k (ids and values, in ``topk`` order) are ``log_softmax`` of the
    raw logits (before temperature/top-k/top-p), and all of it comes back in one counted host read."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 2
    options = [
        SamplingOptions(logprobs=3),
        SamplingOptions(temperature=0.9, top_k=5, logprobs=5),
        SamplingOptions(),
        SamplingOptions(temperature=1.2, top_p=0.8, seed=4, logprobs=0),
        SamplingOptions(logprobs=20),
        SamplingOptions(temperature=0.7),
    ]

    def generators() -> list[torch.Generator | None]:
        return [None, None, None, torch.Generator().manual_seed(4), None, None]

    io = HostDevice(torch.device("cpu"))
    rows = Sampler(seed=11, io=io).sample_to_host(logits, options, generators())
    assert io.downloads == 1
    tokens = Sampler(seed=11, io=HostDevice(torch.device("cpu"))).sample(logits, options, generators())
    assert [token for token, _ in rows] == tokens.tolist()
    expected = torch.log_softmax(logits, dim=-1)
    for row, ((token, logprobs), opts) in enumerate(zip(rows, options, strict=True)):
        if opts.logprobs is None:
            assert logprobs is None
            continue
        values, ids = expected[row].topk(opts.logprobs)
        assert logprobs.logprob == expected[row, token].item()
        assert logprobs.top_ids == tuple(ids.tolist()) and logprobs.top_logprobs == tuple(values.tolist())
        if opts.temperature == 0 and opts.logprobs:
            assert token == logprobs.top_ids[0] and logprobs.logprob == max(logprobs.top_logprobs)


def test_without_logprobs_the_ids_come_back_alone() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    options = [SamplingOptions(), SamplingOptions(temperature=1.0, seed=2), SamplingOptions()]
    io = HostDevice(torch.device("cpu"))
    rows = Sampler(seed=0, io=io).sample_to_host(logits, options, [None, torch.Generator().manual_seed(2), None])
    assert io.downloads == 1 and all(lp is None for _, lp in rows)
    assert rows[0][0] == int(logits[0].argmax()) and rows[2][0] == int(logits[2].argmax())
