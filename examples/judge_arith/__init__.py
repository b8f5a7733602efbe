"""Two-digit sums judged by a reward model: the judge (``judge.py``), the prompt sets (``make_data.py``), the run."""
