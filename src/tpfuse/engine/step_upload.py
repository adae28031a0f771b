"""The one host-to-device copy of a packed step, through a pinned staging buffer.

A packed step (step_inputs.py) is built in pageable CPU memory; `StepUpload` copies it into a pinned
buffer and from there to the device without blocking the host. The staging buffer is reused, so
before overwriting it the host waits for the previous step's copy to have left it (an event), never
for the step's compute. On CPU the packed tensor is used as it is (or copied into the target).
"""

from __future__ import annotations

import torch


class StepUpload:
    def __init__(self, device: torch.device):
        self.device = device
        self._staging: torch.Tensor | None = None
        self._copy_done = torch.cuda.Event() if device.type == "cuda" else None

    def _stage(self, packed: torch.Tensor) -> torch.Tensor:
        """packed copied into the pinned staging buffer (CUDA only)."""
        if self._staging is None or self._staging.numel() < packed.numel():
            self._staging = torch.empty(max(packed.numel(), 1 << 16), dtype=torch.int64, pin_memory=True)
        self._copy_done.synchronize()  # the previous step's copy has left the pinned buffer
        staging = self._staging[: packed.numel()]
        staging.copy_(packed)
        return staging

    def to_device(self, packed: torch.Tensor) -> torch.Tensor:
        """A device copy of the CPU packed step (packed itself on CPU), in a new tensor."""
        if self.device.type != "cuda":
            return packed
        out = self._stage(packed).to(self.device, non_blocking=True)
        self._copy_done.record()
        return out

    def into(self, packed: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor | None:
        """Copies packed into the device buffer (the CUDA graphs' static packed input); returns the
        view that holds it, None when it does not fit."""
        if packed.numel() > buffer.numel():
            return None
        target = buffer[: packed.numel()]
        if self.device.type != "cuda":
            target.copy_(packed)
            return target
        target.copy_(self._stage(packed), non_blocking=True)
        self._copy_done.record()
        return target


def upload(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """values (a list, a NumPy array or a CPU tensor) as a new tensor on device, without waiting for
    the device's queued work: a pageable host-to-device copy waits for the stream, so CUDA copies go
    through pinned memory (the caching host allocator keeps it until the copy has run)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
