"""Host staging buffers for async saves: the only part of an async save the training loop waits for.

An async save copies every local chunk of the state into a host buffer (pinned when the source is
on a GPU, so the copy is a DMA), then writes from the buffers in the background while training
changes the originals. The buffers are kept from one save to the next (the same chunks have the
same shapes every time), so a save allocates nothing after the first.
"""

from __future__ import annotations

import dataclasses

import torch

from shardsafe.state.registry import SaveView

Copy = tuple[torch.Tensor, torch.Tensor]  # (staging buffer, source)


class StagingBuffers:
    """Host buffers the state is copied into for an async save, reused from one save to the next."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def prepare(self, view: SaveView) -> list[Copy]:
        """Point the view's chunks at staging buffers; returns the (buffer, source) copies to make."""
        copies = []
        used = set()
        for i, chunk in enumerate(view.chunks):
            ident = (chunk.key, chunk.offsets)
            source = chunk.tensor.detach()
            buffer = self.buffers.get(ident)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
                self.buffers[ident] = buffer
            used.add(ident)
            copies.append((buffer, source))
            view.chunks[i] = dataclasses.replace(chunk, tensor=buffer)  # the same chunk (per-rank flag included), staged
        for ident in set(self.buffers) - used:
            del self.buffers[ident]
        return copies


def copy_all(copies: list[Copy]) -> None:
    """Make the copies; returns once every buffer holds its source's bytes."""
    with torch.no_grad():
        for buffer, source in copies:
            buffer.copy_(source, non_blocking=source.is_cuda)
        if any(source.is_cuda for _, source in copies):
            torch.cuda.synchronize()
