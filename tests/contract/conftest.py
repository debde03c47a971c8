"""Contract tests run the adapters on CPU tensors inside ``usp_hal.platform.emulate``: a
module sets ``EMULATE = dict(device_type=..., compute_capability=..., ...)`` and every test
in it sees that device (a test can open another emulation inside)."""
import pytest

from usp_hal import platform


@pytest.fixture(autouse=True)
def _emulated_device(request):
    spec = getattr(request.module, "EMULATE", None)
    if spec is None:
        yield None
        return
    with platform.emulate(**spec) as em:
        yield em
