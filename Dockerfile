# One image for the master and every node (PS, chief, worker, evaluator).
#   docker build -t dlrover-elastic .                       # TF extras (default)
#   docker build --build-arg EXTRAS=tf,torch -t dlrover-elastic:all .
# Master:  docker run dlrover-elastic dlrover master /job/job.yaml --host 0.0.0.0 --port 50051
# Nodes are started by the master's platform with the same image.
FROM python:3.11-slim

ARG EXTRAS=tf
ENV PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2

WORKDIR /opt/dlrover
COPY constraints.txt setup.py pyproject.toml README.md ./
COPY proto ./proto
COPY master ./master
COPY dlrover_tf ./dlrover_tf
RUN pip install --no-cache-dir -c constraints.txt ".[${EXTRAS}]"

COPY examples ./examples
RUN useradd --create-home --uid 1000 dlrover
USER dlrover
WORKDIR /home/dlrover
ENTRYPOINT []
CMD ["dlrover", "--help"]
