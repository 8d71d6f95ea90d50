"""The runtime worker subprocess: one process per replica, one runtime each."""
