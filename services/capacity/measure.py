"""`epd profile`'s measurements: the model's costs on this machine through the real code paths, fitted (both parts).

1. In this process (measure_model.py), with the services' torch thread count: images through the encoder's decode
   (`decode_image`) and `VisionRunner` (prepare, tower); prompts through the worker `Engine` to their first
   token (prefill); decode steps of the `Engine` at several batches and contexts.
2. A real local cluster (measure_cluster.py: router, one encoder, one worker, a private Redis; free ports), as
   `epd up` and `epd bench traffic` start it: embeddings pushed to the worker by gRPC and gloo and through Redis
   (put, get) at several sizes; then probe requests through the router (text and image, short and long), whose measured
   time minus what part 1's curves predict is fitted as the serving overhead (see `profile.py`).

Other work on the machine only ever adds time, so a part's timing is the fastest of `repeats` runs after a
warm-up (as `timeit` takes), and a probe's the lower quartile of its rounds (`probe_quartiles`); every fit is
least squares with coefficients >= 0. Each request is unique (its own `cache_salt`, fresh image pixels), so no
prefix or embedding cache hit hides a cost.
"""

from __future__ import annotations

import gc
import os
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.capacity import profile as prof
from services.capacity.fit import LinearFit, fit
from services.capacity.measure_cluster import (
    fit_serving,
    measure_serving,
    measure_transfers,
    probe_quartiles,
    running_cluster,
)
from services.capacity.measure_model import engine_for, measure_decode, measure_prefill, measure_vision
from services.capacity.profile_options import Log, ProfileOptions, service_threads, torch_dtype


def measure_profile(model_dir: Path, options: ProfileOptions | None = None, log: Log = print) -> prof.Profile:
    """Measure and fit everything (module docstring; default options: `ProfileOptions()`); `log` gets one line
    per size measured. Needs redis-server (a private one is started on a free port)."""
    import torch

    from services.models.registry import load_adapter, model_revision

    options = options or ProfileOptions()
    started = time.perf_counter()
    threads = options.threads or service_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    adapter = load_adapter(Path(model_dir))
    try:
        model = adapter.load_model(options.device, torch_dtype(options.dtype))
        points: dict[str, list[dict[str, Any]]] = {}
        points["vision"] = measure_vision(adapter, model, options, log)
        engine = engine_for(adapter, model, options)
        points["prefill"] = measure_prefill(engine, adapter, options, log)
        points["decode"] = measure_decode(engine, adapter, options, log)
        del engine, model  # the cluster's own processes load the model next (one GPU holds one copy at a time)
        gc.collect()
        if options.device.startswith("cuda"):
            torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(before)
    curves = _engine_curves(points)
    with running_cluster(Path(model_dir), options) as cluster:
        points["transfer"] = measure_transfers(cluster, adapter.embedding_width, options, log)
        transfer = points["transfer"]
        transports = {
            name: fit([p for p in transfer if p["transport"] == name], "seconds", prof.TRANSPORT_TERMS, relative=True)
            for name in prof.TRANSPORTS
        }
        partial = prof.Profile(
            model={}, hardware={}, dtype=options.dtype, transports=transports, serving=_zero(), **curves
        )
        points["serving"] = measure_serving(cluster.address, adapter, partial, options, log)
    serving = fit_serving(probe_quartiles(points["serving"]))
    return replace(
        partial,
        model={
            "dir": str(model_dir),
            "model_type": adapter.model_type,
            "hidden_size": adapter.hidden_size,
            "revision": model_revision(Path(model_dir)),
        },
        hardware=_hardware(options, threads),
        serving=serving,
        points=points,
        measured_s=time.perf_counter() - started,
    )


def _engine_curves(points: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "prepare": fit(points["vision"], "prepare_s", prof.PREPARE_TERMS, relative=True),
        "tower": fit(points["vision"], "tower_s", prof.TOWER_TERMS, relative=True),
        "prefill": fit(points["prefill"], "seconds", prof.PREFILL_TERMS, relative=True),
        "decode": fit(points["decode"], "step_s", prof.DECODE_TERMS, relative=True),
    }


def _zero() -> LinearFit:
    return LinearFit(prof.SERVING_TERMS, (0.0,) * len(prof.SERVING_TERMS))


def _hardware(options: ProfileOptions, threads: int) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "device": options.device,
        "torch_threads": threads,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if options.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info
