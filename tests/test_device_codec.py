"""The push's quantization on the device (dtrain/train/device_codec.py): its frames byte for byte the host codec's
(dtrain/codec) for the same Δ and error-feedback state, round after round, int8 and int4; its residual bit for bit
the host's; the edge cases of the scale's rounding; one program for every Δ length."""

from __future__ import annotations

import numpy as np
import pytest

from dtrain import codec
from dtrain.codec import CodecError
from dtrain.train import device_codec
from dtrain.train.device_codec import DeviceErrorFeedback


def _deltas(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Rounds of Δ: ordinary values, a block of zeros, huge and tiny blocks (the scale's edges), a lone spike."""
    out = []
    for r in range(3):
        d = (rng.standard_normal(n) * 10.0 ** rng.uniform(-7, 1)).astype(np.float32)
        d[:256] = 0.0  # an all-zero block: scale 0
        d[256:512] *= np.float32(1e30)  # near float32's top: the scale's cap and the rescaled test
        d[512:768] = rng.standard_normal(256).astype(np.float32) * np.float32(1e-30)  # tiny scales, normal floats
        d[1000 + r] = np.float32(3.0e38 if r == 1 else -7.0)
        out.append(d)
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, block, decay", [(10_001, 256, 1.0), (4096, 1024, 0.9), (1023, 64, 1.0)])
def test_frames_and_residuals_are_the_host_codecs_byte_for_byte(bits: int, n: int, block: int, decay: float,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_codec, "PIECE", 4096)  # several pieces, the last one partial
    rng = np.random.default_rng(bits * n)
    host = codec.ErrorFeedback(n, bits, block, decay)
    dev = DeviceErrorFeedback(n, bits, block, decay)
    assert dev.pieces == -(-n // 4096)
    for delta in _deltas(rng, n):
        want, got = host.compress(delta), dev.compress(delta)
        np.testing.assert_array_equal(got.scales.view(np.uint32), want.scales.view(np.uint32))
        np.testing.assert_array_equal(got.payload, want.payload)
        assert codec.encode(got, 3) == codec.encode(want, 3)
        np.testing.assert_array_equal(dev.residual_host().view(np.uint32), host.residual.view(np.uint32))
    # whatever the scale: every value's rounding goes the host's way (a scale rounded the other way would show)
    assert np.count_nonzero(host.residual) > n // 2


def test_the_scale_is_rounded_up_exactly_as_the_host_rounds_it() -> None:
    """Over float32's normal range (XLA flushes subnormals to zero: scales below 1.2e-38, blocks whose largest
    value is below ~1e-36, are where the two may differ; training's Δ is far above that), and at its top."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    absmax = np.concatenate([
        rng.uniform(0.1, 1, 20_000).astype(np.float32) * np.float32(10.0) ** rng.integers(-33, 38, 20_000),
        np.array([1, 7, 127, 254, 3.0e38, np.finfo(np.float32).max, 1e-35, 0], np.float32)])
    absmax = np.abs(absmax).astype(np.float32)
    for qmax in (127, 7):
        host = codec.quant._int_scales(absmax, qmax)
        scales = jax.jit(lambda a, q, qmax=qmax: device_codec._int_scales(a, qmax, q))
        dev = np.asarray(scales(jnp.asarray(absmax), np.float32(qmax)))
        np.testing.assert_array_equal(dev.view(np.uint32), host.view(np.uint32))


def test_what_the_device_codec_refuses() -> None:
    with pytest.raises(CodecError, match="int8 and int4"):
        DeviceErrorFeedback(100, "e3m0")
    dev = DeviceErrorFeedback(300, 8, 64)
    with pytest.raises(CodecError, match="shape"):
        dev.compress(np.zeros(299, np.float32))
    bad = np.ones(300, np.float32)
    bad[7] = np.nan
    with pytest.raises(CodecError, match="index 7"):
        dev.compress(bad)
    np.testing.assert_array_equal(dev.residual_host(), np.zeros(300, np.float32))  # unchanged


def test_one_program_serves_every_length(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_codec, "PIECE", 2048)
    device_codec._quantize_piece.clear_cache()
    for n in (100, 2048, 5000):
        DeviceErrorFeedback(n, 8, 256).compress(np.ones(n, np.float32))
    assert device_codec._quantize_piece._cache_size() == 1
