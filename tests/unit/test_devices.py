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
