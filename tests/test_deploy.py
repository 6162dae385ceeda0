"""The deployment files: the container images install with scripts/install (the recipe the
README's set-up runs), their commands are ones kvguard accepts, and a guard-only install has
no torch and names the extra a subcommand needs. (No Docker daemon or cluster runs here: the
images themselves are not built in CI; their install step is, below.)"""

import argparse
import importlib
import json
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from guard.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]
IMAGES = {"proxy.Dockerfile": ("guard", "proxy"), "engine.Dockerfile": ("engine", "engine"),
          "epp.Dockerfile": ("gateway", "epp")}


def _instruction(dockerfile: str, name: str) -> str:
    text = (ROOT / "deploy" / "docker" / dockerfile).read_text()
    lines = re.findall(rf"(?m)^{name} (.+)$", text)
    assert len(lines) == 1, f"{dockerfile}: one {name} expected, got {lines}"
    return lines[0]


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_each_image_installs_with_the_setup_script_and_runs_a_real_command(dockerfile):
    target, subcommand = IMAGES[dockerfile]
    assert f"scripts/install {target} " in _instruction(dockerfile, "RUN")
    entrypoint = json.loads(_instruction(dockerfile, "ENTRYPOINT"))
    assert entrypoint == ["kvguard", subcommand]
    args = json.loads(_instruction(dockerfile, "CMD"))
    module = importlib.import_module(SUBCOMMANDS[subcommand][0])
    parser = argparse.ArgumentParser(prog=f"kvguard {subcommand}", exit_on_error=False)
    module.configure(parser)
    parsed = parser.parse_args(args)  # raises on a flag kvguard does not have
    port = int(re.search(r"EXPOSE (\d+)", (ROOT / "deploy/docker" / dockerfile).read_text())[1])
    assert parsed.port == port and parsed.host == "0.0.0.0"


def test_the_venv_script_installs_through_the_same_recipe():
    assert '"$ROOT/scripts/install" dev "$VENV/bin/python"' in (ROOT / "scripts/_venv.sh").read_text()
    recipe = (ROOT / "scripts/install").read_text()
    assert '-e "$ROOT[engine,dev,bench,gateway]"' in recipe and '"$ROOT[engine]"' in recipe


