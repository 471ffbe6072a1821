"""Data parallelism in one server: replicas behind one frontend (host.py), the dispatcher
that picks a replica per request (dispatch.py), merged control answers (merge.py)."""
