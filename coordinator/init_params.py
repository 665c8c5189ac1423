"""θ_0 for a config, computed in a child process (``python -m coordinator.init_params CONFIG OUT``).

The coordinator needs θ_0 as one flat float32 vector. Building it means
importing JAX and materializing the model's parameter tree several times
over; doing that in a short-lived child keeps the coordinator's own memory
(and its peak) at the size of the vectors it actually holds. With
``model.init_from`` θ_0 is a Hugging Face folder's tensors instead (``dtrain.models.hf``), written leaf by leaf into
the file, every name and shape checked first: a folder that does not fit is one line on stderr and exit status
:data:`UNFIT` (the coordinator raises it as its error, no traceback).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

UNFIT = 3  # the exit status of a model.init_from folder that does not fit the config


def main(config_path: str, out_dir: str, spec_only: bool = False) -> None:
    import jax

    from dtrain import codec
    from dtrain.config.load import load_config
    from dtrain.models import hf, model

    cfg = load_config(config_path)
    built = model.build(cfg.model)
    out = Path(out_dir)
    if spec_only or cfg.model.init_from:  # a resuming coordinator takes θ from its checkpoint: shapes suffice
        spec = hf.spec_of(built.abstract_params)
        if not spec_only:
            theta0 = np.memmap(out / "theta0.f32", "<f4", mode="w+", shape=(codec.spec_size(spec),))
            try:
                hf.read_theta0(cfg.model, spec, cfg.model.init_from, theta0)  # checks config.json, names, shapes
            except hf.HFError as e:
                print(f"model.init_from: {e}", file=sys.stderr)
                sys.exit(UNFIT)
            theta0.flush()
    else:
        spec, vec = codec.flatten(jax.device_get(built.init(cfg.run.seed)))
        np.ascontiguousarray(vec, dtype="<f4").tofile(out / "theta0.f32")  # raw: the coordinator links it in
    (out / "spec.json").write_text(json.dumps(spec))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], spec_only="--spec-only" in sys.argv[3:])
