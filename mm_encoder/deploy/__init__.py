"""Graphs of components and where they run: the schema, one plan per graph, the local runner
(`mm-encoder serve`), the Kubernetes renderer, the nginx cache tiers and `mm-encoder status`."""
