"""The daemon: configuration, placement, state, slot manager, REST API, reporting and the CLI."""
