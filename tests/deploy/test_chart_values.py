"""The chart's scenarios render what they promise; bad values are refused with clear messages."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest

from services.common.config import load
from services.worker.config import WorkerConfig
from tests.deploy.support import (
    CHART,
    KUBE_VERSIONS,
    env_of,
    find,
    interface_env_names,
    load_values,
    one,
    pod_specs,
    render,
)

CI = CHART / "ci"
BAD_VALUES = Path(__file__).resolve().parent / "bad-values.yaml"
GPU = "nvidia.com/gpu"


def main_container(docs: list[dict], kind: str, component: str) -> dict:
    (container,) = one(docs, kind, component)["spec"]["template"]["spec"]["containers"]
    return container


def test_gpu_scenario_requests_gpus_for_4_encoders_and_8_workers() -> None:
    docs = render(load_values(CI / "gpu-4enc-8wkr-values.yaml"))
    worker_set = one(docs, "StatefulSet", "worker")
    assert worker_set["spec"]["replicas"] == 8
    assert one(docs, "HorizontalPodAutoscaler", "encoder")["spec"]["minReplicas"] == 4
    for kind, component in (("Deployment", "encoder"), ("StatefulSet", "worker")):
        container = main_container(docs, kind, component)
        assert container["resources"]["limits"][GPU] == 1
        assert container["resources"]["requests"][GPU] == 1
        env = env_of(container)
        assert env["EPD_DEVICE"] == "cuda" and env["EPD_DTYPE"] == "bfloat16"
        assert container["image"] == "registry.example.com/ml/epd:0.1.0-cuda"
    router = main_container(docs, "Deployment", "router")
    assert GPU not in router["resources"].get("limits", {})
    assert router["image"] == "registry.example.com/ml/epd:0.1.0-cpu"
    assert "EPD_WORKER_ADDRS" not in env_of(router)  # workers are found in the Redis registry
    assert env_of(router)["EPD_ENCODER_ADDRS"] == "demo-epd-encoder.ml.svc.cluster.local:50061"
    assert len(find(docs, "ServiceMonitor")) == 1
    volumes = {v["name"]: v for v in worker_set["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "qwen2-vl-7b-instruct", "readOnly": True}
    assert "initContainers" not in worker_set["spec"]["template"]["spec"]


def test_tensor_parallel_scenario_gives_each_worker_a_gpu_per_rank_and_a_sized_dev_shm() -> None:
    docs = render(load_values(CI / "gpu-tp4-values.yaml"))
    worker_set = one(docs, "StatefulSet", "worker")
    container = main_container(docs, "StatefulSet", "worker")
    assert container["resources"]["limits"][GPU] == container["resources"]["requests"][GPU] == 4
    env = env_of(container)
    assert env["EPD_TENSOR_PARALLEL_SIZE"] == "4" and env["EPD_DEVICE"] == "cuda"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # a timed-out collective fails, the worker exits
    assert load(WorkerConfig, env=env).tensor_parallel_size == 4
    volumes = {v["name"]: v for v in worker_set["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    encoder = main_container(docs, "Deployment", "encoder")
    assert encoder["resources"]["limits"][GPU] == 1 and "EPD_TENSOR_PARALLEL_SIZE" not in env_of(encoder)


def test_workers_without_tensor_parallelism_set_no_size() -> None:
    docs = render(load_values(CI / "gpu-4enc-8wkr-values.yaml"))
    assert "EPD_TENSOR_PARALLEL_SIZE" not in env_of(main_container(docs, "StatefulSet", "worker"))


def test_gpu_workers_size_kv_from_memory_utilisation_not_bytes() -> None:
    docs = render(load_values(CI / "gpu-4enc-8wkr-values.yaml"))
    env = env_of(main_container(docs, "StatefulSet", "worker"))
    assert env["EPD_GPU_MEMORY_UTILIZATION"] == "0.9"
    assert "EPD_KV_CACHE_BYTES" not in env and "EPD_BLOCK_SIZE" not in env  # automatic: 256-token flash blocks
    config = load(WorkerConfig, env=env)
    assert (config.device, config.kv_cache_bytes, config.gpu_memory_utilization) == ("cuda", 0, 0.9)
    assert "EPD_GPU_MEMORY_UTILIZATION" not in env_of(main_container(docs, "Deployment", "encoder"))
    # A byte budget set by the user still wins, as it does in the worker.
    values = load_values(CI / "gpu-4enc-8wkr-values.yaml")
    values["worker"]["env"]["EPD_KV_CACHE_BYTES"] = "42949672960"
    values["worker"]["gpuMemoryUtilization"] = 1
    env = env_of(main_container(render(values), "StatefulSet", "worker"))
    assert (env["EPD_KV_CACHE_BYTES"], env["EPD_GPU_MEMORY_UTILIZATION"]) == ("42949672960", "1")
    assert load(WorkerConfig, env=env).gpu_memory_utilization == 1.0


def test_cpu_workers_keep_a_byte_budget() -> None:
    env = env_of(main_container(render(load_values(CI / "cpu-dev-values.yaml")), "StatefulSet", "worker"))
    assert env["EPD_DEVICE"] == "cpu" and env["EPD_KV_CACHE_BYTES"] == "268435456"
    assert "EPD_GPU_MEMORY_UTILIZATION" not in env
    assert load(WorkerConfig, env=env).kv_cache_bytes == 268435456


@pytest.mark.parametrize("values_file", sorted(CI.glob("*-values.yaml")), ids=lambda p: p.name)
def test_only_containers_that_request_gpus_see_gpus(values_file: Path) -> None:
    # NVIDIA's runtime exposes every GPU of the node to a container whose NVIDIA_VISIBLE_DEVICES says
    # `all`, as CUDA images do: containers without a GPU request say `void`; those with one leave the
    # variable to the device plugin, which sets it to the GPUs it assigned.
    seen = {True: 0, False: 0}
    for component, spec in pod_specs(render(load_values(values_file))):
        for container in spec.get("initContainers", []) + spec["containers"]:
            gpu = GPU in container.get("resources", {}).get("requests", {})
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if gpu:
                assert "NVIDIA_VISIBLE_DEVICES" not in env, (component, container["name"])
            else:
                assert env.get("NVIDIA_VISIBLE_DEVICES") == "void", (component, container["name"])
            seen[gpu] += 1
    assert seen[False] >= 2  # the router and Redis at least


def test_default_scenario_shape() -> None:
    docs = render(None)
    assert {h["metadata"]["labels"]["app.kubernetes.io/component"] for h in find(docs, "HorizontalPodAutoscaler")} == {
        "router",
        "encoder",
    }
    assert len(find(docs, "PodDisruptionBudget")) == 3
    headless = one(docs, "Service", "worker")
    assert headless["spec"]["clusterIP"] == "None"
    worker_set = one(docs, "StatefulSet", "worker")
    assert worker_set["spec"]["serviceName"] == headless["metadata"]["name"]
    env = env_of(main_container(docs, "StatefulSet", "worker"))
    assert env["EPD_ADVERTISE_ADDR"] == "$(POD_NAME).demo-epd-worker.ml.svc.cluster.local:50071"
    assert env["EPD_HOST"] == "0.0.0.0" and env["EPD_REDIS_URL"] == "redis://demo-epd-redis:6379/0"
    (init,) = worker_set["spec"]["template"]["spec"]["initContainers"]
    assert init["args"] == ["make-tiny-model", "/models/tiny", "--family", "qwen2-vl"]
    redis = main_container(docs, "Deployment", "redis")
    assert redis["args"][-4:] == ["--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"]
    assert not find(docs, "ServiceMonitor")


def test_cpu_dev_scenario_has_no_gpus_and_no_autoscaling() -> None:
    docs = render(load_values(CI / "cpu-dev-values.yaml"))
    for _, spec in pod_specs(docs):
        for container in spec["containers"]:
            assert GPU not in str(container.get("resources", {}))
            if container["name"] != "redis":
                assert env_of(container)["EPD_DEVICE"] == "cpu"
    assert not find(docs, "HorizontalPodAutoscaler") and not find(docs, "PodDisruptionBudget")
    assert one(docs, "Deployment", "router")["spec"]["replicas"] == 1


def test_external_redis_replaces_the_bundled_one() -> None:
    docs = render(load_values(CI / "external-redis-values.yaml"))
    assert not find(docs, "Deployment", "redis") and not find(docs, "Service", "redis")
    url = "redis://redis-master.cache.svc.cluster.local:6379/0"
    for _, spec in pod_specs(docs):
        assert env_of(spec["containers"][0])["EPD_REDIS_URL"] == url
    egress = one(docs, "NetworkPolicy", "router")["spec"]["egress"]
    redis_rules = [r for r in egress if r["ports"] == [{"port": 6379, "protocol": "TCP"}]]
    assert redis_rules and redis_rules[0]["to"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "cache"
    }


def test_router_egress_is_limited() -> None:
    egress = one(render(None), "NetworkPolicy", "router")["spec"]["egress"]
    ports = sorted({p["port"] for rule in egress for p in rule["ports"]})
    assert ports == [53, 443, 6379, 50061, 50071]
    https = next(r for r in egress if r["ports"] == [{"port": 443, "protocol": "TCP"}])
    assert "10.0.0.0/8" in https["to"][0]["ipBlock"]["except"]


@pytest.mark.parametrize("values_file", sorted(CI.glob("*-values.yaml")), ids=lambda p: p.name)
def test_every_epd_pod_shares_one_redis_and_no_worker_list(values_file: Path) -> None:
    urls = set()
    components = set()
    for component, spec in pod_specs(render(load_values(values_file))):
        if component == "redis":
            continue
        components.add(component)
        env = env_of(spec["containers"][0])
        urls.add(env["EPD_REDIS_URL"])
        assert "EPD_WORKER_ADDRS" not in env, component
    assert components - {"prefill"} == {"router", "encoder", "worker"}  # a prefill pool where it is enabled
    assert len(urls) == 1, urls


@pytest.mark.parametrize("values_file", sorted(CI.glob("*-values.yaml")), ids=lambda p: p.name)
def test_epd_env_names_are_the_agreed_ones(values_file: Path) -> None:
    agreed = interface_env_names()
    assert "EPD_WORKER_ADDRS" not in agreed
    for component, spec in pod_specs(render(load_values(values_file))):
        if component == "redis":
            continue
        names = {n for n in env_of(spec["containers"][0]) if n.startswith("EPD_")}
        assert names <= agreed, sorted(names - agreed)


def test_bad_values_are_rejected_by_the_schema() -> None:
    values = load_values(BAD_VALUES)
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    message = str(caught.value)
    assert "at '/router': additional properties 'replica' not allowed" in message
    assert "at '/worker/replicas': minimum: got -2, want 0" in message
    assert "at '/encoder/gpus': got string, want integer" in message
    assert "at '/worker/env/EPD_KV_CACHE_BYTES': got number, want string" in message
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="schema"):
        chart.render(values, name="demo", namespace="ml")
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSIONS[0]}")
    assert any("additional properties 'replica' not allowed" in e for e in report["errors"])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "at '/worker/gpuMemoryUtilization': exclusiveMinimum: got 0, want 0"),
        (-0.5, "at '/worker/gpuMemoryUtilization': exclusiveMinimum: got -0.5, want 0"),
        (1.5, "at '/worker/gpuMemoryUtilization': maximum: got 1.5, want 1"),
        ("0.9", "at '/worker/gpuMemoryUtilization': got string, want number"),  # what `--set` passes
    ],
)
def test_gpu_memory_utilization_outside_0_1_is_refused(value: object, message: str) -> None:
    values = {"worker": {"gpuMemoryUtilization": value}}
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    assert message in str(caught.value)
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="gpuMemoryUtilization"):
        chart.render(values, name="demo", namespace="ml")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"tiny": {"enabled": False}}}, "set model.pvc.claimName"),
        ({"model": {"pvc": {"claimName": "m"}}}, "not both"),
        ({"redis": {"enabled": False}}, "redis.external.url"),
        ({"worker": {"env": {"EPD_REDIS_URL": "redis://other:6379/0"}}}, "same for every epd pod"),
        ({"env": {"EPD_REDIS_URL": "redis://other:6379/0"}}, "set redis.external.url instead"),
        ({"router": {"autoscaling": {"minReplicas": 9}}}, "minReplicas must not exceed maxReplicas"),
        ({"worker": {"drainTimeoutSeconds": 60}}, "worker: terminationGracePeriodSeconds .60. must exceed"),
        ({"worker": {"gpus": 2, "tensorParallelSize": 4}}, r"worker.gpus \(2\) must equal worker.tensorParallelSize"),
        ({"worker": {"gpus": 2, "tensorParallelSize": 2, "shmSizeLimit": None}}, "worker.shmSizeLimit must be set"),
    ],
)
def test_inconsistent_values_fail_with_a_message(values: dict, message: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError, match=message):
        chart.render(values, name="demo", namespace="ml")


@pytest.mark.parametrize("values_file", sorted(CI.glob("*-values.yaml")), ids=lambda p: p.name)
def test_grace_period_covers_the_prestop_sleep_and_the_drain(values_file: Path) -> None:
    """Every epd pod sleeps in preStop (endpoints drop it), then drains for EPD_DRAIN_TIMEOUT_S on
    SIGTERM; the grace period is longer than both, so Kubernetes never kills a drain short."""
    for component, spec in pod_specs(render(load_values(values_file))):
        if component == "redis":
            continue
        container = spec["containers"][0]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", command
        drain = float(env_of(container)["EPD_DRAIN_TIMEOUT_S"])
        assert spec["terminationGracePeriodSeconds"] > drain + float(command[1]) > drain > 0, component
