"""The way in, in the order a request takes it: listener (the connection and its
bounds) -> guard (keys, browser rules, route, body) -> the surfaces (inference.py,
the admin routes in edge/admin.py) -> admission."""
