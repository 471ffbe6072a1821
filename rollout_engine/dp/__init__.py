"""Data parallelism's policy: the dispatcher that picks a replica per request (dispatch.py)
and merged control answers (merge.py). The replicas' host is ``runtime/dp_host.py``."""
