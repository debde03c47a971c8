"""Contract tests run the adapters on CPU tensors inside ``usp_hal.dispatch.platform.emulate``: a
module sets ``EMULATE = dict(device_type=..., compute_capability=..., ...)`` and every test
in it sees that device (a test can open another emulation inside)."""
import pytest
import torch

from usp_hal.dispatch import platform


@pytest.fixture(autouse=True)
def _emulated_device(request):
    spec = getattr(request.module, "EMULATE", None)
    if spec is None:
        yield None
        return
    with platform.emulate(**spec) as em:
        yield em


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: one intra-op thread avoids thread hand-off costs on busy CI hosts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
