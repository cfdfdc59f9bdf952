"""The Kubernetes manifests a user applies (app/fleet/kubernetes.yaml, and every YAML block of
README.md) are valid against Kubernetes' own schemas (the `kubernetes-validate` package,
strict: no unknown field), an InferencePool against its CRD's schema (vendored from the
Gateway API Inference Extension: tests/inferencepool_schema.yaml; other custom resources,
such as KEDA's, are only read whole); the RBAC grants the watch what it asks for, and
Sluice's arguments in each Deployment are flags it accepts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from app.cli.command import parse
from app.config import Settings
from app.discovery_targets import K8sTarget

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "app" / "fleet" / "kubernetes.yaml"
KUBERNETES = "1.33.0"
CUSTOM_RESOURCES = ("keda.sh/v1alpha1",)  # no schema of theirs here
INFERENCE_POOL = yaml.safe_load((Path(__file__).parent / "inferencepool_schema.yaml").read_text())


def documents() -> list[dict[str, Any]]:
    found = [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d]
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    return found + [d for block in blocks for d in yaml.safe_load_all(block) if d]


@pytest.mark.parametrize(
    "manifest", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}"
)
def test_every_manifest_is_valid(manifest: dict[str, Any]) -> None:
    if manifest["kind"] == "InferencePool":
        assert manifest["apiVersion"] == "inference.networking.k8s.io/v1"
        jsonschema.validate(manifest, INFERENCE_POOL)
    elif manifest["apiVersion"] in CUSTOM_RESOURCES:
        assert manifest["metadata"]["name"] and manifest["spec"]
    else:
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)


def test_a_wrong_manifest_is_refused() -> None:
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "x"},
                "spec": {"portz": []},
            },
            KUBERNETES,
            strict=True,
        )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"spec": {"selector": {}}}, INFERENCE_POOL)


def test_the_watch_is_granted_and_sluice_accepts_its_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    by_kind = {d["kind"]: d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d}
    rules = by_kind["Role"]["rules"]
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in rules)
    binding = by_kind["RoleBinding"]
    assert binding["roleRef"]["name"] == by_kind["Role"]["metadata"]["name"]
    sluices = [
        d
        for d in yaml.safe_load_all(MANIFESTS.read_text())
        if d and d["kind"] == "Deployment" and d["metadata"]["name"].startswith("sluice")
    ]
    assert len(sluices) == 2
    for sluice in sluices:
        pod = sluice["spec"]["template"]["spec"]
        assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
        container = pod["containers"][0]
        for variable in container.get("env", ()):  # from a Secret in the cluster
            monkeypatch.setenv(variable["name"], "from-the-secret")
        command, settings = parse(container["args"])
        assert command == "serve" and isinstance(settings, Settings)
        assert settings.discover_k8s is not None
        target = K8sTarget.parse(settings.discover_k8s)
        assert target.namespace == sluice["metadata"]["namespace"]
