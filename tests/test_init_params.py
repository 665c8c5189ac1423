"""θ_0 for the coordinator, computed in a child process (coordinator/init_params.py) as the service does it."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

import conftest
from coordinator.lifecycle import initial_parameters_file
from dtrain import codec
from dtrain.config.sections import Config
from dtrain.models import model


def test_theta0_from_the_child_process_is_the_models_init(tmp_path: Path, tiny_cfg: Config) -> None:
    path, spec = initial_parameters_file(tiny_cfg, tmp_path / "full")
    assert path == tmp_path / "full" / "theta0.f32"
    theta = np.fromfile(path, "<f4")
    want_spec, want = codec.flatten(jax.device_get(model.build(tiny_cfg.model).init(tiny_cfg.run.seed)))
    assert spec == want_spec and theta.shape == (codec.spec_size(spec),)
    assert np.array_equal(theta, want)
    # A resuming coordinator asks for the spec only: the same spec, from shapes, and no θ_0 is written.
    no_theta, spec_only = initial_parameters_file(tiny_cfg, tmp_path / "spec", spec_only=True)
    assert no_theta is None and spec_only == spec and not (tmp_path / "spec" / "theta0.f32").exists()
    # The session's shared θ_0 (conftest.py, what the service tests start from) is this one, a copy per caller.
    shared, shared_spec = conftest.initial_parameters(tiny_cfg)
    assert np.array_equal(shared, theta) and shared_spec == spec == conftest.initial_spec(tiny_cfg)
    shared[:] = 0.0
    shared_spec.clear()
    again, again_spec = conftest.initial_parameters(tiny_cfg)
    assert np.array_equal(again, theta) and again_spec == spec
