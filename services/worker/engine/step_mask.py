"""One step's grammar mask: the constrained rows' token bitmask, applied to the logits on their device.

Invariant: bit ``j % 32`` of word ``j // 32`` of a row is set exactly when its grammar allows token ``j`` now (the
matcher's own view when it was filled); the raw logits are never changed in place (logprobs read them).
"""

from __future__ import annotations

from typing import Any

import torch

from services.worker.engine.host_device import HostDevice


def bit_rows(bitmask: torch.Tensor) -> list[int]:
    """Each row of ``bitmask [k, words]`` (int32, little-endian) as one Python int whose bit ``j`` is token ``j``:
    a token's check is then one shift, with no numpy call on the engine thread."""
    data, width = bitmask.numpy().tobytes(), bitmask.shape[1] * 4
    return [int.from_bytes(data[i : i + width], "little") for i in range(0, len(data), width)]


class StepMask:
    """One step's grammar mask. ``rows``: the step's sampling rows that are constrained, ``states`` their grammars
    (structured.py's ``GrammarState``, carried for the accepts); ``bitmask [k, words]``
    (int32, host; bit ``j % 32`` of word ``j // 32`` is token ``j``) holds row ``rows[i]``'s mask in row
    ``source[i]``, ``bits`` the same rows as ints (``bit_rows``; made here when not given), and ``bias [k,
    vocab]`` (CPU only: 0 or -inf) the same rows as floats."""

    def __init__(
        self,
        rows: list[int],
        states: list[Any],
        source: list[int],
        bitmask: torch.Tensor,
        bias: torch.Tensor | None,
        stop_ids: list[int],
        bits: list[int] | None = None,
    ) -> None:
        self.rows = rows
        self.states = states
        self.source = source
        self.bitmask = bitmask
        self.bias = bias
        self.stop_ids = stop_ids
        self._bits = bits

    @property
    def bits(self) -> list[int]:
        """``bit_rows(bitmask)``, made on first use (the engine thread's accepts need none)."""
        if self._bits is None:
            self._bits = bit_rows(self.bitmask)
        return self._bits

    def apply(self, logits: torch.Tensor, io: HostDevice) -> torch.Tensor:
        """A float32 copy of ``logits [N, vocab]`` with the tokens each constrained row's grammar does not allow
        at -inf; no host read."""
        if self.bias is not None:  # the CPU: one add (or a copy and an index_add) in place of a bit kernel
            k = len(self.rows)
            bias = self.bias
            if bias.shape[0] != k or self.source != list(range(k)):  # a fill of more rows, or in another order
                bias = bias[self.source]
            if k == logits.shape[0]:  # every row constrained (``rows`` ascend: they are the step's rows)
                return logits + bias
            out = logits.to(torch.float32, copy=True)
            return out.index_add_(0, torch.tensor(self.rows), bias)
        import xgrammar as xgr

        if self.source == self.rows:  # bitmask row r is step row r
            step_rows = self.bitmask
        else:  # the bitmask rows laid out at their step rows (a small host copy)
            step_rows = self.bitmask.new_zeros((logits.shape[0], self.bitmask.shape[1]))
            step_rows[self.rows] = self.bitmask[self.source]
        masks = io.to_device(step_rows, torch.int32)
        out = logits.to(torch.float32, copy=True)
        xgr.apply_token_bitmask_inplace(out, masks, indices=self.rows)
        return out

    def allows(self, i: int, token: int) -> bool:
        """Whether the grammar of ``rows[i]`` allows ``token`` now."""
        return bool(self.bits[self.source[i]] >> token & 1)

    def only_stop_allowed(self, i: int) -> bool:
        """True when row ``rows[i]``'s grammar allows no token but the stop tokens (the grammar is complete)."""
        return not self.bits[self.source[i]] & ~sum(1 << token for token in self.stop_ids)
