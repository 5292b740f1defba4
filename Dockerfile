# Image for the worker, admission and dashboard services in docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY constraints.txt pyproject.toml README.md ./
COPY schemas schemas
COPY streams streams
COPY admission admission
COPY spendgate spendgate
COPY dashboard dashboard
RUN pip install --no-cache-dir -c constraints.txt .
