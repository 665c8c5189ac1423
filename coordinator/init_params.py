"""θ_0 for a config, computed in a child process (``python -m coordinator.init_params CONFIG OUT``).

The coordinator needs θ_0 as one flat float32 vector. Building it means
importing JAX and materializing the model's parameter tree several times
over; doing that in a short-lived child keeps the coordinator's own memory
(and its peak) at the size of the vectors it actually holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main(config_path: str, out_dir: str, spec_only: bool = False) -> None:
    import jax

    from dtrain import codec, model
    from dtrain.config import load_config

    cfg = load_config(config_path)
    built = model.build(cfg.model)
    out = Path(out_dir)
    if spec_only:  # a resuming coordinator takes θ from its checkpoint: shapes suffice, nothing is initialized
        spec, _ = codec.flatten(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), built.abstract_params))
    else:
        spec, vec = codec.flatten(jax.device_get(built.init(cfg.run.seed)))
        np.ascontiguousarray(vec, dtype="<f4").tofile(out / "theta0.f32")  # raw: the coordinator links it in
    (out / "spec.json").write_text(json.dumps(spec))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], spec_only="--spec-only" in sys.argv[3:])
