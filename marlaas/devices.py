"""Which torch device and dtype an engine process runs on (MARLAAS_DEVICE, MARLAAS_DTYPE).

    resolve_device("auto")  -> cuda:0 when torch sees a GPU, else cpu
    resolve_dtype("auto", device) -> bfloat16 on a GPU, float32 on the CPU

Both engines (the HF generation engine and the trainer) take the pair; vLLM places itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys


def resolve_device(name: str):
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> torch.device; a GPU asked for but absent is one clear error."""
    import torch

    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"MARLAAS_DEVICE={name!r} is not a torch device ('auto', 'cpu', 'cuda', 'cuda:N')") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"MARLAAS_DEVICE={name!r} but torch sees no CUDA GPU on this host "
                             f"(a CPU build of torch, or no driver)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"MARLAAS_DEVICE={name!r} but this host has {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ValueError(f"MARLAAS_DEVICE={name!r}: only 'cpu' and 'cuda' devices are supported")
    return dev


def resolve_dtype(name: str, device):
    """'auto' | 'float32' | 'bfloat16' -> torch dtype of the base weights ('auto': bfloat16 on a GPU)."""
    import torch

    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"MARLAAS_DTYPE={name!r}: expected 'auto', 'float32' or 'bfloat16'")
    return table[name]


def release_heap(device) -> None:
    """Hand freed host memory back to the OS after a pass or a model call on the CPU: glibc keeps freed
    heap pages resident, so an engine process would otherwise hold its largest call's working memory
    between calls (a generate worker on SmolLM2-135M: 1,039 MB resident after an evaluation with
    this, 1,115 MB without; the peak during a call is not lowered, and the call took as long).
    Nothing on other devices or without glibc."""
    if getattr(device, "type", device) == "cpu" and (trim := _malloc_trim()) is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, looked up once per process (None without glibc)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


@contextlib.contextmanager
def without_triton(device):
    """Load a CPU engine's model code without triton, a GPU kernel compiler: torch._dynamo (which
    transformers' model code imports) imports triton whenever it is installed (xgrammar, a vLLM
    dependency, installs it), mapping about 70 MB of libtriton into every engine process's resident
    set for nothing on a CPU (SmolLM2-135M's generate engine: 505 MB resident after load with it,
    434 MB without). Inside the block `import triton` fails as if it were absent, and it stays
    importable after it (a vLLM engine later in the process may load it). Nothing on other devices,
    or once triton or torch._dynamo is already loaded (then there is nothing left to save)."""
    block = (getattr(device, "type", device) == "cpu" and "triton" not in sys.modules
             and "torch._dynamo" not in sys.modules)
    if block:
        sys.modules["triton"] = None  # type: ignore[assignment]  # the import system's "not importable"
    try:
        yield
    finally:
        if block and sys.modules.get("triton", 0) is None:  # still our marker, not a module loaded since
            del sys.modules["triton"]
