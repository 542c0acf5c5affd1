"""Device and dtype choice of the engines (MARLAAS_DEVICE / MARLAAS_DTYPE)."""

import pytest
import torch

from marlaas.devices import resolve_device, resolve_dtype

pytestmark = pytest.mark.unit


def test_auto_follows_what_torch_sees():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want and resolve_device("").type == want
    assert resolve_device("CPU") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16


@pytest.mark.parametrize("name, msg", [("xla", "only 'cpu' and 'cuda'"), ("gpu!", "not a torch device"),
                                       ("cuda:99", "GPU")])
def test_bad_devices_are_one_clear_error(name, msg):
    with pytest.raises(ValueError, match=msg):
        resolve_device(name)
    with pytest.raises(ValueError, match="expected 'auto', 'float32' or 'bfloat16'"):
        resolve_dtype("float16", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only host's message")
def test_cuda_asked_on_a_cpu_host():
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        resolve_device("cuda")


def test_a_cpu_engine_loads_without_triton(tmp_path):
    """In a fresh process (torch._dynamo not yet loaded): inside `without_triton("cpu")` triton cannot be
    imported, after it it can again; a GPU device blocks nothing; and a CPU generate engine built from
    scratch never loads triton, although transformers' model code imports torch._dynamo."""
    import importlib.util
    import subprocess
    import sys

    from marlaas.base.tiny import init_model, save

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here: nothing to keep out")
    save(*init_model("test", seed=0), tmp_path / "base")
    script = r"""
import importlib.util, sys
from marlaas.devices import without_triton
with without_triton("cuda"):
    assert sys.modules.get("triton", 0) is not None
with without_triton("cpu"):
    try:
        import triton
        raise SystemExit("triton imported inside the block")
    except ImportError:
        pass
assert "triton" not in sys.modules and importlib.util.find_spec("triton") is not None
assert "torch._dynamo" not in sys.modules, "torch._dynamo loaded before the engine: the test proves nothing"
from marlaas.generate.hf import HFEngine
eng = HFEngine(sys.argv[1], lambda ref: None)
assert "torch._dynamo" in sys.modules
print("triton loaded:", "triton" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "base")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "triton loaded: False" in out.stdout


def test_release_heap_trims_on_the_cpu_only_and_looks_malloc_trim_up_once(monkeypatch):
    from marlaas import devices

    calls = []
    devices._malloc_trim.cache_clear()
    monkeypatch.setattr(devices.ctypes, "CDLL", lambda name: type("Libc", (), {"malloc_trim": calls.append})())
    devices.release_heap("cpu")
    devices.release_heap(torch.device("cpu"))
    devices.release_heap("cuda")  # nothing on another device
    assert calls == [0, 0] and devices._malloc_trim.cache_info().misses == 1
    devices._malloc_trim.cache_clear()
    monkeypatch.setattr(devices.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError("no libc")))
    devices.release_heap("cpu")  # without glibc: nothing, no error
    devices._malloc_trim.cache_clear()
