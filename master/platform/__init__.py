"""Where nodes run: one interface (launch, stop, events) and the local, Ray and Kubernetes platforms."""
