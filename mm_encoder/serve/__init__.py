"""The local site: `mm-encoder serve` runs a graph's plan on this machine (`cli.py` -> `runner.py`'s
`GraphRunner`, one `fleet.py` `Fleet` per component, on `site.py`'s `LocalSite`), with the etcd and
NATS its runtime asks for (`infra.py`), an encode planner's decisions carried out (`scaler.py`), and
`mm-encoder status` over the running graph (`status.py`)."""
