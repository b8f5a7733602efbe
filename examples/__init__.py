"""Example tasks and the small models they train, built offline in code.

``examples.tiny`` builds tiny random models (Qwen3 and the other architecture
classes the presets use) with a character tokenizer; ``examples.arith`` is
the two-digit addition task of ``make run``, with its supervised cold start
(``examples.arith.bootstrap``). Nothing here imports tandem's services: the
CLI and the tests use it.
"""
