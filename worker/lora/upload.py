"""SlotUploader: where the pool's slot writes (adapter uploads, clears) run, chosen once when the manager is built.

On CUDA the copies go to a side stream, so the host enqueues them without waiting and they overlap whatever the
compute stream still has queued; an event recorded after them is what the compute stream waits on before the next
forward pass (the first that can read the slots). The side stream first waits for the compute stream, since forwards
already queued may still read a slot being overwritten. Elsewhere (the CPU) the writes run in place, in order, and
there is nothing to wait for: the same calls, doing nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class SlotUploader:
    """Synchronous: every device but CUDA."""

    @contextlib.contextmanager
    def upload(self) -> Iterator[None]:
        """Slot writes made inside this block are ordered before the next `ready()`."""
        yield

    def ready(self) -> None:
        """Before a forward pass: the slot writes made so far are visible to it."""


class CudaSlotUploader(SlotUploader):
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # recorded after the last upload that the compute stream has not waited for yet
        self.pending: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def upload(self) -> Iterator[None]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:  # what was issued before an error is awaited too
            self.pending = self.stream.record_event()

    def ready(self) -> None:
        if self.pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self.pending)
            self.pending = None


def uploader_for(device: torch.device) -> SlotUploader:
    return CudaSlotUploader(device) if device.type == "cuda" else SlotUploader()
