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
- serve_fixtures: whole graphs through `mm-encoder serve` (GraphRunner) as one `Process`; components
  one by one (`Graph`); the requests they are sent and the prompt sizes expected of them.
- nginx_fixtures, worker_fixtures: cache tiers as processes, an encode worker in-process.
- dynamo_probe: a Dynamo client in its own process counting an endpoint's instances.
- glm: a tiny GLM-4.1V for vLLM's GLM plugin (tests/vllm and bench/gpu_vllm.py).
- k8s_schema: the DynamoGraphDeployment schema the manifests are checked against.
- venvs: vLLM's virtualenv, waited for while `make test` builds it.
- certs: a deployment's CA and components' certificates, and the bad ones red-team tests present.
"""
