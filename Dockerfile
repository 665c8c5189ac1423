# dtrain's container image: the `dtrain` command on Python 3.11, the dependency set pinned by constraints.txt.
#
#   docker build -t dtrain:cpu .                                  # CPU (the default): the coordinator, CPU islands
#   docker build --build-arg ACCELERATOR=cuda -t dtrain:cuda .    # NVIDIA GPU islands: jax[cuda12] (CUDA wheels)
#   docker build --build-arg ACCELERATOR=tpu -t dtrain:tpu .      # Cloud TPU islands: jax[tpu] (libtpu)
#
# Every variant installs the package the same way, `pip install -c constraints.txt .`; the accelerator ones add
# JAX's extra for it, at the JAX release constraints.txt pins (jax and jaxlib), so the plugin wheels match it. The
# coordinator never needs an accelerator: run it from the CPU image.

ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# cpu, cuda or tpu: which JAX wheels go in besides the package's own (see the pip line below)
ARG ACCELERATOR=cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# tini as PID 1: it forwards SIGTERM to dtrain and reaps children. A Python PID 1 ignores a SIGTERM it has no
# handler for (the island has none), and Kubernetes would wait out terminationGracePeriodSeconds before SIGKILL.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# A non-root user (uid/gid 10001, as the manifests' securityContext says); /work is its working folder: `--config
# NAME` finds configs/NAME.toml there, and runs/ goes there unless --run-dir says otherwise.
RUN groupadd --gid 10001 dtrain \
    && useradd --uid 10001 --gid dtrain --create-home --home-dir /home/dtrain --shell /usr/sbin/nologin dtrain \
    && mkdir -p /work && chown dtrain:dtrain /work

WORKDIR /src
COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY dtrain ./dtrain
COPY coordinator ./coordinator
COPY workers ./workers
COPY dtrain_cli ./dtrain_cli
RUN case "$ACCELERATOR" in \
        cpu) extra="" ;; \
        cuda) extra="jax[cuda12]" ;; \
        tpu) extra="jax[tpu]" ;; \
        *) echo "ACCELERATOR must be cpu, cuda or tpu, got '$ACCELERATOR'" >&2; exit 1 ;; \
    esac \
    && pip install -c constraints.txt . $extra \
    && cd / && rm -rf /src

COPY --chown=dtrain:dtrain configs /work/configs
WORKDIR /work
USER 10001:10001

# the coordinator's gRPC port (coordinator.port) and its live dashboard (coordinator.dashboard_port)
EXPOSE 50051 8051

ENTRYPOINT ["tini", "--", "dtrain"]
CMD ["--help"]
