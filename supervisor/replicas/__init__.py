"""One replica and its worker process: lifecycle, link, transport, process tree, restarts."""
