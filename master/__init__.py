"""The control plane of an elastic training job: one master per job, and the client its nodes use."""
