"""Rollups: bounded aggregates of requests and pool samples that the dashboard reads instead
of raw rows. Ingest marks the buckets a batch touched (``marks``); a periodic refresher
recomputes marked buckets from the raw rows (``refresh``); ``stats`` answers the dashboard's
questions from them."""
