"""Host buffers for a stage: leaves that bring their own buffer or none, and pages made resident ahead.

:class:`~spot_callbacks.staging.StagingArea` copies every tensor of a state into a buffer of its own,
kept for the next checkpoint. Two kinds of leaf change that, for a writer that knows better: an
:class:`IntoBuffer` is copied into the buffer it names (FSDP1's flat shards, into the buffers the
writer then cuts the chunks in), an :class:`Adopted` tensor is staged as it is (a state dict's fresh
CPU copy, which a second copy would only double). :func:`fault_in` makes a new buffer's pages
resident before a copy needs them.
"""

from __future__ import annotations

import mmap
import threading

import torch

_PAGE = mmap.PAGESIZE
_FAULT_SLICE = 64 << 20  # bytes touched between two looks at the cancel flag (~10 ms)


class IntoBuffer:
    """A state leaf that :meth:`~spot_callbacks.staging.StagingArea.stage` copies into ``buffer``, a host tensor its caller owns
    (same shape and dtype; the staged state holds ``buffer``), instead of a buffer of the area's.

    For a writer that lays the staged bytes out again in place (FSDP1's flat shards, cut into chunks in
    the same memory). The area's one-staged-state-at-a-time rule covers ``buffer`` like its own.

    Example:
        >>> from spot_callbacks.staging import StagingArea
        >>> area, target = StagingArea(), torch.zeros(2)
        >>> staged = area.stage({"w": IntoBuffer(torch.ones(2), target)})
        >>> staged.state["w"] is target, target.tolist()
        (True, [1.0, 1.0])
        >>> staged.release()
    """

    __slots__ = ("source", "buffer")

    def __init__(self, source: torch.Tensor, buffer: torch.Tensor) -> None:
        self.source, self.buffer = source, buffer


class Adopted:
    """A state leaf staged as it is, without a copy: a CPU tensor that nothing else holds or changes
    (a state dict's fresh copy, as FSDP1's sharded state dicts are), owned by the staged state from
    then on and freed with it.

    Example:
        >>> from spot_callbacks.staging import StagingArea
        >>> area, fresh = StagingArea(), torch.ones(2)
        >>> staged = area.stage({"w": Adopted(fresh)})
        >>> staged.state["w"] is fresh, area.buffer_bytes
        (True, 0)
        >>> staged.release()
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def fault_in(buffer: torch.Tensor, cancel: threading.Event | None = None) -> None:
    """Write one byte of every page of a new buffer, so the copy into it finds them resident; in
    slices, so that ``cancel`` (a stage, the process's exit) stops it within one slice.

    Example:
        >>> fault_in(torch.empty(1024))
    """
    if buffer.numel() and not buffer.is_pinned():  # pinned memory is resident already
        with torch.no_grad():
            data = buffer.view(-1).view(torch.uint8)
            for start in range(0, data.numel(), _FAULT_SLICE):
                if cancel is not None and cancel.is_set():
                    return
                data[start : start + _FAULT_SLICE : _PAGE].zero_()
            # The data rarely starts on a page boundary (malloc's header comes first): its last page
            # is one past those the stride reaches.
            data[-1:].zero_()
