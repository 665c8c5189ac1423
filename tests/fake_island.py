"""An island on the 8 fake CPU devices, for the chip tests (test_chip_probes.py, test_chip_step.py,
test_chip_health.py), which take it through conftest's module-scoped ``island`` fixture.

configs/tiny.toml's model and mesh, its initial parameters (seed 0), a deterministic text to draw batches from,
fixed batches, and the inner loops and probes per injected fault, each built (and compiled) once per module.
"""

from __future__ import annotations

import numpy as np

from conftest import TINY, make_text
from dtrain.config.load import load_config
from dtrain.health.faults import DeviceFault
from dtrain.health.probes import Probes
from dtrain.models.model import build
from dtrain.steps.inner import make_mesh
from dtrain.train.loop import InnerLoop

K = 4  # inner steps per chunk of the fixed batches
CHUNKS = 3  # chunks of the fixed batches


class Island:
    """configs/tiny.toml on the 8 fake devices: ``cfg``, ``model``, ``mesh``, ``ids`` (the devices' JAX ids in
    ``mesh.devices.flat`` order), ``params`` (θ_0 placed on the mesh), ``B`` and ``L1`` (the global batch's rows
    and length), ``text`` (tokens to draw batches from) and ``batches`` (``[CHUNKS, K, B, L1]``, drawn with
    seed 0)."""

    def __init__(self) -> None:
        self.cfg = load_config(TINY, [])
        self.model = build(self.cfg.model)
        self.mesh = make_mesh(self.cfg)
        self.ids = [int(d.id) for d in self.mesh.devices.flat]
        self._loops: dict[tuple[bool, DeviceFault | None], InnerLoop] = {}
        self._probes: dict[DeviceFault | None, Probes] = {}
        self.params = self.loop().init_params(0)
        self.B, self.L1 = self.cfg.train.batch_size, self.cfg.model.seq_len + 1
        self.text = np.frombuffer(make_text(60_000), np.uint8).astype(np.int32)
        starts = np.random.default_rng(0).integers(0, len(self.text) - self.L1, (CHUNKS, K, self.B))
        self.batches = self.text[starts[..., None] + np.arange(self.L1)]

    def batch(self, rng: np.random.Generator, steps: int | None = None) -> np.ndarray:
        """A random global batch ``[B, L1]`` of the text (``[steps, B, L1]`` with ``steps``)."""
        shape = (self.B,) if steps is None else (steps, self.B)
        starts = rng.integers(0, len(self.text) - self.L1, shape)
        return self.text[starts[..., None] + np.arange(self.L1)]

    def loop(self, per_device: bool = False, fault: DeviceFault | None = None) -> InnerLoop:
        """The island's inner loop (the fused step, or the per-device one with ``fault`` injected), built once."""
        if (per_device, fault) not in self._loops:
            self._loops[per_device, fault] = InnerLoop(self.cfg, self.model, self.mesh, per_device=per_device,
                                                       fault=fault)
        return self._loops[per_device, fault]

    def probes(self, fault: DeviceFault | None = None) -> Probes:
        """The chip-health probes on the island's mesh with ``fault`` injected, built once."""
        if fault not in self._probes:
            self._probes[fault] = Probes(self.model.apply, self.mesh, fault)
        return self._probes[fault]
