"""The control plane of an elastic training job: a master per job, and the client nodes use."""
