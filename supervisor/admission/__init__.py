"""Who may ask what, and whether it can be served in time: the one call (admit) and what it reads."""
