"""CPU shims that let Megatron-Core run without CUDA (tests, CPU-only nodes). The only module that
touches Megatron's private internals; everything else uses its public API.

Megatron-Core assumes CUDA in places that have nothing to do with the arithmetic. Measured against
the pinned `megatron-core==0.16.1` (setup.cfg); these reach into internals, so a new version must be
checked again before the pin moves. What each shim is for:

- `torch.cuda.current_device()` returns "cpu": buffers and parameters are allocated with
  `device=torch.cuda.current_device()`, which then lands on the CPU.
- `torch.cuda.synchronize()` is a no-op: timers and the pipeline schedules call it.
- `_CpuRNGStatesTracker`, installed as `tensor_parallel.random._CUDA_RNG_STATE_TRACKER`: the
  attention and transformer-block code fork the "model-parallel-rng" state even with dropout 0, and
  the stock tracker keeps CUDA generator states. This one keeps CPU generator states, so
  `tensor_parallel.model_parallel_cuda_manual_seed` works unchanged on it.
- `_CpuMode`, a global `TorchFunctionMode`: rewrites `device="cuda"` (or a cuda `torch.device`, or a
  device index) to the CPU, makes `Tensor.cuda()` return the tensor itself, and makes `Tensor.type()`
  report `torch.cuda.*Tensor` (the optimizers and gradient clipping assert a CUDA type string).

`install()` does nothing where CUDA is available; `uninstall()` undoes it (tests restore the process).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel import random
from torch.overrides import TorchFunctionMode

_STATE: dict = {}


class _CpuRNGStatesTracker(random.CudaRNGStatesTracker):
    """Named CPU generator states; forking one swaps it into the CPU default generator."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} or seed {seed} already added")
        self._is_initialized = True  # the stock add() reads and sets CUDA generator states
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _is_cuda(device) -> bool:
    return ((isinstance(device, str) and device.startswith("cuda"))
            or (isinstance(device, torch.device) and device.type == "cuda"))


class _CpuMode(TorchFunctionMode):
    """device="cuda" -> CPU; Tensor.cuda() -> the tensor; Tensor.type() -> "torch.cuda.*Tensor"."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if _is_cuda(device) or (isinstance(device, int) and not isinstance(device, bool)):
            kwargs["device"] = "cpu"
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def install() -> None:
    """Install the CPU shims (idempotent); nothing where CUDA is available."""
    if torch.cuda.is_available() or _STATE:
        return
    _STATE.update(current_device=torch.cuda.current_device, synchronize=torch.cuda.synchronize,
                  tracker=random._CUDA_RNG_STATE_TRACKER,
                  tracker_initialized=random._CUDA_RNG_STATE_TRACKER_INITIALIZED, mode=_CpuMode())
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    random._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _STATE["mode"].__enter__()


def uninstall() -> None:
    """Undo install() (idempotent): the originals back, the mode left."""
    if not _STATE:
        return
    _STATE["mode"].__exit__(None, None, None)
    torch.cuda.current_device = _STATE["current_device"]
    torch.cuda.synchronize = _STATE["synchronize"]
    random._CUDA_RNG_STATE_TRACKER = _STATE["tracker"]
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _STATE["tracker_initialized"]
    _STATE.clear()
