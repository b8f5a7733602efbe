"""The service kit, below the four processes: what more than one of them needs.

Config (``config``: the run's TOML; ``settings``: what the processes' settings share), the
payloads that cross a process boundary (``wire``, ``reward_specs``, ``prompt_lines``,
``prompt_forms``), the FastAPI app factory and its security (``app``, ``security``,
``serving``), typed HTTP clients (``clients``), the run registry (``runs``, ``run_states``),
the weight store's format and broadcast group (``weightstore``, ``weightgroup``), evaluation
(``evaluate``), timeline spans (``timeline``) and watchdogs (``watchdog``). It imports the
broker and ``host``, never a process's package.
"""
