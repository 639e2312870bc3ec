"""The encode planner: sizes the encoder fleet from the workers' load signals (`signals.py`), a
pure decision rule (`policy.py`) and Dynamo's planner connectors (`service.py`); run as
`python -m mm_encoder.planner` (a graph's `kind: planner` component)."""
