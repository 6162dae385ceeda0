# kvguard engine replica (torch, the engine extra and SmolLM2-135M's weights). Build from the
# repo root:
#   docker build -f deploy/docker/engine.Dockerfile -t kvguard-engine .
# Its install step is scripts/install, the recipe the README's set-up and CI run.
FROM python:3.11-slim
WORKDIR /opt/kvguard
COPY . .
RUN python3 -m venv /opt/venv && scripts/install engine /opt/venv/bin/python \
    && rm -rf /root/.cache/pip
ENV PATH=/opt/venv/bin:$PATH
USER 65534:65534
EXPOSE 8000
ENTRYPOINT ["kvguard", "engine"]
CMD ["--model", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
