"""The top layer: CLI, app, settings and the wiring of real engines, indexes and stores."""
