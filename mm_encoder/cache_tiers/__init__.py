"""The nginx cache tiers between the frontend and the encode workers: the cluster tier (one per model
cluster), the shard router and the shared tier's shards (next to the encoders).

- `config.py`: one tier's options (`TierConfig`), and its command line both ways;
- `nginx.py`: its nginx config from the templates in `configs/nginx/` (the Lua key and route logic:
  `cache_key.lua`), the install check, the run directory, nginx in the foreground;
- `cli.py`: `mm-encoder cache up|render` (`python -m mm_encoder.cache_tiers`);
- `reload.py`: a running tier reloaded with new upstreams (what `serve` does as encoders scale);
- `ring.py`: which shard the router's consistent hash picks for a key (`mm-encoder capacity`);
- `metrics.py`: the Prometheus families a tier counts per calling cluster (in Lua: `tier_metrics.lua`).

The levels below the tiers are the encode worker's own (its URL-alias and mm_hash LRUs:
`encode_worker/caches.py`); docs/cache-tiers.md is the whole hierarchy.
"""
