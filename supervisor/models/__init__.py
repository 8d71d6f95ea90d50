"""The model lifecycle, one state machine (supervisor/states.py MODEL_TRANSITIONS),
split by owner: registry (names, aliases, each model's record and its one
transition function), lifecycle (load, load on demand, unload, drain, restart),
memory (footprints, budgets, eviction, swap wait), reload (the config diff),
views (admin JSON). supervisor/engine.py composes them."""
