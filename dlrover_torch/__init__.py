"""PyTorch integration: the dlrover-run launcher, its elastic agent, and flash checkpoint."""
