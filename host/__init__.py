"""What tandem does on the host's operating system, below every other package.

- ``processes``: child processes tandem owns: free ports to give them, a process group each,
  and ending a group with all it started (never by name).
- ``files``: files replaced whole (``write_atomic``): a reader sees the old content or the new.

It imports no other tandem package; the broker (embedded Redis, the ledger's export), the
service kit, the processes and the entry points all use it.
"""
