"""Prefill-decode disaggregation: moving one request's prompt KV from a prefill server to a
decode server (SGLang's ``--disaggregation-mode prefill | decode`` behind a PD router).

A prefill server computes a request's prompt KV and first token, gathers the KV into one
shared-memory segment (``export.py``) and serves it on its bootstrap port; the decode server
given the same ``bootstrap_room`` fetches it (``fetch.py``): by the segment's name when both run
on one host, over the TCP connection otherwise, and continues the request. ``wire.py`` is the
framing both sides speak; ``kv_io.py`` gathers and scatters a request's slots. The scheduler's
side (which request exports, how an imported one is admitted) is ``scheduler/disaggregation.py``.
"""
