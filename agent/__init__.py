"""The daemon: configuration, state, slot manager, REST API, reporting and the CLI."""
