"""The GPU check's ``structured`` section: the engine's grammar step on the device (the bitmask filled on the
grammar thread beside the forward, uploaded, applied by xgrammar's kernel), checked and timed.

The in-memory model has no tokenizer, so xgrammar sees a made-up vocabulary: every text id is a short piece of
JSON (a character, or a few), the special ids their names. Greedy requests, eos ignored: the plain rows of a
batch where half the rows are constrained equal a batch of the plain requests alone (the mask touches
constrained rows only), every constrained output is accepted token by token by a fresh matcher, and decode
tokens/s with a JSON schema on every request is set against none (``structured_ratio``), with the host
synchronisations per constrained step on CUDA. Skipped where xgrammar is not installed.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from typing import Any

import torch

from services.common.grammar import Constraint, grammar_of
from services.common.grammar_cache import GrammarCache
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from tests.gpu import workload as w

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
                "required": ["name", "ok"],
            },
            "minItems": 64,
        }
    },
    "required": ["items"],
}
"""An extraction-shaped schema that cannot end before the requests' last token (as `epd bench engine
--structured`'s)."""
PIECES = [*'{}[]:, "', *"abcdefghijklmnopqrstuvwxyz0123456789", "true", "false", '"name"', '"ok"', '"items"', ": "]


def structured(plan: Any, out: dict[str, Any]) -> None:
    try:
        import xgrammar as xgr
    except ImportError:
        out["skipped"] = "xgrammar is not installed here"
        return
    device = torch.device(plan.device)
    model, adapter = w.tiny_model(device, torch.float32, width=64, layers=2)
    vocab, limit = model.get_output_embeddings().out_features, w.text_id_limit(model)
    stops = sorted(adapter.eos_token_ids)
    pieces = [PIECES[i % len(PIECES)] for i in range(limit)] + [f"<special {i}>" for i in range(limit, vocab)]
    info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=stops)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    rows, new_tokens = (32 if device.type == "cuda" else 8), plan.new_tokens
    gen = torch.Generator().manual_seed(3)
    prompts = [w.random_ids(gen, 8 + i % 5, limit) for i in range(rows)]
    config = EngineConfig(device=plan.device, max_num_seqs=rows, max_num_batched_tokens=1024, kv_cache_bytes=64 << 20,
                          max_model_len=512)  # fmt: skip
    out.update(rows=rows, new_tokens=new_tokens, vocab=vocab)

    def engine() -> Engine:
        made = Engine(adapter, model, config)
        made.structured.cache = GrammarCache(info, 8, 1 << 30)  # the made-up vocabulary's view
        made.structured.cache.compile(constraint).result()
        return made

    def run(constrained: list[bool]) -> tuple[list[list[int]], list[float], list[int]]:
        e = engine()
        for i, ids in enumerate(prompts):
            sampling = SamplingOptions(max_tokens=new_tokens, ignore_eos=True,
                                       structured=constraint if constrained[i] else None)  # fmt: skip
            e.add_request(EngineRequest(f"r{i}", ids, [], sampling))
        tokens: dict[str, list[int]] = {}
        steps, syncs = [], []
        while e.has_work():
            decoding = len(e.scheduler.running) == rows and not e.awaiting_grammar
            started = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outputs = e.step()
            if decoding:
                steps.append(time.perf_counter() - started)
                syncs.append(sum("synchroniz" in str(m.message) for m in caught))
            for o in outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        e.structured.close()
        return [tokens.get(f"r{i}", []) for i in range(rows)], steps, syncs

    half = [i % 2 == 1 for i in range(rows)]
    plain_tokens, _, _ = run([False] * rows)
    mixed_tokens, _, _ = run(half)
    grammar = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(grammar_of(constraint))
    valid = 0
    for i, ids in enumerate(mixed_tokens):
        if half[i]:
            matcher = xgr.GrammarMatcher(grammar)
            valid += all(matcher.accept_token(t) for t in ids) and len(ids) == new_tokens
    out["plain_rows_unchanged"] = sum(mixed_tokens[i] == plain_tokens[i] for i in range(rows) if not half[i])
    out["constrained_rows_valid"] = valid
    out["constrained_rows"] = sum(half)
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    try:
        times = {}
        for name, flags in (("free", [False] * rows), ("schema", [True] * rows), ("free_again", [False] * rows)):
            _, steps, syncs = run(flags)
            times[name] = statistics.median(steps) if steps else float("nan")
            if name == "schema" and syncs:
                out["syncs_per_constrained_step"] = max(syncs)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    free = min(times["free"], times["free_again"])
    out.update(step_ms_free=round(free * 1e3, 3), step_ms_schema=round(times["schema"] * 1e3, 3),
               structured_ratio=round(free / times["schema"], 3))  # fmt: skip
