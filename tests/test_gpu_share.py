"""Several islands on one GPU (dtrain_cli/gpu_share.py): each worker process's share of the GPU's memory, set by
``dtrain simulate`` only where its workers run on a GPU and the user set none."""

from __future__ import annotations

import pytest

from dtrain_cli.gpu_share import GPU_MEMORY_USED, MEM_FRACTION_ENV, memory_share_env, workers_platform


def _platform(env: dict[str, str], cuda: bool = True, device: bool = True) -> str:
    return workers_platform(env, cuda_installed=lambda: cuda, nvidia_device=lambda: device)


def test_the_workers_platform_is_a_gpu_only_with_cuda_jax_a_device_and_no_other_platform_asked_for() -> None:
    assert _platform({}) == "gpu"
    assert _platform({"JAX_PLATFORMS": "cuda"}) == _platform({"JAX_PLATFORMS": "gpu,cpu"}) == "gpu"
    assert _platform({"JAX_PLATFORMS": "cpu"}) == "other"
    assert _platform({}, cuda=False) == _platform({}, device=False) == "other"
    assert workers_platform({"JAX_PLATFORMS": "cpu"}) == "other"  # this host, as the tests run it


@pytest.mark.parametrize("processes, share", [(2, "0.450"), (3, "0.300"), (4, "0.225"), (7, "0.128")])
def test_each_worker_process_gets_an_equal_share_on_a_gpu(processes: int, share: str) -> None:
    env = memory_share_env({"PATH": "/bin"}, processes, "gpu")
    assert env == {"PATH": "/bin", MEM_FRACTION_ENV: share}
    assert processes * float(share) <= GPU_MEMORY_USED


def test_no_share_on_a_cpu_for_one_process_or_where_the_user_set_one() -> None:
    assert MEM_FRACTION_ENV not in memory_share_env({}, 4, "other")
    assert MEM_FRACTION_ENV not in memory_share_env({}, 1, "gpu")
    assert memory_share_env({MEM_FRACTION_ENV: "0.3"}, 4, "gpu")[MEM_FRACTION_ENV] == "0.3"


def test_simulate_gives_its_workers_the_share(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtrain.config.load import load_config
    from dtrain_cli import simulate

    monkeypatch.setattr(simulate, "workers_platform", lambda env: "gpu")
    monkeypatch.delenv(MEM_FRACTION_ENV, raising=False)
    _, env = simulate._checked_run(load_config("tiny"), 3, {}, [], 1)
    assert env[MEM_FRACTION_ENV] == "0.300"
    monkeypatch.setattr(simulate, "workers_platform", lambda env: "other")
    _, env = simulate._checked_run(load_config("tiny"), 3, {}, [], 1)
    assert MEM_FRACTION_ENV not in env
