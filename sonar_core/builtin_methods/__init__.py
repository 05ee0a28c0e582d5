"""Methods that ship inside sonar-core.

They are plugins like any other: each is named by an entry point of the ``sonar`` group in
sonar-core's own pyproject.toml and loaded by the plugin manager, never imported directly by the
engine, so the allow-list and ``aphrodite plugins`` treat them like third-party methods.
"""
