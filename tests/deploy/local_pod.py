"""Run a rendered pod's container on this machine the way Kubernetes would run it.

What a kubelet gives a container, and how it is reproduced here (the suite runs as root):

- **The image's entrypoint and the container's args**: ``spendgate`` (this checkout's
  virtualenv) with the rendered ``args``, the rendered ``env`` and nothing else of the
  suite's environment, in the image's ``WORKDIR`` (``/data``).
- **The user**: privileges dropped for real with ``setpriv``: the pod's ``runAsUser`` and
  ``runAsGroup``, its ``fsGroup`` as the supplementary group, no capabilities, no new
  privileges. Root reads any file; this user does not.
- **Volumes at their mount paths**, in a private mount namespace (``unshare -m``): a
  Secret or a ConfigMap in the kubelet's atomic-writer layout (``..<timestamp>/KEY``
  files owned root:fsGroup at the volume's ``defaultMode``, a ``..data`` symlink to that
  folder and ``KEY -> ..data/KEY`` links), mounted read-only; a PersistentVolumeClaim and
  an emptyDir as folders of the test, owned root:fsGroup, group-writable.
- **The read-only root filesystem**: ``/`` remounted read-only in that namespace, so a
  write anywhere but the volumes fails (``EROFS``) instead of going unseen.
- **Cluster DNS**: an ``/etc/hosts`` mounted over the host's, mapping the Services' and
  the pods' names to 127.0.0.1.

The Python interpreter of the virtualenv lives under ``/root`` (mode 0700 on this
machine), where the image has it under ``/opt``: the namespace shows ``/root/.pyenv``
alone, read-only, on a tmpfs over ``/root``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

#: The image's WORKDIR (Dockerfile).
WORKDIR = "/data"
#: The image's entrypoint: the checkout's ``spendgate``.
ENTRYPOINT = Path(sys.executable).parent / "spendgate"
#: Where the virtualenv's interpreter lives when it is under /root (made visible alone).
PYENV = Path("/root/.pyenv")
HIDDEN = os.path.realpath(sys.executable).startswith(f"{PYENV}/")


def _chown(path: Path, uid: int, gid: int, mode: int) -> None:
    os.chown(path, uid, gid, follow_symlinks=False)
    path.chmod(mode)


def atomic_writer_layout(folder: Path, files: dict[str, str], mode: int, gid: int) -> None:
    """Lay ``files`` out as the kubelet does for a Secret or ConfigMap volume."""
    folder.mkdir(parents=True)
    stamp = folder / time.strftime("..%Y_%m_%d_%H_%M_%S.000000001")
    stamp.mkdir()
    for name, text in files.items():
        path = stamp / name
        path.write_text(text)
        _chown(path, 0, gid, mode)
    _chown(stamp, 0, gid, 0o755)
    (folder / "..data").symlink_to(stamp.name)
    for name in files:
        (folder / name).symlink_to(f"..data/{name}")
    _chown(folder, 0, gid, 0o755)


@dataclass
class Mount:
    source: Path
    target: str
    read_only: bool


@dataclass
class LocalPod:
    """One rendered pod template, ready to run its first container here."""

    template: dict[str, Any]
    objects: list[dict[str, Any]]
    work: Path
    #: Names the cluster's DNS would resolve (Services, pods, Kafka, Redis): to 127.0.0.1.
    hosts: list[str]
    #: Data of Secrets the chart does not render (``secret.existing``): name -> key -> text.
    external_secrets: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The PersistentVolumeClaims of a StatefulSet pod: claim name -> folder (kept across
    #: restarts of the pod).
    claims: dict[str, Path] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)

    @property
    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.template["spec"]
        return spec

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.spec["containers"]
        found: dict[str, Any] = container
        return found

    @property
    def ids(self) -> tuple[int, int, int]:
        context = self.spec["securityContext"]
        return context["runAsUser"], context["runAsGroup"], context["fsGroup"]

    def env(self) -> dict[str, str]:
        return {e["name"]: e["value"] for e in self.container.get("env", [])}

    def _secret_data(self, name: str) -> dict[str, str]:
        for o in self.objects:
            if o["kind"] == "Secret" and o["metadata"]["name"] == name:
                return dict(o.get("stringData") or {})
        return self.external_secrets[name]

    def _config_data(self, name: str) -> dict[str, str]:
        for o in self.objects:
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name:
                return dict(o["data"])
        raise KeyError(name)

    def prepare(self) -> None:
        """Lay out every volume the container mounts."""
        _, _, fs_group = self.ids
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        self.work.mkdir(parents=True, exist_ok=True)
        for mount in self.container.get("volumeMounts", []):
            name, target = mount["name"], mount["mountPath"]
            folder = self.work / f"volume-{name}"
            volume = volumes.get(name)
            if volume is None:  # a StatefulSet's claim
                folder = self.claims[name]
                folder.mkdir(parents=True, exist_ok=True)
                _chown(folder, 0, fs_group, 0o2775)
                self.mounts.append(Mount(folder, target, False))
            elif "secret" in volume or "configMap" in volume:
                source = volume.get("secret") or volume["configMap"]
                data = (
                    self._secret_data(source["secretName"])
                    if "secret" in volume
                    else self._config_data(source["name"])
                )
                items = source.get("items")
                files = {i["path"]: data[i["key"]] for i in items} if items else data
                atomic_writer_layout(folder, files, source.get("defaultMode", 0o644), fs_group)
                self.mounts.append(Mount(folder, target, True))
            elif "emptyDir" in volume:
                folder.mkdir()
                _chown(folder, 0, fs_group, 0o2777)
                self.mounts.append(Mount(folder, target, False))
            else:
                raise AssertionError(f"volume {name}: a kind this harness does not lay out")
        hosts = self.work / "hosts"
        hosts.write_text(f"127.0.0.1 localhost {' '.join(self.hosts)}\n::1 localhost\n")
        hosts.chmod(0o644)

    def command(self, args: list[str] | None = None, program: str | None = None) -> list[str]:
        """The command line that runs the container (``args`` in place of its own, and
        ``program`` in place of the image's entrypoint, to look around as it would)."""
        uid, gid, fs_group = self.ids
        stage = self.work / "stage-pyenv"
        stage.mkdir(exist_ok=True)
        lines = ["set -eu", "mount --make-rprivate /"]
        if HIDDEN:
            lines += [
                f"mount --bind {PYENV} {stage}",
                "mount -t tmpfs -o mode=755,size=1m tmpfs /root",
                f"mkdir {PYENV}",
                f"mount --move {stage} {PYENV}",
                f"mount -o remount,bind,ro {PYENV}",
            ]
        lines.append(f"mount --bind {self.work / 'hosts'} /etc/hosts")
        # A volume over a folder that holds the test's files (an emptyDir at /tmp) last.
        sources = [str(m.source) for m in self.mounts]
        for m in sorted(
            self.mounts, key=lambda m: any(s.startswith(m.target + "/") for s in sources)
        ):
            lines.append(f"mount --bind {shlex.quote(str(m.source))} {shlex.quote(m.target)}")
            if m.read_only:
                lines.append(f"mount -o remount,bind,ro {shlex.quote(m.target)}")
        lines += [
            "mount -o remount,bind,ro /",
            "mount -o remount,ro /root" if HIDDEN else ":",
            f"cd {WORKDIR}",
        ]
        argv = [program or str(ENTRYPOINT), *(self.container["args"] if args is None else args)]
        lines.append(
            f"exec setpriv --reuid={uid} --regid={gid} --groups={fs_group} --no-new-privs "
            f"--inh-caps=-all --bounding-set=-all -- {shlex.join(argv)}"
        )
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)]

    def process_env(self) -> dict[str, str]:
        """The container's environment, and what the image adds (PATH, HOME)."""
        return {
            "PATH": f"{ENTRYPOINT.parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/nonexistent",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            **self.env(),
        }

    def start(self, log: Path) -> subprocess.Popen[bytes]:
        for m in self.mounts:
            Path(m.target).mkdir(parents=True, exist_ok=True)  # mount points on the host
        Path(WORKDIR).mkdir(exist_ok=True)
        with open(log, "ab") as out:
            return subprocess.Popen(
                self.command(), env=self.process_env(), stdout=out, stderr=subprocess.STDOUT
            )

    def run(
        self, args: list[str] | None = None, program: str | None = None, timeout_s: float = 120
    ) -> subprocess.CompletedProcess[str]:
        for m in self.mounts:
            Path(m.target).mkdir(parents=True, exist_ok=True)
        Path(WORKDIR).mkdir(exist_ok=True)
        return subprocess.run(
            self.command(args, program),
            env=self.process_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def ready_url(self) -> str:
        probe = self.container["readinessProbe"]["httpGet"]
        port = probe["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in self.container["ports"] if p["name"] == port)
        return f"http://127.0.0.1:{port}{probe['path']}"


def wait_ready(
    pod: LocalPod, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120
) -> float:
    """Poll the container's readiness probe until 200; the seconds it took."""
    url = pod.ready_url()
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready after {timeout_s}s: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
