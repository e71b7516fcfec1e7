"""The commit protocol on the block: ``layout`` (the columns, counters and options a buffer holds),
``rows`` (the row arithmetic), ``lanes`` (the rows that count and the checks of ids),
``ring`` (reservation, the copy, commit stamps, reaping, clear: the writer's half),
``priorities`` (the shared priority tree), ``reader`` (the stamped gather: the reader's half) and
``edits`` (update and delete of stored rows)."""
