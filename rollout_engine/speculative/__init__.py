"""Speculative decoding that keeps RL exact (n-gram proposals, one verify forward per step).

``ngram.py`` (proposals from a request's own tokens), ``verify.py`` (the
verify forward's layout and the acceptance rule), ``scheduler.py`` (the speculative decode step).
Its flags are checked in ``rollout_engine/config/speculative.py``. Nothing is imported here eagerly.
"""
