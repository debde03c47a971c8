"""The extension seams of docs/architecture.md: a ring layout and a wire codec registered
from outside the package work through LongContextAttention on real gloo ranks."""
import pytest

from tests import dist_seams

pytestmark = pytest.mark.multirank


def _ok(res, skip=()):
    for errs in res:
        bad = {k: v for k, v in errs.items() if k not in skip and not v <= 1.0}
        assert not bad, f"{bad} (all {errs})"


@pytest.mark.parametrize("U,R,rotation", [(1, 2, "p2p"), (1, 2, "allgather"), (2, 2, "p2p"), (1, 4, "p2p")])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_registered_layout_forward_and_gradients(pools, U, R, rotation, causal):
    _ok(pools(U * R).run(dist_seams.layout_case, timeout=90, U=U, R=R, rotation=rotation, causal=causal))


def test_registered_layout_with_window(pools):
    _ok(pools(2).run(dist_seams.layout_case, timeout=60, U=1, R=2, window=(3, 0)))


@pytest.mark.parametrize("U,R", [(2, 1), (2, 2)])
def test_registered_codec_applies_exactly_where_configured(pools, U, R):
    res = pools(U * R).run(dist_seams.codec_case, timeout=90, U=U, R=R)
    _ok(res, skip=("differs",))
    assert max(r["differs"] for r in res) > 1e-4, res     # it is not silently the identity


def test_wire_codecs_are_validated_at_construction():
    import usp_hal
    with pytest.raises(ValueError, match="wire_codecs key 'x'"):
        usp_hal.LongContextAttention(wire_codecs={"x": "fp8"})
    with pytest.raises(ValueError, match="unknown wire codec 'nope'"):
        usp_hal.LongContextAttention(wire_codecs={"q": "nope"})
    from usp_hal.parallel.codec import register_codec
    with pytest.raises(TypeError):
        register_codec(object)
    a = usp_hal.LongContextAttention(wire_codecs={"ring_v": "fp8"})
    assert a.ring_wire == ("identity", "fp8") and "ring_v=fp8" in a._wire_name
