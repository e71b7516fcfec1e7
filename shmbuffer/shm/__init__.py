"""The block in shared memory, below every rule about rows: ``segment`` (the file in ``/dev/shm``,
its header, naming, ownership, creation and attachment), ``lock`` (the process-shared lock that
survives a dead holder) and ``_tracker`` (keeping CPython's resource tracker off our segments)."""
