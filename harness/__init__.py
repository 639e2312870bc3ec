"""What tests/ and bench/ share: media made on the fly, the independent references the equality
tests and benchmarks compare against, and the one way they start processes and whole graphs.

A top-level package of the repository, importable from its root (pytest's `pythonpath = ["."]`;
benchmarks run as `python -m bench.<name>` from the root). Not shipped: the wheel and sdist carry
`mm_encoder/` only (tools/check_dist.py).

- media_factory: images and videos generated in memory (natural-looking, seeded).
- released_processor: Kimi-K2.5's released processor rules, written once (the expected side).
- reference / hf_reference: an independent fp32 eager vision tower; transformers' own model.
- models: random-weight models and the reference's config for a spec.
- processes: the one launcher of a single process (own session, ready line or URL, stopped by group).
- topology: an encode worker and an nginx cache tier as `Process`es, with or without TLS (`Tls`: a
  `certs.Certs` CA and an issued certificate): every stack of them a test or benchmark builds by hand;
  the ports they take and nginx's presence.
- serve_fixtures: whole graphs through `mm-encoder serve` (GraphRunner) as one `Process`; components
  one by one (`Graph`: its worker and tier through `topology`); the requests they are sent and the
  prompt sizes expected of them.
- worker_fixtures: an encode worker in-process (and the engine beside it, the processor in front).
- dynamo_probe: a Dynamo client in its own process counting an endpoint's instances.
- glm: a tiny GLM-4.1V for vLLM's GLM plugin (tests/vllm and bench/gpu_vllm.py).
- k8s_schema: the DynamoGraphDeployment schema the manifests are checked against.
- venvs: vLLM's virtualenv, waited for while `make test` builds it.
- certs: a deployment's CA and components' certificates, and the bad ones red-team tests present.
"""
