"""Speculative decoding that keeps RL exact (n-gram proposals, one verify forward per step).

``options.py`` (flags), ``ngram.py`` (proposals from a request's own tokens), ``verify.py`` (the
verify forward's layout and the acceptance rule), ``scheduler.py`` (the speculative decode step).
Nothing is imported here eagerly: ``config.py`` imports ``options`` while the engine loads.
"""
