"""The sharded language model: transformers' own tensor-parallel plan (which layers are column- and row-wise)
applied by head to one rank's slice of the weights, plus a vocabulary-parallel embedding and LM head.

Column-parallel layers keep their ``nn.Linear`` with this rank's output rows (q/k/v by whole heads, biases too;
gate/up by intermediate columns); row-parallel layers (o_proj, down_proj) hold this rank's input columns and
all-reduce their partial sums once, adding the bias after. The embedding holds this rank's vocabulary rows and
all-reduces the looked-up rows (zero for ids it does not hold); the LM head computes this rank's logits and
gathers every rank's, so each rank ends with the full logits.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from services.worker.engine.tensor_parallel.collectives import Collectives
from services.worker.engine.tensor_parallel.plan import ShardPlan, split


class RowParallelLinear(nn.Module):
    """``x @ W[:, cols].T`` summed over the ranks, plus the bias once: a row-parallel ``nn.Linear``."""

    def __init__(self, linear: nn.Linear, cols: range, group: Collectives) -> None:
        super().__init__()
        self.in_features = len(cols)
        self.out_features = linear.out_features
        self.weight = nn.Parameter(linear.weight.data[:, cols.start : cols.stop].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(nn.functional.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` holding rows ``rows`` of the vocabulary; ids elsewhere look up zeros, then the ranks'
    rows are summed."""

    def __init__(self, embedding: nn.Embedding, rows: range, group: Collectives) -> None:
        super().__init__()
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.start, self.end = rows.start, rows.stop
        self.weight = nn.Parameter(embedding.weight.data[rows.start : rows.stop].clone(), requires_grad=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        held = (ids >= self.start) & (ids < self.end)
        rows = nn.functional.embedding((ids - self.start) * held, self.weight) * held.unsqueeze(-1)
        return self.group.all_reduce(rows)


class ParallelLMHead(nn.Module):
    """The LM head's rows ``rows`` of the vocabulary; ``forward`` returns the full logits on every rank."""

    def __init__(self, head: nn.Linear, plan: ShardPlan, rank: int, group: Collectives) -> None:
        super().__init__()
        rows = plan.vocab[rank]
        self.in_features = head.in_features
        self.out_features = head.out_features
        self.weight = nn.Parameter(head.weight.data[rows.start : rows.stop].clone(), requires_grad=False)
        self.bias = None
        if head.bias is not None:
            self.bias = nn.Parameter(head.bias.data[rows.start : rows.stop].clone(), requires_grad=False)
        self.widths = [len(r) for r in plan.vocab]
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(nn.functional.linear(hidden, self.weight, self.bias), self.widths)


def planned_layers(model: nn.Module) -> Iterator[tuple[str, nn.Linear, nn.Module, str, bool]]:
    """``(name, linear, parent, style, in_attention)`` for each layer of ``model``'s language model that its
    text config's ``base_model_tp_plan`` names (``style`` colwise or rowwise). ValueError when the config ships
    no plan, or a planned layer is not a linear layer or has a style we do not shard."""
    text = model.config.get_text_config()
    rules = getattr(text, "base_model_tp_plan", None)
    if not rules:
        raise ValueError(f"{text.model_type} ships no tensor-parallel plan (base_model_tp_plan)")
    patterns = [(re.compile(re.escape(key).replace(r"\*", r"\d+") + "$"), style) for key, style in rules.items()]
    decoder = _decoder(model)
    owners = dict(decoder.named_modules())
    for name, module in list(decoder.named_modules()):
        style = next((s for pattern, s in patterns if pattern.match(name)), None)
        if style is None:
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"tensor-parallel layer {name} is a {type(module).__name__}, not a linear layer")
        if style not in ("colwise", "rowwise"):
            raise ValueError(f"tensor-parallel style {style!r} of {name} is not one we shard")
        parent = owners[name.rpartition(".")[0]]
        yield name, module, parent, style, hasattr(parent, "head_dim")


