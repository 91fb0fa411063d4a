"""Packaging for the elastic trainer: the master, the TF and torch integrations."""

from setuptools import find_packages, setup

# pyarrow reads Parquet files and google-crc32c checks TFRecord files for
# ShardedDataset.from_files (master.client.files imports them only when used).
TF = [
    "tensorflow-cpu==2.15.1",
    "tensorflow-estimator==2.15.0",
    "keras==2.15.0",
    "numpy==1.26.4",
    "pyarrow==25.0.1",
    "google-crc32c==1.9.0",
]
TORCH = ["torch==2.13.0", "torchdata==0.11.0"]
RAY = ["ray==2.60.0"]
K8S = ["kubernetes==37.0.2"]
DEV = ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff", "grpcio-tools==1.62.3"]

setup(
    name="dlrover-elastic",
    version="0.1.0",
    description="Elastic distributed training: a per-job master for TensorFlow PS and PyTorch jobs",
    python_requires=">=3.10",
    packages=find_packages(
        include=[
            "master",
            "master.*",
            "dlrover_tf",
            "dlrover_tf.*",
            "dlrover_torch",
            "dlrover_torch.*",
        ]
    ),
    # The dashboard page is served from the package (non-editable installs, the Docker image).
    package_data={"master.observability.dashboard": ["index.html"]},
    install_requires=[
        "grpcio>=1.60",
        "protobuf>=4.25,<5",
        "psutil",
        "pyyaml",
        "prometheus-client",
        "cryptography",
        "numpy",  # the master computes shuffled shard indices with it
    ],
    extras_require={
        "tf": TF,
        "torch": TORCH,
        "ray": RAY,
        "k8s": K8S,
        "all": TF + TORCH + RAY + K8S,
        "dev": DEV,
    },
    entry_points={
        "console_scripts": ["dlrover=master.cli.main:main", "dlrover-run=dlrover_torch.run:main"]
    },
)
