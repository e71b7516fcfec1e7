"""Which rows to draw, before any row is read: ``sumtree`` (the sum and min tree of prioritized
replay), ``samplers`` (``Uniform``, ``Prioritized``: draws and importance weights), ``ranks``
(several learners' parts of one global draw, keyed on a seed and a step) and ``limiter``
(``RateLimiter``: the samples-per-insert ratio). Nothing here touches shared memory's rows."""
