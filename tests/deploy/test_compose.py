"""docker-compose.yml: valid Compose (compose-spec parser) with the promised services and wiring."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from compose_spec import PyCompose

from services.common.config import load
from services.worker.config import WorkerConfig
from tests.deploy.support import COMPOSE_FILE, interface_env_names, interpolate, load_compose

EPD_SERVICES = {
    "router": 50051,
    "encoder": 50061,
    "worker": 50071,
    "encoder-gpu": 50061,
    "worker-gpu": 50071,
    "prefill": 50071,
}
PROFILES = {"encoder-gpu": ["gpu"], "worker-gpu": ["gpu"], "prefill": ["pd"]}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.mark.parametrize("env", [{}, {"EPD_MODELS": "/srv/models", "EPD_MODEL": "/models/qwen2-vl-2b"}])
def test_compose_spec_accepts_the_file(env: dict[str, str]) -> None:
    resolved = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env)
    parsed = PyCompose.from_json(json.dumps(resolved))
    parsed.validate()
    assert set(parsed.service_names()) == {"redis", "model-init", *EPD_SERVICES}


def test_compose_spec_is_strict() -> None:
    resolved = load_compose()
    resolved["services"]["router"]["helthcheck"] = resolved["services"]["router"].pop("healthcheck")
    with pytest.raises(ValueError, match="helthcheck"):
        PyCompose.from_json(json.dumps(resolved))


def test_no_top_level_name(compose: dict[str, Any]) -> None:
    assert "name" not in compose
    assert "version" not in compose


def test_redis_is_a_capped_lru_cache_without_persistence(compose: dict[str, Any]) -> None:
    redis = services(compose)["redis"]
    command = " ".join(redis["command"])
    assert "--save  --appendonly no" in command
    assert "--maxmemory 1gb --maxmemory-policy allkeys-lru" in command
    assert "volumes" not in redis
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_model_init_builds_the_tiny_model_only_when_missing(compose: dict[str, Any]) -> None:
    init = services(compose)["model-init"]
    script = init["command"][0]
    assert 'if [ -f "$EPD_MODEL/config.json" ]' in script
    assert "epd make-tiny-model /models/tiny --family qwen2-vl" in script
    assert init["restart"] == "no"
    assert init["volumes"] == ["epd-models:/models"]
    assert "epd-models" in compose["volumes"]


@pytest.mark.parametrize(("name", "port"), sorted(EPD_SERVICES.items()))
def test_epd_services(compose: dict[str, Any], name: str, port: int) -> None:
    service = services(compose)[name]
    role = "worker" if name == "prefill" else name.removesuffix("-gpu")
    assert service["command"] == ["serve", role]
    env = service["environment"]
    assert set(n for n in env if n.startswith("EPD_")) <= interface_env_names()
    assert env["EPD_HOST"] == "0.0.0.0" and env["EPD_PORT"] == str(port)
    assert env["EPD_ADVERTISE_ADDR"] == f"{name}:{port}"
    assert env["EPD_REDIS_URL"] == "redis://redis:6379/0"
    assert env["EPD_MODEL"] == "/models/tiny"
    assert service["healthcheck"]["test"] == ["CMD", "epd", "health", f"127.0.0.1:{port}"]
    assert service["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "model-init": {"condition": "service_completed_successfully"},
    }
    assert service["read_only"] is True and service["tmpfs"] == ["/tmp"]
    assert service["volumes"] == ["epd-models:/models:ro"]


def test_router_finds_workers_in_the_registry_and_reaches_services_by_name(compose: dict[str, Any]) -> None:
    all_services = services(compose)
    env = all_services["router"]["environment"]
    assert env["EPD_ENCODER_ADDRS"] == "encoder:50061"  # fallback while no encoder is registered
    for name, service in all_services.items():
        assert "EPD_WORKER_ADDRS" not in service.get("environment", {}), name
    for host in ("encoder", "worker"):
        assert host in all_services
        assert host in all_services[f"{host}-gpu"]["networks"]["default"]["aliases"]
    published = {p.split(":", 1)[1] for p in all_services["router"]["ports"]}
    assert published == {"50051:50051", "8000:8000", "9400:9400"}


def test_every_epd_service_shares_one_redis(compose: dict[str, Any]) -> None:
    urls = {
        name: service["environment"]["EPD_REDIS_URL"]
        for name, service in services(compose).items()
        if name in EPD_SERVICES
    }
    assert set(urls) == set(EPD_SERVICES)
    assert set(urls.values()) == {"redis://redis:6379/0"}
    assert "redis" in services(compose)


def test_gpu_profile_reserves_nvidia_devices(compose: dict[str, Any]) -> None:
    for name, service in services(compose).items():
        gpu = name.endswith("-gpu")
        assert service.get("profiles") == PROFILES.get(name), name
        if not gpu:
            assert "deploy" not in service, name
            continue
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
        assert service["environment"]["EPD_DEVICE"] == "cuda"
        assert service["build"]["args"]["VARIANT"] == "cuda"


def test_only_the_gpu_services_get_gpus(compose: dict[str, Any]) -> None:
    # The CUDA image sets NVIDIA_VISIBLE_DEVICES=void: a container sees GPUs only through its device
    # request, which sets the variable to the devices Docker assigns; nothing here may override that.
    for name, service in services(compose).items():
        assert "runtime" not in service and "gpus" not in service, name
        assert "NVIDIA_VISIBLE_DEVICES" not in service.get("environment", {}), name
        if name in EPD_SERVICES and not name.endswith("-gpu"):
            assert service["build"]["args"]["VARIANT"] == "cpu", name
            assert service["environment"]["EPD_DEVICE"] == "cpu", name


def test_gpu_worker_sizes_its_kv_cache_from_gpu_memory(compose: dict[str, Any]) -> None:
    gpu = services(compose)["worker-gpu"]["environment"]
    assert gpu["EPD_KV_CACHE_BYTES"] == "0"  # 0: automatic, from the utilisation
    config = load(WorkerConfig, env=gpu)
    assert (config.kv_cache_bytes, config.block_size) == (0, 0)
    # `count: 1` gives encoder-gpu and worker-gpu the same GPU (device 0): the worker leaves the encoder
    # room instead of taking the worker's default share.
    devices = [
        services(compose)[name]["deploy"]["resources"]["reservations"]["devices"]
        for name in ("encoder-gpu", "worker-gpu")
    ]
    assert devices[0] == devices[1] == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert config.gpu_memory_utilization == 0.6 < WorkerConfig.gpu_memory_utilization
    assert services(compose)["worker"]["environment"]["EPD_KV_CACHE_BYTES"] == "268435456"  # CPU: bytes
    assert "EPD_GPU_MEMORY_UTILIZATION" not in services(compose)["worker"]["environment"]
    tuned = load_compose({"EPD_GPU_MEMORY_UTILIZATION": "0.8", "EPD_GPU_KV_CACHE_BYTES": "42949672960"})
    env = tuned["services"]["worker-gpu"]["environment"]
    assert (env["EPD_GPU_MEMORY_UTILIZATION"], env["EPD_KV_CACHE_BYTES"]) == ("0.8", "42949672960")


def test_a_mounted_model_replaces_the_tiny_one() -> None:
    compose = load_compose({"EPD_MODELS": "/srv/models", "EPD_MODEL": "/models/qwen2-vl-2b"})
    worker = compose["services"]["worker"]
    assert worker["environment"]["EPD_MODEL"] == "/models/qwen2-vl-2b"
    assert worker["volumes"] == ["/srv/models:/models:ro"]


def test_pd_profile_adds_a_prefill_worker_and_the_variables_turn_the_split_on(compose: dict[str, Any]) -> None:
    prefill = services(compose)["prefill"]["environment"]
    assert prefill["EPD_WORKER_ROLE"] == "prefill" and load(WorkerConfig, env=prefill).worker_role == "prefill"
    assert services(compose)["worker"]["environment"]["EPD_WORKER_ROLE"] == "both"
    assert services(compose)["router"]["environment"]["EPD_PD_MIN_PREFILL_TOKENS"] == "0"  # off unless asked
    split = load_compose({"EPD_WORKER_ROLE": "decode", "EPD_PD_MIN_PREFILL_TOKENS": "128"})["services"]
    assert load(WorkerConfig, env=split["worker"]["environment"]).worker_role == "decode"
    assert split["router"]["environment"]["EPD_PD_MIN_PREFILL_TOKENS"] == "128"
