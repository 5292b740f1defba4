# One image for every role: the command picks it (`worker`, `admission`, `dashboard`,
# `policy apply FILE`, ...: the entrypoint is `spendgate`). Used by docker-compose.yml and
# the Helm chart (deploy/helm/spendgate); building and publishing it:
# docs/guides/kubernetes.md. tests/test_image.py checks what this file promises.

# Build: the package and its dependencies into a virtualenv, compilers and caches left here.
FROM python:3.11-slim AS build
WORKDIR /src
RUN python -m venv /opt/spendgate
ENV PATH=/opt/spendgate/bin:$PATH
COPY constraints.txt pyproject.toml README.md ./
COPY schemas schemas
COPY streams streams
COPY admission admission
COPY spendgate spendgate
COPY dashboard dashboard
RUN pip install --no-cache-dir -c constraints.txt . \
    && python -m compileall -q /opt/spendgate

# Run: the virtualenv alone, as an unprivileged user, nothing written outside /data and /tmp
# (a read-only root filesystem works).
FROM python:3.11-slim
# The package's version (pyproject.toml); a release build passes the same.
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="spendgate" \
      org.opencontainers.image.description="Rolling-window spend budgets for LLM inference: worker, admission, dashboard" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 spendgate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin spendgate \
    && mkdir -p /data && chown 10001:10001 /data
COPY --from=build /opt/spendgate /opt/spendgate
ENV PATH=/opt/spendgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPENDGATE_DATA_DIR=/data/tables
WORKDIR /data
USER 10001:10001
# admission 8787, dashboard 8788, the worker's /metrics, /healthz and /readyz 9464.
EXPOSE 8787 8788 9464
# Whichever role runs: its /healthz, on the port its settings give (a job exits instead).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request as u\ndef ok(port):\n    try:\n        return u.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=2).status == 200\n    except OSError:\n        return False\nports = [os.environ.get(v, d) for v, d in (('SPENDGATE_ADMISSION_PORT', '8787'), ('SPENDGATE_DASHBOARD_PORT', '8788'), ('SPENDGATE_METRICS_PORT', '9464'))]\nsys.exit(0 if any(ok(p) for p in ports) else 1)"]
ENTRYPOINT ["spendgate"]
CMD ["--help"]