def shard_slice(name: str, linear: nn.Linear, style: str, attention: bool, plan: ShardPlan, rank: int) -> range:
    """The output rows (colwise) or input columns (rowwise) of ``linear`` that rank ``rank`` keeps: whole heads
    in attention (query or KV, by the layer's width), an even split elsewhere."""
    d = plan.head_dim
    if style == "rowwise":
        if attention and linear.in_features != plan.num_heads * d:
            raise ValueError(f"{name}: {linear.in_features} inputs are not the query heads")
        return _head_rows(plan.q_heads[rank], d) if attention else split(linear.in_features, plan.size)[rank]
    if not attention:
        return split(linear.out_features, plan.size)[rank]
    if linear.out_features == plan.num_heads * d:
        return _head_rows(plan.q_heads[rank], d)
    if linear.out_features == plan.num_kv_heads * d:
        return _head_rows(plan.kv_heads[rank], d)
    raise ValueError(f"{name}: {linear.out_features} outputs are neither query nor KV heads")


def shard_language_model(model: nn.Module, plan: ShardPlan, rank: int, group: Collectives) -> None:
    """Cut ``model``'s language model down to rank ``rank``'s share of ``plan``, in place, by the text config's
    ``base_model_tp_plan`` (transformers' list of column- and row-wise layers); the vision tower is left whole.

    The text config then describes this rank's model (its query and KV heads, ``head_dim`` explicit), so what
    reads the model's shape (the KV cache) sees this rank's. ValueError as `planned_layers` says.
    """
    text = model.config.get_text_config()
    for name, linear, parent, style, attention in list(planned_layers(model)):
        kept = shard_slice(name, linear, style, attention, plan, rank)
        if style == "colwise":
            _keep_rows(linear, kept)
        else:
            setattr(parent, name.rpartition(".")[2], RowParallelLinear(linear, kept, group))
        if attention and hasattr(parent, "num_key_value_groups"):
            parent.num_key_value_groups = plan.groups[rank]
    model.set_input_embeddings(VocabParallelEmbedding(model.get_input_embeddings(), plan.vocab[rank], group))
    model.set_output_embeddings(ParallelLMHead(model.get_output_embeddings(), plan, rank, group))
    text.head_dim = plan.head_dim
    text.num_attention_heads = len(plan.q_heads[rank])
    text.num_key_value_heads = len(plan.kv_heads[rank])


def rank_parameters(model: nn.Module, plan: ShardPlan, rank: int) -> int:
    """How many parameters rank ``rank`` holds of ``model`` (unsharded, on any device, ``meta`` too): its slices
    of the planned layers, embedding and LM head, everything else whole (norms; the vision tower, which rank 0
    alone keeps: rank 0 holds the most)."""
    total = sum(p.numel() for p in model.parameters())
    for name, linear, _, style, attention in planned_layers(model):
        kept = len(shard_slice(name, linear, style, attention, plan, rank))
        if style == "colwise":
            total -= (linear.out_features - kept) * (linear.in_features + (linear.bias is not None))
        else:
            total -= (linear.in_features - kept) * linear.out_features
    held = len(plan.vocab[rank])
    tables = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    for weight in tables.values():  # a tied head shares the embedding's weight
        total -= (weight.shape[0] - held) * weight.shape[1]
    return total


def drop_all_but_the_language_model(model: nn.Module) -> None:
    """Release what a rank other than 0 never runs: every part of the multimodal model beside its language model
    and head (the vision tower, the projector), so a rank holds only its shard and the norms."""
    decoder = _decoder(model)
    owner = getattr(model, "model", None)
    if owner is None or all(child is not decoder for child in owner.children()):
        return
    for name, child in list(owner.named_children()):
        if child is not decoder:
            setattr(owner, name, None)


def _decoder(model: nn.Module) -> nn.Module:
    """The language model (the module the text config's plan names layers in)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(f"{type(model).__name__} has no language model with decoder layers")
    return decoder


def _head_rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def _keep_rows(linear: nn.Linear, rows: range) -> None:
    linear.weight = nn.Parameter(linear.weight.data[rows.start : rows.stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows.start : rows.stop].clone(), requires_grad=False)
    linear.out_features = len(rows)
