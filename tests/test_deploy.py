"""deploy/kubernetes: rendered by kustomize, valid for Kubernetes, and consistent with kvtier.

`kubectl kustomize` renders the base and each overlay (offline); every object validates
against the Kubernetes JSON schemas kubernetes-validate bundles (strict: an unknown field
fails). The rest checks what a schema cannot: the ConfigMap's TOML is a valid kvtier
configuration whose socket and NVMe paths are the host directories the pod mounts, the
memory limit holds the arena, the probes' command reports a real daemon's gRPC health, the
pod is hardened, and the image's Dockerfile agrees with the pod's user and command.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvtier.config import Config, load_config
from tests.conftest import DaemonProcess

ROOT = Path(__file__).resolve().parents[1]
# Not "gpu": a test id with that keyword is skipped without CUDA (tests/conftest.py).
KUSTOMIZE_DIRS = {
    "base": ROOT / "deploy" / "kubernetes" / "base",
    "overlay-gpu": ROOT / "deploy" / "kubernetes" / "overlays" / "gpu",
}
# The oldest release still in common use and the newest the validator knows.
K8S_VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]
HEADROOM_BYTES = 1 << 30  # the process beside its arena in the container's memory limit
Objects = list[dict[str, Any]]


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("KVTIER_REQUIRE_KUBECTL") == "1":
            pytest.fail("kubectl is missing: it renders deploy/kubernetes (kubectl kustomize)")
        pytest.skip("kubectl not installed: deploy/kubernetes is not rendered")
    return kubectl


@functools.cache
def _render(name: str) -> tuple[str, ...]:
    out = subprocess.run(
        [_kubectl(), "kustomize", str(KUSTOMIZE_DIRS[name])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return tuple(json.dumps(doc) for doc in yaml.safe_load_all(out.stdout) if doc)


@pytest.fixture(params=list(KUSTOMIZE_DIRS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, Objects]:
    # A fresh copy per test (they are dicts); kustomize runs once per directory.
    name: str = request.param
    return name, [json.loads(doc) for doc in _render(name)]


def _one(objects: Objects, kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def _pod(objects: Objects) -> dict[str, Any]:
    spec: dict[str, Any] = _one(objects, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def _container(objects: Objects, name: str = "kvtier") -> dict[str, Any]:
    pod = _pod(objects)
    (found,) = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name]
    return found


def _mounts(objects: Objects, container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Mount path -> the volume mounted there."""
    volumes = {v["name"]: v for v in _pod(objects)["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def _quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in bytes (the binary suffixes these manifests use)."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", quantity)
    assert match, f"unexpected memory quantity {quantity!r}"
    power = ["", "Ki", "Mi", "Gi", "Ti"].index(match.group(2) or "")
    return int(match.group(1)) << (10 * power)


def _config(objects: Objects, tmp_path: Path) -> Config:
    """The daemon's configuration as the pod's command line and environment load it."""
    container = _container(objects)
    command = container["command"]
    config_path = Path(command[command.index("--config") + 1])
    config_volume = _mounts(objects, container)[str(config_path.parent)]
    config_maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    data = config_maps[config_volume["configMap"]["name"]]["data"]
    local = tmp_path / config_path.name
    local.write_text(data[config_path.name])
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    return load_config(local, environ=env)


def test_manifests_validate_against_the_kubernetes_schemas(rendered: tuple[str, Objects]) -> None:
    _, objects = rendered
    assert {o["kind"] for o in objects} >= {"DaemonSet", "ConfigMap", "Service", "Namespace"}
    for version in K8S_VERSIONS:
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {err}")


def test_every_object_lands_in_the_kvtier_namespace(rendered: tuple[str, Objects]) -> None:
    _, objects = rendered
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "kvtier", obj["metadata"]


def test_config_map_is_a_valid_config_on_the_mounted_host_directories(
    rendered: tuple[str, Objects], tmp_path: Path
) -> None:
    name, objects = rendered
    cfg = _config(objects, tmp_path)
    container = _container(objects)
    mounts = _mounts(objects, container)
    socket = Path(cfg.server.listen.removeprefix("unix://"))
    assert cfg.server.listen.startswith("unix:///"), "engines on the node need the socket"
    assert "hostPath" in mounts[str(socket.parent)], "the socket directory is the node's"
    assert "hostPath" in mounts[cfg.nvme.path], "the NVMe tier lives on the node's drive"
    assert cfg.nvme.enabled
    # The CLI in the probes finds the same socket.
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["KVTIER_TARGET"] == cfg.server.listen
    # The init container owns exactly the directories the daemon writes.
    init = _container(objects, "own-dirs")
    assert set(_mounts(objects, init)) == {str(socket.parent), cfg.nvme.path}
    for path in (str(socket.parent), cfg.nvme.path):
        assert path in init["command"][-1]
    port = int(cfg.server.metrics_listen.rpartition(":")[2])
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
    if name == "overlay-gpu":
        assert cfg.gpu.device == 0


def test_memory_limit_holds_the_arena_and_shutdown_fits_the_grace_period(
    rendered: tuple[str, Objects], tmp_path: Path
) -> None:
    _, objects = rendered
    cfg = _config(objects, tmp_path)
    resources = _container(objects)["resources"]
    limit = _quantity_bytes(resources["limits"]["memory"])
    # The arena is shared memory charged to the container: below it the OOM killer wins.
    assert limit >= cfg.dram.capacity_bytes + HEADROOM_BYTES
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "cpu" in resources["limits"]
    # Drain (half of stop_timeout_s) + flush (the other half) before SIGKILL, with margin.
    grace_s = _pod(objects)["terminationGracePeriodSeconds"]
    assert grace_s >= cfg.server.stop_timeout_s + 10


def test_pod_is_hardened(rendered: tuple[str, Objects]) -> None:
    _, objects = rendered
    pod = _pod(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    daemon = _container(objects)["securityContext"]
    assert daemon["runAsNonRoot"] is True
    assert daemon["readOnlyRootFilesystem"] is True
    assert daemon["allowPrivilegeEscalation"] is False
    assert daemon.get("privileged") is not True
    assert daemon["capabilities"] == {"drop": ["ALL"]}
    assert daemon["seccompProfile"] == {"type": "RuntimeDefault"}
    # The one root step: chown/chmod of two directories, with those two capabilities only.
    init = _container(objects, "own-dirs")["securityContext"]
    assert init["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert init["allowPrivilegeEscalation"] is False and init["readOnlyRootFilesystem"] is True
    service = _one(objects, "Service")
    labels = _one(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert _one(objects, "ServiceAccount")["automountServiceAccountToken"] is False


StartDaemon = Callable[..., DaemonProcess]


def _probe_commands(objects: Objects) -> list[list[str]]:
    container = _container(objects)
    probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    return [p["exec"]["command"] for p in probes]


def _run_probe(command: list[str], target: str) -> subprocess.CompletedProcess[str]:
    assert command[0] == "kvtier"
    env = dict(os.environ, KVTIER_TARGET=target)
    return subprocess.run(
        [sys.executable, "-m", "kvtier", *command[1:]],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )


def test_probes_report_a_real_daemons_grpc_health(start_daemon: StartDaemon, workdir: Path) -> None:
    objects = [json.loads(doc) for doc in _render("base")]
    for overlay in set(KUSTOMIZE_DIRS) - {"base"}:
        assert _probe_commands([json.loads(d) for d in _render(overlay)]) == _probe_commands(
            objects
        )
    # The ConfigMap's file as the pod reads it, with this test's socket, disk and sizes.
    container = _container(objects)
    config_file = workdir / "kvtier.toml"
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap"]
    config_file.write_text(cm["data"]["kvtier.toml"])
    daemon = start_daemon(dram="32MiB", nvme="64MiB", extra=["--config", str(config_file)])
    daemon_args = container["command"][1:]
    assert daemon_args[:2] == ["serve", "--config"]
    commands = _probe_commands(objects)
    for command in commands:
        done = _run_probe(command, daemon.target)
        assert (done.returncode, done.stdout.strip()) == (0, "SERVING"), done.stderr
    assert daemon.terminate() == 0
    # Nothing answering: the probe fails (exit 2) and says where it looked.
    done = _run_probe(commands[0], daemon.target)
    assert done.returncode == 2 and daemon.target.removeprefix("unix://") in done.stderr


def test_dockerfile_agrees_with_the_daemonset(rendered: tuple[str, Objects]) -> None:
    import kvtier

    _, objects = rendered
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    pod = _pod(objects)
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    # Numeric USER: the kubelet can only check runAsNonRoot against a number.
    assert re.search(rf"^USER {uid}:{gid}$", text, re.M)
    assert f"--uid {uid} --gid {gid}" in text and f"--gid {gid} kvtier" in text
    assert re.search(rf"^ARG VERSION={re.escape(kvtier.__version__)}$", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    assert cmd == _container(objects)["command"]
    # The init container runs /bin/sh from the same image: a python:*-slim base has it.
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    assert _container(objects, "own-dirs")["command"][0] == "/bin/sh"


def test_engine_example_reaches_the_daemons_socket_as_its_group(tmp_path: Path) -> None:
    objects = [json.loads(doc) for doc in _render("base")]
    cfg = _config(objects, tmp_path)
    socket_dir = str(Path(cfg.server.listen.removeprefix("unix://")).parent)
    daemon_volume = _mounts(objects, _container(objects))[socket_dir]
    example = ROOT / "deploy" / "kubernetes" / "examples" / "engine-pod.yaml"
    (pod,) = list(yaml.safe_load_all(example.read_text()))
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
    spec = pod["spec"]
    assert (
        _pod(objects)["securityContext"]["runAsGroup"]
        in spec["securityContext"]["supplementalGroups"]
    )
    (engine,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [m for m in engine["volumeMounts"] if m["mountPath"] == socket_dir]
    assert volumes[mount["name"]]["hostPath"]["path"] == daemon_volume["hostPath"]["path"]
    env = {e["name"]: e["value"] for e in engine["env"]}
    assert env["KVTIER_TARGET"] == cfg.server.listen
    assert f'"target": "{cfg.server.listen}"' in " ".join(engine["command"])
