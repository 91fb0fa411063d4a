"""The Brain: a job-history store and an optimizer that proposes resources from past runs."""
