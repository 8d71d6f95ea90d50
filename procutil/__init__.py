"""Process helpers with nothing of the pool in them: a leaf package (the standard
library and psutil only) that the supervisor, the worker, the Ray node host, the
tests and the scripts all import, so that each helper exists once.

  groups  signal or stop a process group (stdlib only: the worker imports it)
  tree    a process's descendants; remember them and kill them all
  sample  RSS, CPU and children of a process tree; GPU memory per pid (NVML)
  net     a free loopback port
"""
