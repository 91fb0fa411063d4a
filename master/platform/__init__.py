"""Where nodes run: one interface (launch, stop, events); local, Ray and Kubernetes platforms."""
