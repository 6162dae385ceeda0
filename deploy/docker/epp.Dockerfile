# kvguard epp (the endpoint picker of Envoy / the Gateway API: the guard and the gateway extra,
# no torch). Build from the repo root:
#   docker build -f deploy/docker/epp.Dockerfile -t kvguard-epp .
# Its install step is scripts/install, the recipe the README's set-up and CI run.
FROM python:3.11-slim
WORKDIR /opt/kvguard
COPY . .
RUN python3 -m venv /opt/venv && scripts/install gateway /opt/venv/bin/python \
    && rm -rf /root/.cache/pip
ENV PATH=/opt/venv/bin:$PATH
USER 65534:65534
# 9002: ext_proc gRPC (Envoy's), with gRPC health; 9090: GET /metrics
EXPOSE 9002
# The replicas (IP URLs), tenants and policy come from the config file (mount it, e.g. a
# ConfigMap); --redis or redis_url shares budgets between EPP replicas.
ENTRYPOINT ["kvguard", "epp"]
CMD ["--config", "/etc/kvguard/guard.toml", "--host", "0.0.0.0", "--port", "9002", "--metrics-port", "9090"]