@pytest.mark.slow
def test_a_guard_only_install_has_no_torch_and_names_the_extra_a_subcommand_needs(tmp_path):
    """`scripts/install guard` into a fresh venv (from the package index, as the proxy image
    does): the proxy runs, torch is absent, and `kvguard engine --help` says which extra to
    install in one line."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(ROOT / "scripts/install"), "guard", str(python)], check=True,
                   timeout=600, cwd=tmp_path)
    kvguard = env_dir / "bin" / "kvguard"
    assert subprocess.run([str(kvguard), "proxy", "--help"], capture_output=True,
                          timeout=120, cwd=tmp_path).returncode == 0
    no_torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True,
                              timeout=120, cwd=tmp_path)
    assert no_torch.returncode != 0
    done = subprocess.run([str(kvguard), "engine", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "kvguard engine: needs the 'engine' extra (torch is not installed): "
        "pip install 'kvguard[engine]'"], shlex.quote(done.stderr)
    assert sys.executable != str(python)


def test_the_kubernetes_example_runs_kvguard_epp_with_flags_and_config_it_accepts(tmp_path):
    """deploy/kubernetes/ is not run here (no cluster): what can be checked is that the EPP's
    arguments are ones `kvguard epp` has, its probes name the EPP's gRPC health services, it
    follows the manifest's own InferencePool with a service account whose Role grants what
    that reads, and the ConfigMap's guard.toml loads."""
    import yaml

    from guard.config import load_config
    from guard.epp import cli as epp_cli
    from guard.replicas.inference_pool import POOL_APIS

    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/kvguard-epp.yaml").read_text()))
    kinds = {doc["kind"]: doc for doc in docs}
    assert set(kinds) == {"InferencePool", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
                          "Deployment", "Service"}
    assert kinds["InferencePool"]["spec"]["endpointPickerRef"]["name"] == "kvguard-epp"
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser(prog="kvguard epp", exit_on_error=False)
    epp_cli.configure(parser)
    parsed = parser.parse_args(container["args"])
    assert parsed.port == kinds["InferencePool"]["spec"]["endpointPickerRef"]["port"]["number"]
    assert parsed.replicas_from == f"inferencepool:{kinds['InferencePool']['metadata']['name']}"
    account = kinds["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"]
    binding = kinds["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == kinds["Role"]["metadata"]["name"]
    granted = {(group, resource, verb) for rule in kinds["Role"]["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]
               for verb in rule["verbs"]}
    needed = {(api.split("/")[0], "inferencepools", verb) for api in POOL_APIS
              for verb in ("get", "watch")} | {("", "pods", "list"), ("", "pods", "watch")}
    assert granted == needed
    assert {container["livenessProbe"]["grpc"]["service"],
            container["readinessProbe"]["grpc"]["service"]} == {"liveness", "readiness"}
    config_path = tmp_path / "guard.toml"
    config_path.write_text(kinds["ConfigMap"]["data"]["guard.toml"])
    config = load_config(str(config_path))
    assert config.replicas == () and config.redis_url is not None


PROXY_MANIFESTS = ROOT / "deploy" / "kubernetes" / "kvguard-proxy.yaml"


def _manifests() -> dict[str, dict]:
    yaml = pytest.importorskip("yaml", reason="PyYAML (the dev extra) reads the manifests")
    found = {}
    for document in yaml.safe_load_all(PROXY_MANIFESTS.read_text()):
        if document is None:
            continue
        assert document["kind"] not in found, f"a second {document['kind']}"
        found[document["kind"]] = document
    return found


def test_the_kubernetes_manifests_probe_the_proxy_where_it_answers(tmp_path):
    """Deployment, Service, ConfigMap and Secret for the proxy: the probes' paths are the ones
    the proxy serves, on the port its args listen on (the image's EXPOSE), the Service targets
    that port, the config the ConfigMap mounts loads with the Secret's variables, and the grace
    period outlasts the drain. (No cluster runs them here.)"""
    from guard.config import load_config
    from guard.proxy.app import LIVEZ_PATH, READYZ_PATH

    manifests = _manifests()
    assert set(manifests) == {"Deployment", "Service", "ConfigMap", "Secret"}
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    importlib.import_module(SUBCOMMANDS["proxy"][0]).configure(parser)
    args = parser.parse_args(container["args"])
    exposed = int(re.search(r"EXPOSE (\d+)", (ROOT / "deploy/docker/proxy.Dockerfile").read_text())[1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port} and args.port == exposed and args.host == "0.0.0.0"
    for probe, path in (("livenessProbe", LIVEZ_PATH), ("readinessProbe", READYZ_PATH)):
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}
    assert manifests["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    selector = manifests["Service"]["spec"]["selector"]
    assert selector.items() <= manifests["Deployment"]["spec"]["template"]["metadata"]["labels"].items()

    (mount,) = container["volumeMounts"]
    (volume,) = pod["volumes"]
    assert volume["configMap"]["name"] == manifests["ConfigMap"]["metadata"]["name"]
    (file_name,) = manifests["ConfigMap"]["data"]
    assert args.config == f"{mount['mountPath']}/{file_name}"
    assert container["envFrom"] == [{"secretRef": {"name": manifests["Secret"]["metadata"]["name"]}}]
    config_path = tmp_path / file_name
    config_path.write_text(manifests["ConfigMap"]["data"][file_name])
    config = load_config(config_path, env=manifests["Secret"]["stringData"])
    assert config.replicas and config.redis_url and config.admin_key_sha256
    assert pod["terminationGracePeriodSeconds"] > config.proxy.drain_timeout_s
