"""The pool's side of a Ray node: the actor that starts and owns one worker process
there (host.WorkerHost). It runs on every node, so it imports only the standard
library, `protocol` and `procutil`, never the supervisor (tests/test_layers.py
holds that); the supervisor's side of Ray placement is supervisor/replicas/ray_placement.py."""
