# kvguard proxy (the guard alone: no torch). Build from the repo root:
#   docker build -f deploy/docker/proxy.Dockerfile -t kvguard-proxy .
# Its install step is scripts/install, the recipe the README's set-up and CI run.
FROM python:3.11-slim
WORKDIR /opt/kvguard
COPY . .
RUN python3 -m venv /opt/venv && scripts/install guard /opt/venv/bin/python \
    && rm -rf /root/.cache/pip
ENV PATH=/opt/venv/bin:$PATH
USER 65534:65534
EXPOSE 9000
# The replicas, tenants and policy come from the config file (mount it, e.g. a ConfigMap).
ENTRYPOINT ["kvguard", "proxy"]
CMD ["--config", "/etc/kvguard/guard.toml", "--host", "0.0.0.0", "--port", "9000"]
