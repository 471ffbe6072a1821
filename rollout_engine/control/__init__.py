"""Control calls over a scheduler that does not know they exist: deadlines and deferred answers
(``dispatch.py``), flush and introspection (``introspection.py``), sleep / wake, refit, pause
and versions (``rl_control.py``, its broadcast half ``rl_broadcast.py``, a STANDALONE draft's
refit ``draft_refit.py``), composed over one scheduler in ``handlers.py``. They run between
steps, in arrival order, so they never race a forward pass."""
