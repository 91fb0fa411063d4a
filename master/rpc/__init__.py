"""The gRPC surface: servicers mapping wire messages to the job, rendezvous and KV, their guards,
interceptors, and the server's assembly (job master and standalone)."""
