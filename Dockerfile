# syntax=docker/dockerfile:1
# The atomlog server image: `atomlog serve ROLE` (partition-server, coordinator,
# id-allocator or combined) as an unprivileged user, from a virtualenv holding the atomlog
# wheel and its core dependencies only (no Spark, no benchmark or dev tools). Build it from
# the repository root:
#
#   docker build -t atomlog:0.1.0 .
#
# The base is pinned to an exact Python release; pin its digest too for byte-for-byte
# rebuilds: docker build --build-arg PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:...
# tests/test_deploy_image.py builds the native core and the wheel from the files copied
# below, installs it the way this file does and starts a server with the ENTRYPOINT below
# (no container engine), which must report atomlog_build_info{core="native"}.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# The native core (docs/native-core.md) is built here with Debian's cargo and rustc, and
# goes into the wheel; the runtime stage needs neither.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cargo rustc \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md ./
COPY scripts/build_native.sh scripts/build_native.sh
COPY protos protos
COPY services services
COPY partition_server partition_server
COPY coordinator coordinator
COPY id_allocator id_allocator
COPY spark_client spark_client
RUN PYTHON=python ATOMLOG_NATIVE_TARGET=/tmp/native-target bash scripts/build_native.sh
RUN python -m pip wheel --no-deps --wheel-dir /wheels .
ENV VIRTUAL_ENV=/opt/atomlog
# Core dependencies only: the `spark`, `bench` and `dev` extras stay out. pyarrow is a
# core dependency: the operator commands (`atomlog txn find-hanging`, `atomlog partition
# describe`, ...) use the SDK, which encodes records with it; the servers never import it.
# The build stage's pip installs into the virtualenv, which gets no pip of its own.
RUN python -m venv --without-pip "$VIRTUAL_ENV" \
 && python -m pip --python "$VIRTUAL_ENV/bin/python" install /wheels/atomlog-*.whl

FROM ${PYTHON_IMAGE}
ENV VIRTUAL_ENV=/opt/atomlog \
    PATH=/opt/atomlog/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 atomlog \
 && useradd --system --uid 10001 --gid atomlog --no-create-home --home-dir /var/lib/atomlog \
      --shell /usr/sbin/nologin atomlog \
 && install -d -o atomlog -g atomlog -m 0750 /var/lib/atomlog
COPY --from=build /opt/atomlog /opt/atomlog
USER 10001:10001
WORKDIR /var/lib/atomlog
# gRPC (server.listen), Prometheus /metrics (server.metrics_listen) and the partition
# servers' replication link (replication.link_listen) in the settings files of
# deploy/kubernetes, and the plaintext health port of the production overlay
# (server.health_listen, for probes when gRPC serves TLS); the servers' own defaults are
# loopback and port 0.
EXPOSE 7070 7071 7072 9102
ENTRYPOINT ["/opt/atomlog/bin/atomlog", "serve"]
CMD ["partition-server"]
