"""Torch rendezvous rounds: the pure round state machine, and the durable blocking service."""
