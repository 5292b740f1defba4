"""The Helm chart (deploy/helm/spendgate), with a real `helm` built from its Go module and
the offline checker (deploy/kubecheck: strict decoding into the k8s.io/api types), both
from scripts/helm-tools: lint and render for the default, production and minimal values;
every object accepted; a wrong template field and a wrong value fail; what the objects
must say (probes, grace, Secret modes the services accept, non-root, the image's command
and ports, the production HPA, PDB and NetworkPolicy)."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from spendgate import _docs_gen
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.key_settings import read_private_file
from spendgate.schemas.policies import Policy
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.helm import CHART, Tools, objects
from tests.test_image import UID, only, parse

ROOT = Path(__file__).resolve().parents[2]
VALUES = {
    "default": [],
    "production": [CHART / "ci" / "production-values.yaml"],
    "minimal": [CHART / "ci" / "minimal-values.yaml"],
}


def of_kind(found: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in found if o["kind"] == kind]


def pod_specs(found: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each workload's pod spec by its component label."""
    specs = {}
    for o in found:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            template = o["spec"]["template"]
            specs[template["metadata"]["labels"]["app.kubernetes.io/component"]] = template
    return specs


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


@pytest.fixture(scope="module")
def rendered(tools: Tools) -> dict[str, list[dict[str, Any]]]:
    return {name: objects(tools.template(values)) for name, values in VALUES.items()}


class TestHelm:
    @pytest.mark.parametrize("name", list(VALUES))
    def test_lint_strict_and_every_rendered_object_is_accepted(
        self, tools: Tools, name: str
    ) -> None:
        args = ["lint", "--strict", "CHART"]
        for path in VALUES[name]:
            args += ["-f", str(path)]
        linted = tools.helm_run(*args)
        assert linted.returncode == 0, linted.stdout + linted.stderr
        text = tools.template(VALUES[name])
        checked = tools.check(text)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        accepted = [line for line in checked.stdout.splitlines() if line.startswith("ok ")]
        assert len(accepted) == len(objects(text)) > 5

    def test_a_wrong_field_in_a_template_fails_the_check(
        self, tools: Tools, tmp_path: Path
    ) -> None:
        chart = tmp_path / "spendgate"
        shutil.copytree(CHART, chart)
        worker = chart / "templates" / "worker.yaml"
        text = worker.read_text()
        assert "  serviceName: {{ $name }}" in text
        worker.write_text(text.replace("  serviceName: {{ $name }}", "  serviceNmae: {{ $name }}"))
        checked = tools.check(tools.template([], chart=chart))
        assert checked.returncode == 1
        failed = [line for line in checked.stdout.splitlines() if line.startswith("FAIL")]
        assert len(failed) == 1 and "StatefulSet" in failed[0], checked.stdout
        assert 'unknown field "serviceNmae"' in failed[0]

    @pytest.mark.parametrize(
        ("setting", "named"),
        [
            ("secret.defaultMode=420", "/secret/defaultMode"),  # 0644: the services refuse it
            ("secret.defaultMode=256", "/secret/defaultMode"),  # 0400: root-owned, unreadable
            ("kafka.securityProtocol=SASL", "/kafka/securityProtocol"),
            ("worker.replicas=0", "/worker/replicas"),
            ("worker.stalls=30", "'stalls'"),
            ("worker.stopGraceS=15", "worker.stopGraceS (15) must stay below"),
            ("auth.tokensKey=tokens.yaml", "dashboard.sessionSecretKey is required"),
        ],
    )
    def test_a_wrong_value_fails_naming_it(self, tools: Tools, setting: str, named: str) -> None:
        done = tools.helm_run("template", "t", "CHART", "--set", setting)
        assert done.returncode != 0
        assert named in done.stderr, done.stderr


