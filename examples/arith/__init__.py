"""Two-digit addition: the prompt sets (``make_data.py``), the run config and the cold-started policy."""
