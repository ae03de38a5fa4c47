"""Engine configuration: one validated dataclass, whose fields are also the worker's settings.

The worker's flags and `EPD_*` variables are these fields (`WorkerConfig` inherits them), so each engine
setting is declared and validated here once. No torch at import: client commands read the worker's settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.kv_layout import WORKER_ROLES
from services.models.loading import DTYPES
from services.worker.engine.tensor_parallel.plan import check_size

_GRAPH_ALIASES = {"true": "auto", "false": "off"}
ATTENTION_BACKENDS = ("auto", "cpu-kernel", "sdpa", "flash", "flash-reference", "triton")
CUDA_GRAPH_MODES = ("auto", "on", "off", "eager")
CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
"""The KV budget when ``kv_cache_bytes`` is 0 and the engine is not on CUDA."""


@dataclass
class EngineConfig:
    """Sizes and switches of one worker engine.

    ``kv_cache_bytes`` is the budget for the per-layer K and V block tensors; the number of blocks is
    derived from it and the model's shape. 0 (the default): on CUDA, what is left of
    ``gpu_memory_utilization`` x the device's memory after the weights, a warm-up step's peak and the
    embedding buffer; elsewhere ``CPU_KV_CACHE_BYTES``. ``block_size`` 0 (the default) takes the attention
    backend's (256 for ``flash``, whose paged kernel needs a multiple of 256; 16 otherwise). ``overcommit``
    scales how many blocks admitted requests may reserve against the total (1.0: never more than exist, so
    preemption never happens).

    ``prefill_tokens_per_free_seq`` (0: off) gives decodes priority to keep inter-token latency flat:
    a step takes at most ``max(block_size, prefill_tokens_per_free_seq x (max_num_seqs - decodes))``
    prefill tokens (tokens of chunks longer than one), so a step with many decoding sequences carries a
    small prefill chunk and one with few a large one; set it near (cost of a decode) / (cost of a prefill
    token), and a step costs about a full decode step at most.

    ``itl_target_ms`` (0: off) is an inter-token latency target: while sequences decode, each step carries the
    most prefill tokens the step-cost model (fitted online from the engine's own steps, ``step_cost.py``)
    predicts keep the step within it, at least one block's worth (``itl_target.py``); with both set, the
    smaller cap wins. With no decode running, prefill takes the whole budget either way. ``itl_target_factor``
    (0: off, the default) sets a relative target instead: that many times the predicted step of the same
    decodes alone; a time, when also set, wins.

    ``prefill_threads`` (0: automatic) are the intra-op CPU threads of a step of at least 256 tokens, the process's
    own for the others (step_threads.py): by default twice the process's, at most the cores it may use, so a
    prefill borrows a core the rest of the box leaves idle while the engine computes.

    ``attention_backend`` names one of ``ATTENTION_BACKENDS`` (services/worker/engine/attention/): ``"auto"``
    picks, on CUDA in float16/bfloat16, ``flash`` where torch's ``varlen_attn`` takes a block table, else
    ``triton`` where Triton imports, else ``sdpa`` (``sdpa`` in float32 too); on the CPU the compiled
    ``cpu-kernel`` where it applies (float32, 16-token blocks, head dims a multiple of 16, a C compiler) else
    ``sdpa``.

    ``cuda_graphs``: ``"auto"`` replays decode-only steps as CUDA graphs with ``flash`` or ``triton`` on CUDA;
    ``"on"`` captures with ``flash-reference`` too (which pads rows to ``max_model_len``: for checks with a short
    one); ``"off"`` never; ``"eager"`` runs the same padded static-buffer path without capturing (what the CPU
    tests use to prove the machinery).

    ``tensor_parallel_size`` > 1 shards the language model over that many rank processes, one per device
    (``cuda`` is GPUs 0..n-1, ``cuda:k`` GPUs k..k+n-1; gloo on the CPU), rank 0 running this engine
    (services/worker/engine/tensor_parallel/); ``kv_cache_bytes`` is then each rank's budget, and every rank
    holds the block count the tightest one allows.

    ``worker_role`` (``WORKER_ROLES``) is this engine's part in prefill/decode disaggregation (docs/disaggregation.md):
    ``both`` (the default) prefills and decodes; ``prefill`` also exports a remote-prefill request's KV blocks after
    each chunk (kv_connector.py); ``decode`` also takes in requests whose KV another engine computed.
    """

    block_size: int = field(
        default=0, metadata={"help": "tokens per KV block; 0: the attention backend's (256 for flash, else 16)"}
    )
    kv_cache_bytes: int = field(
        default=0, metadata={"help": "KV cache budget; 0: from EPD_GPU_MEMORY_UTILIZATION on CUDA, 256 MiB on CPU"}
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "share of GPU memory for weights, activations, embeddings and KV (CUDA)"}
    )
    cuda_graphs: str = field(
        default="auto",
        metadata={"help": "decode-only steps as CUDA graphs: auto, on, off or eager (true/false: auto/off)"},
    )
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "tokens per step"})
    max_num_seqs: int = field(default=64, metadata={"help": "sequences per step"})
    overcommit: float = field(default=1.0, metadata={"help": "reservable blocks / total (>= 1)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached KV blocks"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16, float16"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    max_model_len: int | None = field(default=None, metadata={"help": "longest prompt + output (unset: the model's)"})
    prefill_tokens_per_free_seq: int = field(
        default=0, metadata={"help": "prefill tokens per free sequence slot in a step (0: off)"}
    )
    itl_target_ms: float = field(
        default=0.0,
        metadata={"help": "inter-token latency target: prefill per step sized to keep decode steps under it (0: off)"},
    )
    itl_target_factor: float = field(
        default=0.0,
        metadata={
            "help": "with no itl_target_ms: prefill per step sized to keep a step within this many times its "
            "decodes' step alone (0: off)"
        },
    )
    prefill_threads: int = field(
        default=0,
        metadata={
            "help": "CPU threads of a step of 256 tokens or more (prefill); 0: twice the process's, at most its cores"
        },
    )
    embedding_buffer_bytes: int = field(default=256 * 1024 * 1024, metadata={"help": "embeddings held for prefill"})
    seed: int = field(default=0, metadata={"help": "the engine's sampling seed for unseeded requests"})
    grammar_cache_entries: int = field(
        default=128, metadata={"help": "compiled structured-output grammars kept (0: none kept)"}
    )
    grammar_cache_bytes: int = field(default=512 << 20, metadata={"help": "bytes of compiled grammars kept"})
    grammar_compile_timeout_s: float = field(
        default=10.0, metadata={"help": "longest a request waits for its grammar to compile before it fails"}
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "auto, cpu-kernel, sdpa, flash, flash-reference or triton (docs/engine.md)"},
    )
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "devices (rank processes) the language model is sharded over, 1-8"}
    )
    tensor_parallel_timeout_s: float = field(
        default=60.0, metadata={"help": "longest a collective between tensor-parallel ranks may take"}
    )
    tensor_parallel_start_timeout_s: float = field(
        default=900.0, metadata={"help": "longest a tensor-parallel rank may take to load its shard and join"}
    )
    worker_role: str = field(
        default="both",
        metadata={"help": "both, prefill or decode: this worker's part in prefill/decode disaggregation"},
    )

    def __post_init__(self) -> None:
        self.check()

    def check(self, name: Callable[[str], str] = lambda field: f"EngineConfig.{field}") -> None:
        """Raise ValueError naming the first bad setting by ``name(field)`` (the worker passes its variables'
        names). ``cuda_graphs`` true/false become auto/off; a torch dtype becomes its name."""
        self.cuda_graphs = _GRAPH_ALIASES.get(str(self.cuda_graphs).lower(), self.cuda_graphs)
        if not isinstance(self.dtype, str):
            self.dtype = str(self.dtype).removeprefix("torch.")
        for key in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{name(key)} must be positive, got {getattr(self, key)}")
        for key in ("block_size", "kv_cache_bytes"):
            if getattr(self, key) < 0:
                raise ValueError(f"{name(key)} must be >= 0 (0: automatic), got {getattr(self, key)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            utilization = self.gpu_memory_utilization
            raise ValueError(f"{name('gpu_memory_utilization')} must be within (0, 1], got {utilization}")
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            modes = ", ".join(CUDA_GRAPH_MODES)
            raise ValueError(f"{name('cuda_graphs')} must be one of {modes}, got {self.cuda_graphs!r}")
        if self.overcommit < 1.0:
            raise ValueError(f"{name('overcommit')} must be >= 1.0, got {self.overcommit}")
        if self.prefill_tokens_per_free_seq < 0:
            raise ValueError(f"{name('prefill_tokens_per_free_seq')} must be >= 0")
        for key in ("itl_target_ms", "itl_target_factor"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{name(key)} must be >= 0 (0: off), got {getattr(self, key)}")
        if self.prefill_threads < 0:
            raise ValueError(f"{name('prefill_threads')} must be >= 0 (0: automatic), got {self.prefill_threads}")
        if self.embedding_buffer_bytes < 0:
            raise ValueError(f"{name('embedding_buffer_bytes')} must be >= 0")
        for key in ("grammar_cache_entries", "grammar_cache_bytes"):
            if getattr(self, key) < 0:
                raise ValueError(f"{name(key)} must be >= 0, got {getattr(self, key)}")
        if not self.grammar_compile_timeout_s > 0:
            timeout = self.grammar_compile_timeout_s
            raise ValueError(f"{name('grammar_compile_timeout_s')} must be positive, got {timeout}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"{name('max_model_len')} must be positive, got {self.max_model_len}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{name('attention_backend')} must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        try:
            check_size(self.tensor_parallel_size)
        except ValueError as exc:
            raise ValueError(f"{name('tensor_parallel_size')}: {exc}") from None
        for key in ("tensor_parallel_timeout_s", "tensor_parallel_start_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{name(key)} must be positive, got {getattr(self, key)}")
        if self.worker_role not in WORKER_ROLES:
            raise ValueError(
                f"{name('worker_role')} must be one of {', '.join(WORKER_ROLES)}, got {self.worker_role!r}"
            )
        if self.worker_role != "both" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"{name('worker_role')}={self.worker_role} with {name('tensor_parallel_size')}="
                f"{self.tensor_parallel_size}: KV transfer between tensor-parallel workers is not built"
            )
        if self.worker_role == "decode" and self.overcommit != 1.0:
            raise ValueError(
                f"{name('worker_role')}=decode needs {name('overcommit')}=1: a preempted remote-prefilled request "
                f"could not recompute (its embeddings went to the prefill worker)"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"{name('dtype')} must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> Any:
        """The KV cache and activation dtype as a torch dtype."""
        import torch

        return getattr(torch, self.dtype)