class TestWhatTheObjectsSay:
    def test_the_worker_statefulset_probes_and_grace(
        self, rendered: dict[str, list[dict[str, Any]]]
    ) -> None:
        values = yaml.safe_load((CHART / "values.yaml").read_text())["worker"]
        # The chart's defaults are the worker's own.
        fields = WorkerSettings.model_fields
        for value, field in (("stallS", "worker_stall_s"), ("exitS", "worker_exit_s"),
                             ("stopGraceS", "worker_stop_grace_s"),
                             ("sessionTimeoutS", "session_timeout_s")):  # fmt: skip
            assert values[value] == fields[field].default, value
        for name, found in rendered.items():
            (sts,) = of_kind(found, "StatefulSet")
            pod = sts["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            env = env_of(container)
            grace, session = (
                float(env["SPENDGATE_WORKER_STOP_GRACE_S"]),
                float(env["SPENDGATE_SESSION_TIMEOUT_S"]),
            )
            assert grace < session and pod["terminationGracePeriodSeconds"] > grace, name
            ready, live = container["readinessProbe"], container["livenessProbe"]
            assert ready["httpGet"] == {"path": "/readyz", "port": "metrics"}
            assert live["httpGet"] == {"path": "/healthz", "port": "metrics"}
            assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
            # /healthz is 503 after the stall bound; the probe restarts the pod after
            # period x threshold more, before the worker's own exit.
            restart_s = float(env["SPENDGATE_WORKER_STALL_S"]) + (
                live["periodSeconds"] * live["failureThreshold"]
            )
            assert restart_s < float(env["SPENDGATE_WORKER_EXIT_S"]), name
            assert env["SPENDGATE_METRICS_HOST"] == "0.0.0.0"
            assert env["SPENDGATE_DATA_DIR"] == "/data/tables"
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert mounts["data"] == "/data"
            assert [c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]] == ["data"]

    def test_the_production_values_render_the_hpa_pdb_and_network_policies(
        self, rendered: dict[str, list[dict[str, Any]]]
    ) -> None:
        found = rendered["production"]
        admission = next(
            o for o in of_kind(found, "Deployment") if o["metadata"]["name"].endswith("-admission")
        )
        assert "replicas" not in admission["spec"]  # the HPA owns it
        (hpa,) = of_kind(found, "HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": admission["metadata"]["name"],
        }
        assert hpa["spec"]["minReplicas"] == 3 and hpa["spec"]["maxReplicas"] == 12
        (pdb,) = of_kind(found, "PodDisruptionBudget")
        assert pdb["spec"]["minAvailable"] == 2
        pod_labels = admission["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        policies = {
            o["metadata"]["name"].rsplit("-", 1)[1]: o for o in of_kind(found, "NetworkPolicy")
        }
        assert set(policies) == {"admission", "worker", "dashboard"}
        to_admission = policies["admission"]["spec"]
        assert to_admission["podSelector"]["matchLabels"].items() <= pod_labels.items()
        peers = to_admission["ingress"][0]["from"]
        assert {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm-gateway"}}
        } in peers
        assert {} not in [p.get("podSelector") for p in peers]
        (monitor,) = of_kind(found, "ServiceMonitor")
        assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"http", "metrics"}
        # Kafka over SASL_SSL, a Redis Cluster over TLS, replication.
        env = env_of(admission["spec"]["template"]["spec"]["containers"][0])
        assert env["SPENDGATE_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
        assert env["SPENDGATE_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
        assert env["SPENDGATE_REDIS_URL"].startswith("rediss://")
        assert env["SPENDGATE_REDIS_CLUSTER"] == "true"
        assert env["SPENDGATE_KAFKA_REPLICATION_FACTOR"] == "3"
        assert "SPENDGATE_ALLOW_UNAUTHENTICATED" not in env
        # The bootstrap Job applies the policies the values list, each a valid policy.
        (job,) = of_kind(found, "Job")
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert container["args"][:2] == ["policy", "apply"]
        (config,) = of_kind(found, "ConfigMap")
        listed = yaml.safe_load(config["data"]["policies.yaml"])
        assert [Policy.model_validate(p).id for p in listed] == ["team-daily", "key-minute"]
        assert Path(container["args"][2]).name in config["data"]

    @pytest.mark.parametrize("name", list(VALUES))
    def test_secret_files_are_mounted_at_a_mode_the_services_accept(
        self, rendered: dict[str, list[dict[str, Any]]], name: str, tmp_path: Path
    ) -> None:
        for role, template in pod_specs(rendered[name]).items():
            pod = template["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            (container,) = pod["containers"]
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            # Every setting naming a file of the Secret: the *_FILE ones and the CA bundles.
            files = {
                k: v for k, v in env_of(container).items() if v.startswith("/etc/spendgate/secret/")
            }
            if "secret" in volumes:
                secret = volumes["secret"]["secret"]
                mode = secret["defaultMode"]
                probe = tmp_path / f"{role}-probe"
                probe.write_text("x")
                probe.chmod(mode)
                assert read_private_file(probe, "a probe") == b"x", (role, oct(mode))
                keys = {item["key"] for item in secret["items"]}
                # Each names a projected key of the mounted Secret, and each key is named.
                assert {Path(p).name for p in files.values()} == keys, role
                assert {str(Path(p).parent) for p in files.values()} == {mounts["secret"]}
            else:
                assert not files, role
        # The group reads them: the pod's fsGroup owns the files.
        for template in pod_specs(rendered[name]).values():
            assert template["spec"]["securityContext"]["fsGroup"] == UID

    def test_a_mode_the_services_refuse_is_refused_here_too(self, tmp_path: Path) -> None:
        probe = tmp_path / "probe"
        probe.write_text("x")
        probe.chmod(0o644)  # Kubernetes' default defaultMode
        with pytest.raises(ConfigurationError):
            read_private_file(probe, "a probe")

    @pytest.mark.parametrize("name", list(VALUES))
    def test_every_pod_is_non_root_read_only_with_resources(
        self, rendered: dict[str, list[dict[str, Any]]], name: str
    ) -> None:
        for role, template in pod_specs(rendered[name]).items():
            pod = template["spec"]
            context = pod["securityContext"]
            assert context["runAsNonRoot"] is True, role
            assert context["runAsUser"] == UID and context["runAsGroup"] == UID, role
            assert pod["automountServiceAccountToken"] is False
            for container in pod["containers"]:
                sc = container["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True, role
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"]["drop"] == ["ALL"]
                assert container["resources"]["requests"], role
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                assert "/tmp" in mounts, role

    @pytest.mark.parametrize("name", list(VALUES))
    def test_scrape_annotations(self, rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
        for role, template in pod_specs(rendered[name]).items():
            if role not in ("worker", "admission"):
                continue
            annotations = template["metadata"].get("annotations") or {}
            if name == "minimal":
                assert "prometheus.io/scrape" not in annotations
            else:
                port = template["spec"]["containers"][0]["ports"][0]["containerPort"]
                assert annotations["prometheus.io/scrape"] == "true"
                assert annotations["prometheus.io/port"] == str(port)

    @pytest.mark.parametrize("name", list(VALUES))
    def test_every_variable_is_a_setting_of_the_services(
        self, rendered: dict[str, list[dict[str, Any]]], name: str
    ) -> None:
        known = set(_docs_gen.settings_variables())
        for role, template in pod_specs(rendered[name]).items():
            for container in template["spec"]["containers"]:
                unknown = set(env_of(container)) - known
                assert not unknown, (role, unknown)


class TestTheImageAndTheChartAgree:
    def test_entrypoint_user_ports_and_version(
        self, rendered: dict[str, list[dict[str, Any]]]
    ) -> None:
        run = parse((ROOT / "Dockerfile").read_text())[-1]
        assert only(run, "ENTRYPOINT").args == '["spendgate"]'
        assert only(run, "USER").args == f"{UID}:{UID}"
        exposed = {int(p) for p in only(run, "EXPOSE").args.split()}
        chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        assert chart["appVersion"] == version
        roles = {"worker": "worker", "admission": "admission", "dashboard": "dashboard",
                 "policy": "policy"}  # fmt: skip
        for name, found in rendered.items():
            for role, template in pod_specs(found).items():
                (container,) = template["spec"]["containers"]
                # The image's entrypoint runs: the chart gives the role as the command's args.
                assert "command" not in container, (name, role)
                assert container["args"][0] == roles[role]
                ports = {p["containerPort"] for p in container.get("ports", [])}
                assert ports <= exposed, (name, role, ports)
                assert container["image"].endswith(":" + version) or name == "production"
