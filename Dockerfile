# One image for the master and every node (PS, chief, worker, evaluator).
#   docker build -t dlrover-elastic .                                  # TF + Kubernetes client
#   docker build --build-arg EXTRAS=tf,torch,k8s -t dlrover-elastic:all .
#   docker build --build-arg EXTRAS=torch,k8s -t dlrover-elastic:torch .
# torch comes from TORCH_INDEX_URL (CPU wheels by default; use e.g.
# https://download.pytorch.org/whl/cu121 for CUDA nodes).
#
# Entrypoints (no ENTRYPOINT: whoever starts the container names the program):
#   master (local or in a pod):  dlrover master /job/job.yaml --host 0.0.0.0 --port 50051
#   master on Kubernetes:        dlrover master JOB.yaml --platform k8s ...  (examples/k8s/)
#   PS node:                     python -m dlrover_tf.ps              (started by the master)
#   chief/worker/evaluator node: the job's own command, e.g. python wide_deep.py
#   torch node:                  dlrover-run [torchrun flags] train.py  (started by the master)
# Run dirs (logs, model, state) go under /var/dlrover, writable by the image's user (uid 1000).
FROM python:3.11-slim

ARG EXTRAS=tf,k8s
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2

WORKDIR /opt/dlrover
COPY constraints.txt setup.py pyproject.toml README.md ./
COPY proto ./proto
COPY master ./master
COPY dlrover_tf ./dlrover_tf
COPY dlrover_torch ./dlrover_torch
# The torch index is consulted only when torch is asked for.
RUN case ",${EXTRAS}," in \
        *,torch,*|*,all,*) index="--extra-index-url ${TORCH_INDEX_URL}" ;; \
        *) index="" ;; \
    esac \
    && pip install --no-cache-dir ${index} -c constraints.txt ".[${EXTRAS}]" \
    && dlrover --help > /dev/null \
    && case ",${EXTRAS}," in *,torch,*|*,all,*) dlrover-run --help > /dev/null ;; esac

COPY examples ./examples
RUN useradd --create-home --uid 1000 dlrover \
    && mkdir -p /var/dlrover \
    && chown dlrover:dlrover /var/dlrover
USER dlrover
WORKDIR /home/dlrover
ENTRYPOINT []
CMD ["dlrover", "--help"]
