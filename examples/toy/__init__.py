"""The toy engine's parts; ``examples/toy_engine.py`` gathers them under one name."""
