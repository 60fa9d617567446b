"""sparrow's release (pyproject.toml says the same), in a module that imports nothing, so any
layer can name it."""

__version__ = "0.1.0"
